"""``python -m paravt.train`` — PARA-GRPO training, readable top to bottom.

    python -m paravt.train [--preset NAME] [--config F.yaml ...] [--resume [RUN_DIR]] [key=value ...]
    torchrun --nproc-per-node N -m paravt.train ...          (FSDP2; gloo on CPU, NCCL on GPU)

With no arguments it runs the embedded default (preset ``tiny_cpu``): writes the synthetic
long-video task if absent, builds the tiny Qwen3-VL model if absent, cold-starts it with a
short SFT on oracle tool-use trajectories, evaluates, runs PARA-GRPO steps with a progress bar,
evaluates again and prints a before/after table. Everything lands in ``train.out_dir``.

One RL step (``train_step``, its numbered steps)::

    1 collect: prompts ─► K per prompt (gating) ─► rollouts (engine + tools + sub-agents),
      from ``tr.source`` (this rank: ``LocalRollout``; the async workers: ``RolloutPipeline``)
    2 score ─► 3 units (group advantages) ─► 4 packed minibatches, π_ref / π_prox (no grad)
    5 update: PPO epochs × minibatches × micro-batches (``algo.max_tokens_per_microbatch``):
      one packed forward per micro-batch, the trained rows' hidden states through the
      fused ``paravt_kernels.linear_policy_loss`` (``paravt.algo.loss.policy_part_loss``),
      backward; clip, optimizer step per minibatch
    6 publish the weights (``tr.source.publish``) ─► 7 stats (``paravt.step_stats``: one
      all-reduce and one gather over the ranks)

No ``(tokens, vocab)`` logits exist anywhere in a step's log-prob passes: only the rows whose
next token is trained meet the lm_head weight, inside the fused kernels. ``rollout.engine``:
``hf`` (paravt's decode loop) or ``vllm`` (an in-process vLLM engine, ``paravt.engines.vllm``;
its weights are pushed after every step; on a GPU it sleeps during the update).

This file keeps the step and what it touches; the run around them (the loop over the steps,
its one stop path, its ``RunResult``, the exit codes) is ``paravt.run``; the stages live a
floor below: the checks before anything loads (``paravt.validate``), the dataset and model
folders (``paravt.assets``), the prompt order (``paravt.data.sampler``), the held-out
evaluation (``paravt.eval.heldout``), the checkpoints (``paravt.checkpoint``) and the
trajectories kept for the viewer (``paravt.metrics.trajectory_samples``).
"""

from __future__ import annotations

import argparse
import functools
import pickle
import random
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from paravt.agent.loop import PROMPT_TOO_LONG, AgentRunner
from paravt.algo.advantages import apply_kl_reward, build_units
from paravt.algo.guard import NonFiniteGuard
from paravt.algo.logprobs import packed_logprobs
from paravt.algo.loss import (
    agg_denominator,
    make_objective,
    policy_minibatch_backward,
)
from paravt.algo.packing import balance_units, microbatches, pack_units, split_units
from paravt.algo.reference import ReferencePolicy
from paravt.assets import prepare_data, prepare_model, read_datasets
from paravt.checkpoint import (
    Checkpointer,
    CheckpointLoadError,
    load_trainer_state,
    resume_checkpoint,
)
from paravt.config import (
    Config,
    ConfigError,
    ConfigHelpParser,
    load_config,
    preset_errors,
    to_dict,
)
from paravt.data.sampler import PromptSampler
from paravt.distributed import (
    DistContext,
    Precision,
    all_gather_objects,
    all_reduce_sum,
    clip_grad_norm,
    place_reference,
    release_device_cache,
    shard_model,
)
from paravt.engines import engine_spec, make_engine
from paravt.log import get_logger
from paravt.metrics import (
    MetricsLogger,
    ThumbnailStore,
    trajectory_samples,
)
from paravt.models import ModelBundle, load_model_from_config
from paravt.models.loader import freeze_vit
from paravt.plan import device_layout, reference_placement
from paravt.preempt import StepAbandoned
from paravt.rewards import score_groups
from paravt.rollout_source import LocalRollout, RolloutSource
from paravt.run import RunResult, command
from paravt.run import run as run_steps
from paravt.sft import run_sft
from paravt.step_stats import StepResult, StepStats
from paravt.trainer import Trainer
from paravt.types import PackedBatch, RolloutBatch
from paravt.video import probe
from paravt.workers import RolloutPipeline
from paravt.workers.roles import AsyncRoles

