"""``python -m paravt.train`` — PARA-GRPO training, readable top to bottom.

    python -m paravt.train [--preset NAME] [--config F.yaml ...] [--resume] [key=value ...]
    torchrun --nproc-per-node N -m paravt.train ...          (FSDP2; gloo on CPU, NCCL on GPU)

With no arguments it runs the embedded default (preset ``tiny_cpu``): writes the synthetic
long-video task if absent, builds the tiny Qwen3-VL model if absent, cold-starts it with a
short SFT on oracle tool-use trajectories, evaluates, runs PARA-GRPO steps with a progress bar,
evaluates again and prints a before/after table. Everything lands in ``train.out_dir``.

One RL step (``train_step``)::

    prompts ─► K per prompt (gating) ─► rollouts (engine + tools + sub-agents) ─► rewards
      ─► group advantages ─► packed minibatches ─► π_ref / π_prox log-probs (no grad)
      ─► PPO epochs × minibatches × micro-batches (``algo.max_tokens_per_microbatch``):
         one packed forward per micro-batch, the trained rows' hidden states through the
         fused ``paravt_kernels.linear_policy_loss`` (``paravt.algo.loss.policy_part_loss``),
         backward; clip, optimizer step per minibatch
      ─► push weights to the engine ─► metrics

No ``(tokens, vocab)`` logits exist anywhere in a step's log-prob passes: only the rows whose
next token is trained meet the lm_head weight, inside the fused kernels. ``rollout.engine``:
``hf`` (paravt's decode loop) or ``vllm`` (an in-process vLLM engine, ``paravt.rollout.vllm``;
its weights are pushed after every step; on a GPU it sleeps during the update).

This file keeps the run and the step; the stages around them live a floor below, each in
its own module: the checks before anything loads (``paravt.validate``), the dataset and model
folders (``paravt.assets``, shared with ``paravt.sft``), the prompt order
(``paravt.data.sampler``), the held-out evaluation (``paravt.eval.heldout``), the checkpoint
of the whole trainer (``paravt.checkpoint.save_trainer``) and the trajectories kept for the
viewer (``paravt.metrics.trajectory_samples``).
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paravt.agent.loop import AgentRunner, stable_seed
from paravt.alarms import CollapseDetector, EmptySteps, EmptyStepsError
from paravt.algo.advantages import apply_kl_reward, build_units
from paravt.algo.gating import step_budgets
from paravt.algo.guard import NonFiniteGuard
from paravt.algo.logprobs import packed_logprobs
from paravt.algo.loss import (
    PolicyObjective,
    agg_denominator,
    make_objective,
    policy_minibatch_backward,
)
from paravt.algo.packing import balance_units, microbatches, pack_units, split_units
from paravt.algo.reference import ReferencePolicy
from paravt.assets import prepare_data, prepare_model, read_datasets
from paravt.checkpoint import (
    CheckpointSaveError,
    latest_checkpoint,
    load_trainer_state,
    rng_state,
    save_trainer,
    set_rng_state,
    step_dirname,
)
from paravt.config import (
    Config,
    ConfigError,
    ConfigHelpParser,
    load_config,
    preset_errors,
    to_dict,
    to_yaml,
)
from paravt.data.readers import DatasetError
from paravt.data.sampler import PromptSampler
from paravt.distributed import (
    DistContext,
    Precision,
    all_gather_objects,
    all_reduce_sum,
    cleanup,
    clip_grad_norm,
    full_weights,
    init_distributed,
    is_sharded,
    load_full_optimizer_state,
    peer_lost,
    release_single_rank_group,
    shard_list,
    shard_model,
    world_size_from_env,
)
from paravt.eval.heldout import evaluate, table_rows
from paravt.files import FolderBusy, NotRegularFile, claim_folder, write_atomic
from paravt.metrics import (
    DiskFullError,
    MetricsLogger,
    RunFolderWrites,
    ThumbnailStore,
    format_table,
    plot_summary,
    postfix,
    progress_bar,
    read_metrics,
    rollout_metrics,
    trajectory_record,
    trajectory_samples,
)
from paravt.models import ModelBundle, load_model_from_config
from paravt.plan import check_device_memory
from paravt.preempt import Preemption, SFTPreempted, StepAbandoned
from paravt.rewards import score_groups
from paravt.rollout import engine_spec, make_engine
from paravt.rollout.engine import Engine
from paravt.runfolder import check_run_folder, logged_eval, record_run
from paravt.sft import freeze_vit, run_sft
from paravt.types import RolloutBatch, Sample, VideoMeta
from paravt.validate import validate_run
from paravt.video import probe
from paravt.workers import RolloutPipeline, TrainerGone, WorkerFailed, init_async, run_worker
from paravt.workers.roles import pin_worker_gpu

# ----------------------------------------------------------------------------------- config


def parse_args(argv: Sequence[str] | None) -> tuple[Config, argparse.Namespace]:
    p = ConfigHelpParser(prog="python -m paravt.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny_cpu", help="see the presets below")
    p.add_argument("--config", action="append", default=[], help="YAML file (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("overrides", nargs="*", help="dotted key=value, e.g. algo.kl_coef=0.02")
    # Intermixed: `k=v --resume k2=v2` (overrides on both sides of a flag) is one command line.
    a = p.parse_intermixed_args(argv)
    cfg = load_config(a.preset, a.config, a.overrides)
    if errs := preset_errors(a.preset, cfg):
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errs))
    if a.resume:
        cfg.train.resume = True
    return cfg, a


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


# --------------------------------------------------------------------------------- state


@dataclass
class Trainer:
    """Everything a step touches (built once by ``build_trainer``)."""

    cfg: Config
    ctx: DistContext
    policy: torch.nn.Module
    bundle: ModelBundle  # the policy's (tokenizer, vision spec)
    engine: Engine | None  # None: an asynchronous trainer rank without an evaluation engine
    runner: AgentRunner | None  # the agent loop over ``engine`` (None with it)
    reference: ReferencePolicy | None  # None: no KL term (algo.kl_coef = 0)
    objective: PolicyObjective
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: PromptSampler
    val_samples: list[Sample]
    logger: MetricsLogger
    init_dir: str
    start_step: int = 0
    thumbs: ThumbnailStore | None = None  # the viewer's overview thumbnails (rank 0)
    preempt: Preemption | None = None  # the run's signal handling (None: no mid-step check)
    # Asynchronous run (rollout.workers > 0): the rollout workers' trainer end
    # (paravt.workers.RolloutPipeline); None: this process rolls out itself (synchronous).
    pipeline: RolloutPipeline | None = None
    # video path -> VideoMeta (the runner's probe cache, or a probe), for the viewer's records
    video_meta: Callable[[str], VideoMeta] | None = None
    # The skipped prompts' errors of the last step that trained on nothing (every rank's):
    # what the empty-step alarm and error quote (paravt.alarms.EmptySteps).
    empty_errors: list[str] = field(default_factory=list)


def build_trainer(cfg: Config, ctx: Any) -> Trainer:
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
            if ctx.is_main:
                print(
                    f"[sft] {cfg.sft.steps} steps, nll/token {res['sft/loss_first']:.3f} -> "
                    f"{res['sft/loss_last']:.3f} ({res['sft/seconds']:.0f} s)"
                )

    # 2. Policy (from the latest checkpoint on --resume), reference, engine.
    ckpt = latest_checkpoint(out) if t.resume else None
    if t.resume and ckpt is None and ctx.is_main:
        print(f"[train] --resume: no checkpoint in {out}/checkpoints; starting from step 0")

    def load(path: Any, dtype: str | None = None) -> Any:
        return load_model_from_config(path, cfg.model, device=str(ctx.device), dtype=dtype)

    # The policy holds the masters (train.master_dtype); the reference model and the HF
    # engine's replica hold the compute dtype (model.dtype); see paravt.distributed.Precision.
    prec = Precision.from_config(cfg)
    if not prec.mixed and cfg.model.dtype != "float32" and ctx.is_main:
        print(
            f"[train] warning: train.master_dtype={cfg.train.master_dtype} (as model.dtype): "
            "the trained weights and AdamW's moments are "
            f"{cfg.model.dtype}; an update smaller than half a {cfg.model.dtype} ulp of its "
            "weight rounds away (at lr 2e-6 most do: the policy barely moves). "
            "train.master_dtype=float32 keeps float32 masters under the same compute.",
            file=sys.stderr,
            flush=True,
        )
    st = load_trainer_state(ckpt) if ckpt is not None else None
    bundle = load(ckpt or init_dir, dtype=cfg.train.master_dtype)
    policy = bundle.model
    if st is not None and "masters" in st:  # the exact masters (the HF export is their cast)
        policy.load_state_dict(st["masters"])
    if cfg.algo.freeze_vision_tower:
        freeze_vit(policy)  # before sharding and the optimizer: frozen tensors never train
    if cfg.model.gradient_checkpointing and hasattr(policy, "gradient_checkpointing_enable"):
        policy.gradient_checkpointing_enable()
    objective = make_objective(cfg.algo)
    reference = None
    if objective.needs_ref:
        reference = ReferencePolicy(load(init_dir).model)
    builds_engine = cfg.rollout.workers == 0 or t.eval_prompts > 0  # (async: to evaluate)
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

    sampler = PromptSampler(train_samples, seed=t.seed)

    logger = MetricsLogger(
        out, enabled=ctx.is_main, wandb=t.wandb, run_name=out.name, config=to_dict(cfg),
        on_disk_full=t.on_save_error,
    )  # fmt: skip
    trainer = Trainer(
        cfg, ctx, policy, bundle, engine, runner, reference, objective, optimizer, scheduler,
        sampler, val_samples, logger, init_dir,
    )  # fmt: skip

    trainer.video_meta = runner.meta if runner is not None else _video_meta(cfg)
    if ctx.is_main:
        trainer.thumbs = ThumbnailStore(
            out, max_bytes=int(t.viewer_max_mb * 1e6), max_px=t.viewer_thumb_px, disk=logger.disk
        )

    # 4. Resume: optimizer, schedule, RNG, data position; metrics past the checkpoint dropped.
    if st is not None:
        load_full_optimizer_state(policy, optimizer, st["optimizer"], ctx)
        scheduler.load_state_dict(st["scheduler"])
        sampler.load(st["data"])
        rngs = st.get("rng", [])
        if len(rngs) == ctx.world_size:
            set_rng_state(rngs[ctx.rank])
        trainer.start_step = int(st["step"])
        if ctx.is_main:
            print(f"[train] resumed from {ckpt} (step {trainer.start_step})")
    else:
        seed_everything(t.seed + ctx.rank)
    if t.resume:  # metrics past the start dropped (no checkpoint: every row of the old run)
        logger.truncate_after(trainer.start_step)
    return trainer


# ---------------------------------------------------------------------------------- step


def train_step(tr: Trainer, step: int) -> dict[str, float]:
    """One PARA-GRPO step; returns the step's metrics (global over ranks, on every rank)."""
    cfg, ctx = tr.cfg, tr.ctx
    times: dict[str, float] = {}
    t_step = time.perf_counter()
    if tr.pipeline is not None:  # asynchronous: the workers rolled this step out already
        _enter(tr, step, "rollout")
        t0 = time.perf_counter()
        tr.policy.eval()
        batch = tr.pipeline.collect(step, tr.preempt)
        times["time/rollout"] = time.perf_counter() - t0  # the trainer's wait for it
        if batch is None or (tr.preempt is not None and tr.preempt.should_abandon()):
            raise StepAbandoned(step)
    else:
        batch = _rollout(tr, step, times)
    groups = batch.groups

    # 3. Rewards (sub-agents inherit their parent's). A non-finite reward or advantage on any
    # rank skips the step's update on every rank (paravt.algo.guard); so do a non-finite loss
    # or gradient norm, per optimizer step.
    _enter(tr, step, "reward")
    t0 = time.perf_counter()
    score_groups(groups, cfg.reward)
    guard = NonFiniteGuard(ctx, step)
    guard.check_rewards(groups)
    times["time/reward"] = time.perf_counter() - t0
    return _learn(tr, step, batch, guard, times, t_step)