log = get_logger(__name__)

# ----------------------------------------------------------------------------------- config


def parse_args(argv: Sequence[str] | None) -> tuple[Config, argparse.Namespace]:
    """The command line as a validated ``Config``. ``--resume RUN_DIR`` takes the run's own
    ``RUN_DIR/config.yaml`` as the base (then ``--config`` files and ``key=value`` overrides,
    which ``paravt.runfolder`` checks against the run as for any resume) and ``RUN_DIR`` as
    ``train.out_dir``; a bare ``--resume`` resumes ``train.out_dir`` as the other arguments
    resolve it."""
    p = ConfigHelpParser(prog="python -m paravt.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny_cpu", help="see the presets below")
    p.add_argument("--config", action="append", default=[], help="YAML file (repeatable)")
    p.add_argument(
        "--resume",
        nargs="?",
        const="",
        default=None,
        metavar="RUN_DIR",
        help="continue a run from its latest checkpoint: the run in RUN_DIR with the settings "
        "of RUN_DIR/config.yaml (no need to retype them), or, without RUN_DIR, the run in "
        "train.out_dir as the other arguments give it. A key=value that changes a setting "
        "of the run is refused, naming it",
    )
    p.add_argument("overrides", nargs="*", help="dotted key=value, e.g. algo.kl_coef=0.02")
    # Intermixed: `k=v --resume k2=v2` (overrides on both sides of a flag) is one command line.
    a = p.parse_intermixed_args(_bare_resume(sys.argv[1:] if argv is None else argv))
    files, overrides = list(a.config), list(a.overrides)
    if a.resume:
        files.insert(0, str(_run_config(a.resume)))
    cfg = load_config(a.preset, files, overrides)
    if errs := preset_errors(a.preset, cfg):
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errs))
    if a.resume:
        given = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "train.out_dir"]
        if given and Path(cfg.train.out_dir).resolve() != Path(a.resume).resolve():
            raise ConfigError(
                f"--resume {a.resume} names the run folder, and train.out_dir={given[-1]} "
                "another one: drop train.out_dir (the folder given to --resume is the run's)"
            )
        cfg.train.out_dir = a.resume
    if a.resume is not None:
        cfg.train.resume = True
    return cfg, a


#: A command-line item that is a ``key=value`` override (a run folder never matches: a dotted
#: key holds no ``/``).
_OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")


def _bare_resume(argv: Sequence[str]) -> list[str]:
    """``argv`` with a ``--resume`` that an override follows (``--resume train.steps=60``:
    the bare form, ``make train ARGS="--resume k=v"``) spelt ``--resume=``, so that argparse
    does not take the override for ``RUN_DIR``."""
    out = list(argv)
    for i, item in enumerate(out[:-1]):
        if item == "--resume" and _OVERRIDE.match(out[i + 1]):
            out[i] = "--resume="
    return out


def _run_config(run_dir: str) -> Path:
    """``run_dir/config.yaml``, the resolved settings a run wrote at its start; a
    ``ConfigError`` naming what is there instead when it is missing."""
    path = Path(run_dir) / "config.yaml"
    if path.is_file():
        return path
    what = "is not a folder" if not Path(run_dir).is_dir() else "holds no config.yaml"
    raise ConfigError(
        f"--resume {run_dir}: {what}, so it is no run folder of python -m paravt.train (each "
        "writes its config.yaml first). Pass the folder a run wrote (its train.out_dir), or "
        "--resume alone to resume train.out_dir as the other arguments give it"
    )


def untrained_start(cfg: Config) -> str:
    """Why RL would start from weights nothing trained ('' when it would not): no
    ``model.path`` (the tiny model, built with random weights) or ``model.init=random``, and
    no cold start (``sft.steps=0``). Such a policy has never seen the answer or the tool-call
    format, so its rollouts earn near-equal rewards and the group advantages are near zero:
    the run learns little. ``build_trainer`` warns with it before RL starts from step 0."""
    m = cfg.model
    if cfg.sft.steps > 0 or cfg.train.steps < 1 or (m.path and m.init != "random"):
        return ""
    weights = (
        f"model.init=random ({m.config}'s architecture)"
        if m.init == "random"
        else "the tiny model (model.path is empty)"
    )
    return (
        f"RL starts from random weights, {weights}, with no cold start (sft.steps=0): it has "
        "never seen the answer or tool-call format, so its rollouts earn near-equal rewards "
        "and RL learns little. Set sft.steps > 0 (the cold start on tool-use records) or "
        "model.path=A_TRAINED_CHECKPOINT"
    )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


# --------------------------------------------------------------------------------- state


def build_trainer(cfg: Config, ctx: DistContext, roles: AsyncRoles | None = None) -> Trainer:
    """Everything a step touches, once: data, SFT cold start, policy, reference, engine,
    optimizer, the rollout source (``roles``: this trainer rank's view of an asynchronous run,
    whose workers then roll out; None: this rank rolls out itself), the resumed state."""
    t = cfg.train
    out = Path(t.out_dir)
    # 0. Data first: a malformed row fails before any model is built or loaded.
    data_dir = prepare_data(cfg, ctx)
    train_samples, val_samples = read_datasets(cfg, data_dir)
    model_dir = prepare_model(cfg, ctx)

    # 1. SFT cold start (once per run folder; a resumed run reuses it).
    init_dir = model_dir
    if cfg.sft.steps > 0:
        init_dir = str(out / "sft")
        if not (Path(init_dir) / "config.json").is_file():
            res = run_sft(cfg, model_dir=model_dir, data_dir=data_dir, out_dir=init_dir, ctx=ctx)
            log.info(
                f"[sft] {cfg.sft.steps} steps, nll/token {res['sft/loss_first']:.3f} -> "
                f"{res['sft/loss_last']:.3f} ({res['sft/seconds']:.0f} s)"
            )

    # 2. Policy (from the latest checkpoint on --resume), reference, engine.
    # Checked before anything loads (paravt.checkpoint.resume_checkpoint): this run's own
    # files, intact, read without running code; else one line, or the newest intact one
    # under train.resume_fallback.
    ckpt = resume_checkpoint(out, ctx, fallback=t.resume_fallback) if t.resume else None
    if t.resume and ckpt is None:
        log.info(f"[train] --resume: no checkpoint in {out}/checkpoints; starting from step 0")
    if ckpt is None and ctx.is_main and (why := untrained_start(cfg)):
        log.warning(f"[train] warning: {why}")

    def load(path: str | Path, dtype: str | None = None, device: str = "") -> ModelBundle:
        return load_model_from_config(
            path, cfg.model, device=device or str(ctx.device), dtype=dtype
        )

    # The policy holds the masters (train.master_dtype); the reference model and the HF
    # engine's replica hold the compute dtype (model.dtype); see paravt.distributed.Precision.
    prec = Precision.from_config(cfg)
    if not prec.mixed and cfg.model.dtype != "float32" and ctx.is_main:
        log.warning(
            f"[train] warning: train.master_dtype={cfg.train.master_dtype} (as model.dtype): "
            "the trained weights and AdamW's moments are "
            f"{cfg.model.dtype}; an update smaller than half a {cfg.model.dtype} ulp of its "
            "weight rounds away (at lr 2e-6 most do: the policy barely moves). "
            "train.master_dtype=float32 keeps float32 masters under the same compute."
        )
    st = load_trainer_state(ckpt) if ckpt is not None else None
    bundle = load(ckpt or init_dir, dtype=cfg.train.master_dtype)
    policy = bundle.model
    if st is not None and "masters" in st:  # a format-1 checkpoint's full masters (sharded
        policy.load_state_dict(st["masters"])  # ones: load_train_state, after sharding)
    if cfg.algo.freeze_vision_tower:
        freeze_vit(policy)  # before sharding and the optimizer: frozen tensors never train
    if cfg.model.gradient_checkpointing and hasattr(policy, "gradient_checkpointing_enable"):
        policy.gradient_checkpointing_enable()
    objective = make_objective(cfg.algo)
    reference = None
    if objective.needs_ref:
        # Replicated, sharded like the policy or offloaded, as the memory plan chooses
        # (algo.ref_placement); loaded on the host unless replicated, so no rank ever holds a
        # full copy on its device for a placement that avoids it.
        where, why = reference_placement(cfg, device_layout(cfg, ctx.device, ctx.world_size))
        reference = ReferencePolicy(
            load(init_dir, device="" if where == "replicate" else "cpu").model
        )
        place_reference(reference.model, ctx, where)  # frozen first: FSDP2 sees no grads
        log.info(f"[train] reference model: {where} ({why})")
    builds_engine = roles is None or t.eval_prompts > 0  # (async: to evaluate)
    own_weights = engine_spec(cfg.rollout.engine).own_weights
    if builds_engine and (ctx.distributed or prec.mixed) and not own_weights:
        # The HF engine decodes with its own full replica in the compute dtype: sharded
        # parameters cannot generate (every decode step would be a collective over ranks that
        # stop at different times), and masters are not what the policy computes with.
        engine_bundle = load(ckpt or init_dir)
    else:
        # Colocated: one process, or vLLM (which loads its own copy from the checkpoint, and
        # gets the policy's weights streamed after each update: no HF replica anywhere).
        engine_bundle = bundle
    shard_model(policy, ctx, prec)  # one rank, one dtype: a no-op
    engine = runner = None
    if builds_engine:
        engine = make_engine(cfg, engine_bundle)
        runner = AgentRunner(engine, engine_bundle, cfg)  # its planner: cfg.video's

    # 3. Optimizer and schedule (linear warm-up, then constant).
    optimizer = torch.optim.AdamW(
        [p for p in policy.parameters() if p.requires_grad],
        lr=cfg.algo.lr,
        weight_decay=cfg.algo.weight_decay,
    )
    warm = cfg.algo.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warm) if warm > 0 else 1.0
    )

    # 4. Where the rollouts come from: this rank, or the asynchronous workers (which start on
    # the first η + 1 steps once ``source.start`` runs, while the trainer evaluates).
    sampler = PromptSampler(train_samples, seed=t.seed)
    source: RolloutSource
    if roles is None:
        assert runner is not None and engine is not None
        source = LocalRollout(cfg, ctx, sampler, runner, engine)
    else:
        source = RolloutPipeline(cfg, ctx, roles, sampler, engine, bundle)

    logger = MetricsLogger(
        out, enabled=ctx.is_main, wandb=t.wandb, run_name=out.name, config=to_dict(cfg),
        on_disk_full=t.on_save_error,
    )  # fmt: skip
    # video path -> VideoMeta: the runner's probe cache; an engine-less asynchronous trainer
    # probes (``probe`` caches what it read per file).
    video_meta = (
        runner.meta
        if runner is not None
        else functools.partial(probe, timeout_s=cfg.video.decode_timeout_s)
    )
    trainer = Trainer(
        cfg, ctx, policy, bundle, engine, runner, reference, objective, optimizer, scheduler,
        source, val_samples, logger, init_dir, video_meta,
    )  # fmt: skip
    if ctx.is_main:
        trainer.thumbs = ThumbnailStore(
            out, max_bytes=int(t.viewer_max_mb * 1e6), max_px=t.viewer_thumb_px, disk=logger.disk
        )

    trainer.checkpointer = Checkpointer.from_config(
        cfg, ctx, policy, optimizer, states={"trainer": trainer},
        tokenizer=bundle.tokenizer, source_dir=init_dir,
    )  # fmt: skip

    # 5. Resume: optimizer, schedule, RNG, data position; metrics past the checkpoint dropped.
    if st is not None:
        assert ckpt is not None  # set with st
        try:  # (and the sharded masters; then Trainer.load_state_dict: schedule, data, RNG)
            trainer.checkpointer.load(ckpt, st)
        except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
            # An unverified checkpoint (an older paravt's: no manifest) whose shards are torn.
            raise CheckpointLoadError(
                f"--resume refused: checkpoint step {st['step']} ({ckpt}): its training state "
                f"cannot be read ({type(e).__name__}: {str(e).strip()[:200]}). Remove that "
                "folder so that --resume takes the one before, or start a new train.out_dir"
            ) from e
        log.info(f"[train] resumed from {ckpt} (step {trainer.start_step})")
    else:
        seed_everything(t.seed + ctx.rank)
    if t.resume:  # metrics past the start dropped (no checkpoint: every row of the old run)
        logger.truncate_after(trainer.start_step)
    return trainer