def _rollout(tr: Trainer, step: int, times: dict[str, float]) -> RolloutBatch:
    """Steps 1-2 of a synchronous step: this rank's prompts, their K, the rollouts."""
    cfg, ctx = tr.cfg, tr.ctx

    # 1. Prompts and their frame budgets K (stable hash of seed, epoch, sample id).
    picked = shard_list(tr.sampler.next(cfg.train.prompts_per_step), ctx)
    samples = [s for s, _ in picked]
    budgets = step_budgets(picked, cfg)

    # 2. Roll out G samples per prompt (main agents, parallel crops, sub-agents).
    _enter(tr, step, "rollout")
    t0 = time.perf_counter()
    tr.policy.eval()
    groups = tr.runner.rollout(
        samples, budgets, group_size=cfg.rollout.group_size, seed=stable_seed(cfg.train.seed, step)
    )
    times["time/rollout"] = time.perf_counter() - t0
    # GPU vLLM: free the device for the update (weights to host, KV cache dropped); the weight
    # push of step 6 wakes it. A no-op for the HF engine and on the CPU.
    getattr(tr.engine, "sleep", lambda: None)()
    # Preemption (paravt.preempt): nothing this step changed is saved state yet. After a
    # SIGTERM/SIGUSR1 on any rank, every rank abandons the step here if finishing it would pass
    # train.preempt_grace_s; otherwise the step is finished and the run stops after it.
    if tr.preempt is not None and tr.preempt.should_abandon():
        raise StepAbandoned(step)
    return RolloutBatch(groups, list(tr.runner.errors), tr.runner.stats)