# ---------------------------------------------------------------------------------- step


def train_step(tr: Trainer, step: int) -> StepResult:
    """One PARA-GRPO step, top to bottom; returns its metrics row (global over ranks, on every
    rank) and every rank's skipped prompts' errors (``StepResult``). Each phase's seconds are
    ``time/<phase>`` (``Trainer.phase``)."""
    cfg, ctx, algo = tr.cfg, tr.ctx, tr.cfg.algo
    tr.times = {}
    t_step = time.perf_counter()
    stats = StepStats()

    # 1. Collect: the step's prompts, their frame budgets K and G rollouts each (main agents,
    # parallel crops, sub-agents), rolled out by this rank or by the asynchronous workers.
    with tr.phase(step, "rollout"):
        tr.policy.eval()
        batch = tr.source.collect(step, tr.preempt)
        # The engine sleeps now: what the rollout cached (decode, HF KV cache) goes back too.
        released = release_cache(tr)
    # Preemption (paravt.preempt): nothing this step changed is saved state yet. After a
    # SIGTERM/SIGUSR1 on any rank, every rank abandons the step here if finishing it would pass
    # train.preempt_grace_s; otherwise the step is finished and the run stops after it.
    if batch is None or (tr.preempt is not None and tr.preempt.should_abandon()):
        raise StepAbandoned(step)

    # A prompt whose question alone fills the engine's context generated nothing, but its G
    # rows would still go through every forward (minutes on a CPU, an OOM on a GPU): skipped
    # here, as the evaluation skips it (an error row of kind "context"), and counted.
    stats.add(skipped_context=float(drop_unfit_prompts(batch)))

    # 2. Score: rewards (sub-agents inherit their parent's). A non-finite reward or advantage on
    # any rank skips the step's update on every rank (paravt.algo.guard); so do a non-finite
    # loss or gradient norm, per optimizer step.
    with tr.phase(step, "reward"):
        score_groups(batch.groups, cfg.reward)
        guard = NonFiniteGuard(ctx, step)
        guard.check_rewards(batch.groups)

    # 3. Units: each main rollout with its sub-agents and its group advantage, cut into
    # minibatches (the same global ones on every rank, about the same tokens each).
    # 4. Pack them, and the reference / proximal log-probs (no grad).
    with tr.phase(step, "logprobs"):
        units = build_units(batch.groups, algo, ctx.device)
        guard.check_advantages(units)
        # Each main rollout's group advantage, before balancing moves units between ranks
        # (the tool-vs-no-tool advantage metrics, adv/*).
        advantage = {u.main.uid: u.advantage for u in units}
        buckets = split_units(units, algo.minibatches)
        if algo.balance_ranks:
            buckets, stats.extra = balance_units(buckets, ctx, algo.share_prefix)
            units = [u for b in buckets for u in b]
        batches = [pack_units(mb, algo.share_prefix) for mb in buckets]
        old_logprobs(tr, batches, stats)
    if cfg.train.dump_batches:
        _dump_batches(tr, step, batches)

    # 5. Update: PPO epochs × minibatches, packed micro-batch forward/backward through the
    # fused loss, one optimizer step each.
    with tr.phase(step, "update"):
        update_policy(tr, step, batches, len(units), guard, stats)

    # 6. Publish the new weights to whoever rolls out next (this rank's engine, or streamed to
    # the workers as version ``step``, which admits the prompts that version allows).
    # The update's cached-but-free memory goes back to the driver first: vLLM's wake
    # allocates outside PyTorch (paravt.distributed.release_device_cache).
    with tr.phase(step, "sync"):
        released += release_cache(tr)
        tr.source.publish(tr.policy, step)

    # 7. Stats: every rank's sums in one all-reduce, the trajectory records in one gather.
    # A background checkpoint (train.async_save) whose write every rank has finished is
    # committed here (it becomes ``latest``): the ranks agree in that same all-reduce.
    with tr.phase(step, "metrics"):
        stats.add_rollout(batch, units, batches, advantage)
        stats.add(save_written=float(tr.checkpoint_written()))
        reduced = stats.reduce(ctx)
        if reduced.sums["save_written"] >= ctx.world_size:
            tr.finish_checkpoint()
        done = reduced.result(
            stats,
            batch,
            seconds=time.perf_counter() - t_step,
            lr=float(tr.scheduler.get_last_lr()[0]),
            times=tr.times,
            released_bytes=released,
            guard=guard.metrics(),
            push=tr.source.push_metrics(),
        )
        if ctx.is_main and cfg.train.log_trajectories:
            tr.logger.log_trajectories(
                step,
                trajectory_samples(batch.groups, cfg.train.log_trajectories,
                                   video_meta=tr.video_meta, store=tr.thumbs),
            )  # fmt: skip
    return done


def drop_unfit_prompts(batch: RolloutBatch) -> int:
    """Remove from ``batch.groups`` every group whose prompt alone (overview frames and
    question) left no room in the engine's context: each of its rollouts ended before its
    first turn with the agent loop's ``PROMPT_TOO_LONG`` error (``paravt.agent.loop``). Its
    error joins ``batch.errors`` (the step's skipped prompts, quoted by the empty-step alarm);
    returns how many were dropped (``skipped_context`` in the step's metrics). Called by
    :func:`train_step` before scoring; the evaluation's ``runner`` makes the same case an
    error row of kind ``"context"``."""
    kept, dropped = [], 0
    for g in batch.groups:
        said = [x for t in g.trajectories if not t.turns for x in t.errors if PROMPT_TOO_LONG in x]
        if g.trajectories and said and all(not t.turns for t in g.trajectories):
            batch.errors.append(f"sample {g.sample.id}: {said[0]} (not trained)")
            dropped += 1
        else:
            kept.append(g)
    batch.groups = kept
    return dropped


def release_cache(tr: Trainer) -> int:
    """Between phases of ``train_step`` (after the rollout, before the weight push): the
    device's cached-but-free memory back to the driver when ``train.empty_cache`` is on
    (``paravt.distributed.release_device_cache``); the bytes released (0 off CUDA)."""
    return release_device_cache(tr.ctx.device) if tr.cfg.train.empty_cache else 0