def _learn(
    tr: Trainer,
    step: int,
    batch: RolloutBatch,
    guard: NonFiniteGuard,
    times: dict[str, float],
    t_step: float,
) -> dict[str, float]:
    """Steps 4-7 of a step: advantages, the update, the weight push, the metrics."""
    cfg, ctx, algo, groups = tr.cfg, tr.ctx, tr.cfg.algo, batch.groups

    # 4. Advantages, packed minibatches, reference / proximal log-probs (no grad).
    _enter(tr, step, "logprobs")
    t0 = time.perf_counter()
    units = build_units(groups, algo)
    guard.check_advantages(units)
    # Each main rollout's group advantage, before balancing moves units between ranks: the
    # tool-vs-no-tool advantage metrics (paravt.metrics.rollout_metrics, adv/*).
    advantage = {u.main.uid: u.advantage for u in units}
    buckets = split_units(units, algo.minibatches)
    shaping: dict[str, float] = {}
    if algo.balance_ranks:  # the same global minibatches, each rank about the same tokens
        buckets, shaping = balance_units(buckets, ctx, algo.share_prefix)
        units = [u for b in buckets for u in b]
    batches = [pack_units(mb, algo.share_prefix) for mb in buckets]
    kl_pen = torch.zeros(2, dtype=torch.float64)  # sum of per-row KL penalties, rows
    with torch.no_grad():
        for b in batches:
            if tr.reference is not None:
                b.ref_logprobs = tr.reference.logprobs(b, max_tokens=algo.max_tokens_per_microbatch)
            if tr.objective.needs_prox:
                b.prox_logprobs = proximal_logprobs(tr, b)
            pen = apply_kl_reward(b, algo)  # kl_mode=reward: KL penalty into the advantages
            kl_pen += torch.tensor([float(pen.sum()), float(pen.numel())], dtype=torch.float64)
    kl_pen = all_reduce_sum(kl_pen, ctx)
    shaping["kl_penalty"] = float(kl_pen[0] / kl_pen[1]) if kl_pen[1] > 0 else 0.0
    times["time/logprobs"] = time.perf_counter() - t0
    if cfg.train.dump_batches:
        dump = Path(cfg.train.out_dir) / "debug" / f"step{step}_rank{ctx.rank}.pt"
        with tr.logger.disk.guard("debug batch dump", dump):  # a full disk: train.on_save_error
            dump.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"batches": batches, "world_size": ctx.world_size}, dump)

    # 5. PPO epochs × minibatches: packed micro-batch forward/backward, one optimizer step each.
    _enter(tr, step, "update")
    t0 = time.perf_counter()
    acc: dict[str, float] = {"loss_num": 0.0, "den": 0.0, "ent": 0.0, "ent_n": 0.0}
    stat_sums: dict[str, float] = {}
    grad_norms: list[float] = []
    params = [p for p in tr.policy.parameters() if p.requires_grad]
    tr.policy.train()  # Qwen-VL has no dropout by default; train mode enables grad checkpointing
    # A rank whose prompts all failed to decode has nothing to train on; ranks must take the
    # same number of optimizer steps (FSDP collectives), so the step's update is skipped.
    epochs = algo.ppo_epochs if min(all_gather_objects(len(units), ctx)) > 0 else 0
    if epochs == 0 and ctx.is_main:
        print(f"[train] step {step}: a rank has no trajectories (videos unreadable); no update")
    epochs = guard.planned_epochs(epochs, len(batches))
    for _ in range(epochs):
        for b in batches:
            local_den = agg_denominator(tr.objective.effective_mask(b), b, algo.agg)
            global_den = float(all_reduce_sum(torch.tensor([local_den]), ctx)[0])
            # Micro-batches by token budget, one packed forward + fused loss each; under FSDP
            # every rank runs the same number of forwards (max over ranks).
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
            if not finite:
                continue  # a skipped update adds nothing to the loss / grad-norm metrics
            grad_norms.append(grad_norm)
            acc["loss_num"] += res.loss_num
            acc["den"] += local_den
            acc["ent"] += res.entropy_sum
            acc["ent_n"] += res.entropy_count
            n_tok = res.stats["n_tokens"]
            for k in ("clip_frac", "clip_frac_low", "clip_frac_high", "kl_mean", "ratio_mean"):
                stat_sums[k] = stat_sums.get(k, 0.0) + res.stats[k] * n_tok
            stat_sums["n_tokens"] = stat_sums.get("n_tokens", 0.0) + n_tok
    tr.policy.eval()
    times["time/update"] = time.perf_counter() - t0

    # 6. Push the new weights to the rollout engine (asynchronous: stream them to the workers
    # as version ``step`` and admit the prompts that version allows).
    _enter(tr, step, "sync")
    t0 = time.perf_counter()
    if tr.pipeline is not None:
        tr.pipeline.publish(tr.policy, step)
    else:
        sync_engine(tr)
    times["time/sync"] = time.perf_counter() - t0

    # 7. Metrics, reduced over ranks.
    _enter(tr, step, "metrics")
    keys = sorted(stat_sums)
    vec = all_reduce_sum(
        torch.tensor([acc["loss_num"], acc["den"], acc["ent"], acc["ent_n"]] +
                     [stat_sums[k] for k in keys], dtype=torch.float64),
        ctx,
    )  # fmt: skip
    loss_num, den, ent, ent_n = (float(x) for x in vec[:4])
    red_stats = dict(zip(keys, (float(x) for x in vec[4:])))
    n_tok = max(red_stats.get("n_tokens", 0.0), 1.0)
    records = [r for part in all_gather_objects(
        [trajectory_record(t, g.num_frames, advantage.get(t.uid)) for g in groups
         for t in g.trajectories], ctx
    ) for r in part]  # fmt: skip
    m = rollout_metrics(records)
    gen_tokens = float(all_reduce_sum(float(sum(sum(t.loss_mask) for u in units
                                                for t in u.sequences)), ctx)[0])  # fmt: skip
    times["time/step"] = time.perf_counter() - t_step
    m.update(times)
    m.update(shaping)
    m.update(
        {
            "loss": loss_num / den if den > 0 else 0.0,
            "kl": red_stats.get("kl_mean", 0.0) / n_tok,
            "clip_frac": red_stats.get("clip_frac", 0.0) / n_tok,
            "clip_frac_low": red_stats.get("clip_frac_low", 0.0) / n_tok,
            "clip_frac_high": red_stats.get("clip_frac_high", 0.0) / n_tok,
            "ratio_mean": red_stats.get("ratio_mean", 0.0) / n_tok,
            "entropy": ent / ent_n if ent_n > 0 else 0.0,
            "grad_norm": float(np.mean(grad_norms)) if grad_norms else 0.0,
            "lr": float(tr.scheduler.get_last_lr()[0]),
            "tokens_per_s": gen_tokens / max(times["time/step"], 1e-9),
            "trained_tokens": gen_tokens,
            "num_groups": float(all_reduce_sum(float(len(groups)), ctx)[0]),
            "skipped_prompts": float(all_reduce_sum(float(len(batch.errors)), ctx)[0]),
        }
    )
    # The rollout's parts (this rank's; an asynchronous step's: summed over its workers):
    # overview decode + pixel pack, main-agent generation, crop decode + pack, sub-agents.
    for k, name in (("overview_s", "overview"), ("main_gen_s", "main_gen"), ("crop_s", "crops"),
                    ("sub_gen_s", "sub_gen")):  # fmt: skip
        m[f"time/{name}"] = float(getattr(batch.stats, k))
    # Tokens of the packed minibatches (every position of every trained sequence, prompts and
    # visual placeholders included): what one PPO epoch's forwards process, the T of an
    # update's 6 * params * T FLOPs.
    m["packed_tokens"] = float(
        all_reduce_sum(float(sum(int(b.input_ids.numel()) for b in batches)), ctx)[0]
    )
    # What the forwards actually push through the backbone (algo.share_prefix: each group's
    # prompt once; the update's MFU counts these), and the main rows' context mix: prompt
    # (system text, overview, question) against what follows it (turns, tool responses).
    m.update(context_mix(batches, units, ctx))
    # Episodes the engine's context cut short (paravt.agent.loop: never a failed request), and
    # how much of the step was PARA-GRPO's own work: crops decoded and sub-agent trajectories
    # (a measurement run reads these to tell a step with tool calls from one without).
    keys = ("context_forced_answers", "context_cut_answers", "context_ended", "crops")
    counts = all_reduce_sum(
        torch.tensor([float(getattr(batch.stats, k)) for k in keys] +
                     [float(sum(len(g.sub_trajectories) for g in groups))]), ctx
    )  # fmt: skip
    m.update({f"rollout/{k}": float(v) for k, v in zip((*keys, "sub_agents"), counts)})
    m.update(guard.metrics())
    if m["num_groups"] == 0:  # trained on nothing: no update statistic either (every rank)
        for k in ("loss", "kl", "clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean",
                  "entropy", "grad_norm"):  # fmt: skip
            m.pop(k)
        tr.empty_errors = [e for part in all_gather_objects(batch.errors, ctx) for e in part]
    if batch.metrics:  # asynchronous (rank 0): staleness, queue depth, idle times
        m.update(batch.metrics)
        m["async/trainer_idle_frac"] = times["time/rollout"] / max(times["time/step"], 1e-9)
    if ctx.is_main and cfg.train.log_trajectories:
        tr.logger.log_trajectories(
            step,
            trajectory_samples(
                groups, cfg.train.log_trajectories, video_meta=tr.video_meta, store=tr.thumbs
            ),
        )
    return m