def old_logprobs(tr: Trainer, batches: list[PackedBatch], stats: StepStats) -> None:
    """Step 4's no-grad passes over each packed minibatch: π_ref (``algo.kl_coef`` > 0) and
    π_prox (the decoupled objective) log-probs, then ``algo.kl_mode=reward``'s KL penalty
    folded into the advantages (its sum and rows into ``stats``)."""
    algo = tr.cfg.algo
    with torch.no_grad():
        for b in batches:
            if tr.reference is not None:
                b.ref_logprobs = tr.reference.logprobs(b, max_tokens=algo.max_tokens_per_microbatch)
            if tr.objective.needs_prox:
                b.prox_logprobs = proximal_logprobs(tr, b)
            pen = apply_kl_reward(b, algo)
            stats.add(kl_pen=float(pen.sum()), kl_rows=float(pen.numel()))


def update_policy(
    tr: Trainer,
    step: int,
    batches: list[PackedBatch],
    n_units: int,
    guard: NonFiniteGuard,
    stats: StepStats,
) -> None:
    """Step 5: ``algo.ppo_epochs`` × minibatches; per minibatch, micro-batches by token budget
    (``algo.max_tokens_per_microbatch``), one packed forward + fused loss + backward each, then
    clip and one optimizer step (skipped on every rank when the loss or gradient norm is not
    finite). ``n_units``: this rank's units; a rank with none (every prompt failed to decode)
    skips the step's update on every rank (FSDP ranks take the same optimizer steps)."""
    algo, ctx = tr.cfg.algo, tr.ctx
    params = [p for p in tr.policy.parameters() if p.requires_grad]
    tr.policy.train()  # Qwen-VL has no dropout by default; train mode enables grad checkpointing
    epochs = algo.ppo_epochs if min(all_gather_objects(n_units, ctx)) > 0 else 0
    if epochs == 0:
        log.info(f"[train] step {step}: a rank has no trajectories (videos unreadable); no update")
    epochs = guard.planned_epochs(epochs, len(batches))
    for _ in range(epochs):
        for b in batches:
            local_den = agg_denominator(tr.objective.effective_mask(b), b, algo.agg)
            global_den = float(all_reduce_sum(torch.tensor([local_den]), ctx)[0])
            # Under FSDP every rank runs the same number of forwards (max over ranks).
            parts = microbatches(b, algo.max_tokens_per_microbatch)
            n_parts = int(max(all_gather_objects(len(parts), ctx)))
            res = policy_minibatch_backward(
                tr.policy, b, tr.objective, global_den=global_den,
                max_tokens=algo.max_tokens_per_microbatch, world=ctx.world_size, parts=parts,
                num_parts=n_parts,
            )  # fmt: skip
            grad_norm = clip_grad_norm(params, algo.max_grad_norm)
            finite = guard.update_is_finite(res.loss_num, grad_norm, b.uids)
            if finite:  # else skipped: parameters, AdamW moments and the schedule stay as is
                tr.optimizer.step()
                tr.scheduler.step()
            tr.optimizer.zero_grad(set_to_none=True)
            if finite:  # a skipped update adds nothing to the loss / grad-norm metrics
                stats.add_update(res, local_den, grad_norm)
    tr.policy.eval()