def context_mix(batches: list[Any], units: list[Any], ctx: Any) -> dict[str, float]:
    """``backbone_rows`` (summed over ranks; ``paravt.models.prefix.shared_rows``), and the
    mean prompt and suffix tokens of a main row (``tokens/main_prompt``,
    ``tokens/main_suffix``): the mix the shared-prefix projection reads."""
    from paravt.models.prefix import shared_rows

    rows = sum(shared_rows(b, range(len(b.uids))) for b in batches)
    prompt = sum(u.main.prompt_len for u in units)
    suffix = sum(len(u.main.tokens) - u.main.prompt_len for u in units)
    tot = all_reduce_sum(torch.tensor([float(rows), prompt, suffix, len(units)]), ctx)
    n = max(float(tot[3]), 1.0)
    return {
        "backbone_rows": float(tot[0]),
        "tokens/main_prompt": float(tot[1]) / n,
        "tokens/main_suffix": float(tot[2]) / n,
    }


def _enter(tr: Trainer, step: int, phase: str) -> None:
    """Tell the run's preemption handler where the step is (its log line names it)."""
    if tr.preempt is not None:
        tr.preempt.enter(step, phase)


def proximal_logprobs(tr: Trainer, batch: Any) -> torch.Tensor:
    """π_prox: the policy before this step's updates, no-grad packed forwards (one per
    micro-batch of ``algo.max_tokens_per_microbatch`` tokens; ``packed_logprobs``) through
    the policy itself (under FSDP2 the sharded policy: no replica is needed for it; the
    root is resharded after each no-grad forward, see ``paravt.models.forward.as_root_forward``).
    """
    # Each row under its own sampling T / top-p; packed forwards (algo.max_tokens_per_microbatch).
    lp, _ = packed_logprobs(tr.policy, batch, max_tokens=tr.cfg.algo.max_tokens_per_microbatch)
    return lp.float().cpu()


def sync_engine(tr: Trainer) -> None:
    """Push the updated policy into the rollout engine.

    One process: the HF engine shares the policy module (nothing to copy); vLLM gets its state
    dict. FSDP2 (several ranks, or fp32 masters under bf16 compute on one): the full weights
    are streamed (``paravt.distributed.full_weights``: one entry all-gathered and cast to the
    compute dtype at a time, never a full state dict) into the rank's engine: vLLM's reload
    path, or the HF engine's replica, copied in place."""
    if is_sharded(tr.policy):
        tr.engine.sync_weights(full_weights(tr.policy, Precision.from_config(tr.cfg).compute))
    else:
        tr.engine.sync_weights(tr.policy)


def _video_meta(cfg: Config) -> Any:
    """A video's ``VideoMeta`` for an asynchronous trainer without an engine of its own
    (``probe`` caches what it read per file)."""
    return functools.partial(probe, timeout_s=cfg.video.decode_timeout_s)


# ---------------------------------------------------------------------------------- main


def run(cfg: Config, *, keep_handlers: bool = False) -> dict[str, Any]:
    """Train with a validated config; returns ``{"before", "after", "last", "out_dir"}``, and
    ``"preempted"`` (``_preempted``) when a SIGTERM/SIGUSR1 stopped it early (``after`` then
    empty): the run, not the caller, handles those signals while it runs (``paravt.preempt``;
    ``keep_handlers``: until the process exits, as ``main`` does). A folder another live
    process holds (``paravt.files.FolderClaim``: rank 0 holds ``train.out_dir`` for the run's
    life), a folder that holds another run, or a ``--resume`` with other settings, is refused
    first (``paravt.runfolder``).
    """
    pin_worker_gpu(cfg.rollout.workers, cfg.model.device)  # before anything starts CUDA
    validate_run(cfg, world_size_from_env())  # before anything heavy loads
    check_device_memory(cfg, world_size_from_env())  # CUDA: the memory plan fits the device
    try:  # rank 0 holds the folder for the run's life; a second run into it is refused
        claim = claim_folder(cfg.train.out_dir, "a paravt.train run", _BUSY_FIX)
    except FolderBusy as e:
        raise ConfigError(str(e)) from None
    try:
        return _claimed_run(cfg, keep_handlers)
    finally:
        if claim is not None:
            claim.release()