def proximal_logprobs(tr: Trainer, batch: PackedBatch) -> torch.Tensor:
    """π_prox: the policy before this step's updates, no-grad packed forwards (one per
    micro-batch of ``algo.max_tokens_per_microbatch`` tokens; ``packed_logprobs``) through
    the policy itself (under FSDP2 the sharded policy: no replica is needed for it; the
    root is resharded after each no-grad forward, see ``paravt.models.forward.as_root_forward``).
    """
    # Each row under its own sampling T / top-p; packed forwards (algo.max_tokens_per_microbatch).
    lp, _ = packed_logprobs(tr.policy, batch, max_tokens=tr.cfg.algo.max_tokens_per_microbatch)
    return lp.float().cpu()


def _dump_batches(tr: Trainer, step: int, batches: list[PackedBatch]) -> None:
    """``train.dump_batches``: the step's packed batches of this rank, for parity tests."""
    dump = Path(tr.cfg.train.out_dir) / "debug" / f"step{step}_rank{tr.ctx.rank}.pt"
    with tr.logger.disk.guard("debug batch dump", dump):  # a full disk: train.on_save_error
        dump.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"batches": batches, "world_size": tr.ctx.world_size}, dump)


# ---------------------------------------------------------------------------------- main


def run(cfg: Config, *, keep_handlers: bool = False) -> RunResult:
    """Train with a validated config: ``paravt.run.run`` (the loop, its one stop path, its
    typed result) driving :func:`build_trainer` and :func:`train_step`. A SIGTERM/SIGUSR1
    stops it early (``RunResult.stopped``); ``keep_handlers``: the run's signal handlers stay
    until the process exits, as ``main`` does."""
    return run_steps(cfg, build_trainer, train_step, keep_handlers=keep_handlers)


def main(argv: Sequence[str] | None = None, *, keep_handlers: bool = False) -> int:
    """The command line (``paravt.run.command``: the exit codes); ``keep_handlers``
    (``python -m paravt.train``): the preemption handlers stay until the process exits, so a
    repeated signal during the teardown after the ``[preempt]`` line cannot turn its exit 0
    into 143."""
    return command(lambda: parse_args(argv)[0], lambda c: run(c, keep_handlers=keep_handlers))


if __name__ == "__main__":
    raise SystemExit(main(keep_handlers=True))