#: What a run refused by another live run's claim on ``train.out_dir`` may do.
_BUSY_FIX = (
    "wait for that run to end (or stop it: kill -TERM saves it), or pass another train.out_dir"
)


def _claimed_run(cfg: Config, keep_handlers: bool) -> dict[str, Any]:
    """:func:`run` once rank 0 holds ``train.out_dir``: the folder check, then the run."""
    check_run_folder(cfg)  # every rank (workers too), before any of them writes there
    roles = None
    if cfg.rollout.workers > 0:  # asynchronous: this process trains or rolls out
        ctx, roles = init_async(cfg.model.device, cfg.rollout.workers)
        if roles.is_worker:
            totals = run_worker(cfg, ctx, roles)
            cleanup(ctx)
            return {"worker": roles.rank, **totals}
    else:
        ctx = init_distributed(cfg.model.device)
    with Preemption(cfg.train.preempt_grace_s, ctx, keep=keep_handlers) as pre:
        try:
            return _run(cfg, ctx, pre, roles)
        finally:  # a run that raised: no live group of one at exit or for the next run
            release_single_rank_group()


def _run(cfg: Config, ctx: Any, pre: Any, roles: Any = None) -> dict[str, Any]:
    out = Path(cfg.train.out_dir)
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        with RunFolderWrites(cfg.train.on_save_error, out).guard("config", out / "config.yaml"):
            write_atomic(out / "config.yaml", to_yaml(cfg))
            record_run(cfg)  # run.json: what a --resume must match (paravt.runfolder)
        print(to_yaml(cfg), flush=True)
    t_run = time.perf_counter()
    try:
        tr = build_trainer(cfg, ctx)
    except SFTPreempted as e:  # its state is saved: --resume continues the SFT
        cleanup(ctx)
        return {"before": {}, "after": {}, "last": {}, "out_dir": str(out), "preempted": e.info}
    if ctx.is_main:  # now with the fingerprint of a tiny model built by this run
        with tr.logger.disk.guard("config", out / "run.json"):
            record_run(cfg)
    tr.preempt = pre
    t = cfg.train
    if roles is not None:  # the workers start on the first η + 1 steps while we evaluate
        tr.pipeline = RolloutPipeline(cfg, ctx, roles, tr.sampler)
        tr.pipeline.start(tr.policy, tr.init_dir, tr.start_step)

    before: dict[str, float] = {}
    pre.enter(tr.start_step, "eval")
    # After a signal the evaluation is skipped (the loop's first boundary then stops the run).
    if t.eval_prompts and t.eval_before and not pre.requested():
        # Logged already (the rows kept are the start's: truncated above): not twice.
        before = logged_eval(out, "eval_before", ctx=ctx)
        if not before:
            before = _evaluate(tr, tr.start_step, "eval_before")
            if tr.pipeline is not None:  # its evaluation engine idles until the last one
                getattr(tr.engine, "sleep", lambda: None)()

    bar = progress_bar(
        t.steps, initial=tr.start_step, enabled=ctx.is_main and t.progress, desc="PARA-GRPO"
    )
    # Collapse alarms; on --resume the kept rows restore starting levels and armed states.
    alarms = CollapseDetector.from_config(t)
    empty = EmptySteps(t.max_empty_steps)
    if tr.start_step > 0:
        alarms.replay(read_metrics(out / "metrics.jsonl"))
        _periodic_eval(tr, tr.start_step, pre, resumed=True)  # one a preemption skipped
    last: dict[str, float] = {}
    # Preemption (paravt.preempt): the last completed step, the step the newest checkpoint
    # holds, and what the step in progress started from (what an abandoned step leaves).
    done = saved = tr.start_step
    begin: tuple[dict[str, int], Any] | None = None
    abandoned = 0
    for step in range(tr.start_step + 1, t.steps + 1):
        if pre.start_step(step):  # any rank, during the previous step or before the first
            break
        begin = (_data_state(tr, step - 1), rng_state())
        try:
            last = train_step(tr, step)
        except StepAbandoned:
            abandoned = step
            break
        except WorkerFailed:  # raised by collect: the policy is still step `done`'s
            _save_after_worker_failure(tr, done, saved, begin)
            tr.logger.close()
            cleanup(ctx, getattr(tr.engine, "close", lambda: None))
            raise
        done = step
        pre.rest_s = last["time/step"] - last["time/rollout"]  # for should_abandon
        tr.logger.log(step, last)
        fired = alarms.update(step, last)
        if (a := empty.update(step, last, tr.empty_errors)) is not None:
            fired.append(a)
        for a in fired:
            tr.logger.log(step, a.row(), kind="alarm")
            if ctx.is_main:
                bar.write(f"[alarm] step {step}: {a.message}")
        empty.check(step)  # train.max_empty_steps empty steps in a row: EmptyStepsError
        bar.set_postfix(postfix(last))
        bar.update(1)
        _periodic_eval(tr, step, pre)  # before the checkpoint: a resume from it has the row
        if (t.save_every and step % t.save_every == 0) or step == t.steps:
            pre.enter(step, "checkpoint")
            t0 = time.perf_counter()
            if save_trainer(tr, step, data=_data_state(tr, step)):
                saved = step
            pre.save_s = time.perf_counter() - t0
    bar.close()
    if abandoned or pre.requested():
        info = _preempted(tr, done, saved, begin if abandoned else None)
        if tr.pipeline is not None:
            tr.pipeline.close()
        tr.logger.close()
        cleanup(ctx, getattr(tr.engine, "close", lambda: None))
        return {"before": before, "after": {}, "last": last, "out_dir": str(out), "preempted": info}
    pre.enter(t.steps, "eval")
    if tr.pipeline is not None:  # the workers are done; the evaluation runs here
        tr.pipeline.close()
        if tr.engine is not None:
            sync_engine(tr)

    # A resumed finished run has its evaluation logged already: reused, not logged twice.
    after = logged_eval(out, "eval_after", t.steps, ctx) if t.eval_prompts else {}
    if t.eval_prompts and not after:
        after = _evaluate(tr, t.steps, "eval_after")
    if ctx.is_main:
        if t.summary_plot:
            with tr.logger.disk.guard("summary plot", out / "summary.png"):
                plot_summary(out / "metrics.jsonl", out / "summary.png")
        print()
        print(
            format_table(
                {"before RL": before, "after RL": after, "last step": last}, table_rows(cfg)
            )
        )
        print(
            f"\n[train] {t.steps} steps in {time.perf_counter() - t_run:.0f} s; run folder: "
            f"{out} (metrics.jsonl, tb/, trajectories.jsonl, summary.png, checkpoints/)"
        )
    tr.logger.close()
    cleanup(ctx, getattr(tr.engine, "close", lambda: None))
    return {"before": before, "after": after, "last": last, "out_dir": str(out)}


def _checkpoint_last(
    tr: Trainer, done: int, saved: int, begin: tuple[dict[str, int], Any] | None
) -> tuple[bool, str, str]:
    """A run that stops early (a preemption, a lost rollout worker; every rank): checkpoint the
    last completed step ``done`` unless ``saved`` (the newest checkpoint's step) is it already.

    ``begin``: when the step after ``done`` was abandoned before its update, the sampler
    position and RNG states it started from, to save instead of the current ones. Returns
    ``(ok, path, wrote)``: ``ok`` False when the write failed (``train.on_save_error=continue``),
    ``path`` '' when no step completed, ``wrote`` " written in N s" or " (already written)"."""
    path = str(Path(tr.cfg.train.out_dir) / "checkpoints" / step_dirname(done)) if done else ""
    if done <= saved:
        return True, path, " (already written)" if done else ""
    tr.preempt.enter(done, "checkpoint")
    t0 = time.perf_counter()
    if begin is None:
        ok = save_trainer(tr, done, data=_data_state(tr, done))
    else:
        ok = save_trainer(tr, done, data=begin[0], rng=begin[1])
    return ok, path, f" written in {time.perf_counter() - t0:.1f} s"


def _save_after_worker_failure(
    tr: Trainer, done: int, saved: int, begin: tuple[dict[str, int], Any]
) -> None:
    """Asynchronous: a rollout worker died or failed (``WorkerFailed``, raised by ``collect``
    on every trainer rank before anything of step ``done + 1`` ran): checkpoint step ``done``
    with the sampler position and RNG states that step started from, so ``--resume`` loses
    nothing, and say so on rank 0. A node that dies takes its workers with it: the same path."""
    ok, path, wrote = _checkpoint_last(tr, done, saved, begin)
    if not path:
        what = "no step completed, nothing to checkpoint (--resume starts at step 0)"
    elif ok:
        what = f"checkpoint {path}{wrote}"
    else:
        what = f"checkpoint {path} NOT written (see the warning above)"
    if tr.ctx.is_main:
        print(f"[async] a rollout worker is gone after step {done}: {what}", flush=True)


def _preempted(
    tr: Trainer, done: int, saved: int, begin: tuple[dict[str, int], Any] | None
) -> dict[str, Any]:
    """After a SIGTERM/SIGUSR1 (every rank): checkpoint the last completed step ``done`` unless
    ``saved`` (the newest checkpoint's step) is it already, and report on rank 0.

    ``begin``: when the step after ``done`` was abandoned mid-way, the sampler position and RNG
    states it started from, to save instead of the current ones. Returns ``{"signal", "step",
    "phase", "ranks", "outcome", "checkpoint", "ok", "seconds"}``: ``ok`` False when the
    checkpoint could not be written (``train.on_save_error=continue``; ``main`` exits 1).
    """
    pre, t = tr.preempt, tr.cfg.train
    ok, path, wrote = _checkpoint_last(tr, done, saved, begin)
    arrivals = pre.arrivals()  # after the save: how long since the earliest signal
    first, seconds = arrivals[0]
    where = f"{first.signal} at step {first.step} ({first.phase})"
    if tr.ctx.world_size > 1:
        ranks = sorted(a[0].rank for a in arrivals)
        where += f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    if begin is not None:
        outcome = (
            f"abandoned step {done + 1} while waiting for its rollouts"
            if tr.pipeline is not None
            else f"abandoned step {done + 1} after its rollout (finishing it would pass the grace)"
        )
    elif first.phase in ("startup", "eval"):
        outcome = "no step in progress"
    else:
        outcome = f"finished step {done}"
    if not ok:
        what = f"checkpoint {path} NOT written (see the warning above); exiting 1"
    elif path:
        what = f"checkpoint {path}{wrote}; exiting 0"
    else:
        what = "no step completed, nothing to checkpoint (--resume starts at step 0); exiting 0"
    late = f", past the grace of {t.preempt_grace_s:g} s" if seconds > t.preempt_grace_s else ""
    if tr.ctx.is_main:
        print(
            f"[preempt] {where}: {outcome}, {what} {seconds:.1f} s after the signal"
            f"{late or f' (grace {t.preempt_grace_s:g} s)'}",
            flush=True,
        )
    return {
        "signal": first.signal,
        "step": first.step,
        "phase": first.phase,
        "ranks": [a[0].rank for a in arrivals],
        "outcome": outcome,
        "checkpoint": path,
        "ok": ok,
        "seconds": seconds,
    }


def _evaluate(tr: Trainer, step: int, kind: str) -> dict[str, float]:
    """The held-out evaluation (``paravt.eval.heldout.evaluate``) of the policy now, logged at
    ``step`` as a ``kind`` row (``eval_before``, ``eval_step``, ``eval_after``) of
    ``metrics.jsonl`` and one row per prompt and condition in ``heldout.jsonl``."""
    prompts: list[dict[str, Any]] = []
    m = evaluate(tr, seed=tr.cfg.train.seed, per_prompt=prompts)
    tr.logger.log(step, m, kind=kind)
    tr.logger.log_heldout(step, kind, prompts)
    return m


def _periodic_eval(tr: Trainer, step: int, pre: Any, *, resumed: bool = False) -> None:
    """``train.eval_every``: after every that many steps (not the last: ``eval_after`` is
    its evaluation), an ``eval_step`` evaluation. Skipped after a SIGTERM/SIGUSR1 (the run
    stops at the next boundary); ``resumed``: at a resumed run's first step, the evaluation
    its checkpoint's step is owed when the preempted run skipped it."""
    t = tr.cfg.train
    if not (t.eval_every and t.eval_prompts) or step % t.eval_every or not 0 < step < t.steps:
        return
    if pre.requested() or (resumed and logged_eval(t.out_dir, "eval_step", step, tr.ctx)):
        return
    pre.enter(step, "eval")
    _evaluate(tr, step, "eval_step")


def _data_state(tr: Trainer, done: int) -> dict[str, int]:
    """The prompt sampler's position after step ``done``'s prompts (what a checkpoint of step
    ``done`` records): asynchronous runs draw up to η + 1 steps ahead."""
    return tr.pipeline.data_state(done) if tr.pipeline is not None else tr.sampler.state()


def _lost_peer(e: BaseException, cfg: Config | None) -> str:
    """The one line for a rank whose collective failed because another rank is gone: which
    rank saw it, the backend's words, and the checkpoint ``--resume`` continues from (the
    training state is sharded over the ranks, so the survivors cannot save it)."""
    rank = os.environ.get("RANK", "0")
    words = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    newest = latest_checkpoint(cfg.train.out_dir) if cfg is not None else None
    resume = (
        f"--resume continues from {newest}"
        if newest is not None
        else "no checkpoint was written yet: --resume starts at step 0"
    )
    return (
        f"rank {rank} lost a peer rank of the job (its process or node died): {words}. The "
        f"training state is sharded over the ranks, so the run stops without saving; {resume}"
    )


def main(argv: Sequence[str] | None = None, *, keep_handlers: bool = False) -> int:
    """The command line; ``keep_handlers`` (``python -m paravt.train``): the preemption
    handlers stay until the process exits, so a repeated signal during the teardown after the
    ``[preempt]`` line cannot turn its exit 0 into 143."""
    cfg = None
    try:
        cfg, _ = parse_args(argv)
        res = run(cfg, keep_handlers=keep_handlers)
        if not res.get("preempted", {}).get("ok", True):
            return 1
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # A full disk; no data; a link or a FIFO planted where the run writes a file.
    except (CheckpointSaveError, DiskFullError, EmptyStepsError, NotRegularFile) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    # Asynchronous: a rollout worker died or raised (the trainer's view), or the trainer died
    # (a worker's view): one line each, no traceback.
    except (WorkerFailed, TrainerGone) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as e:  # another rank's process or node died mid-collective
        if not peer_lost(e):
            raise
        print(f"error: {_lost_peer(e, cfg)}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before the run's handlers (paravt.preempt) are set
        print("interrupted before the run started; nothing was written", file=sys.stderr)
        return 130
    except DatasetError as e:  # raised before any model loads (read_datasets)
        print(
            f"error: {e}\n(the dataset is checked before any model loads: fix it, or point "
            "data.path at another dataset)",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(keep_handlers=True))
