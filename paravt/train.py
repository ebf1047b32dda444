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
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paravt.config import Config, ConfigError, load_config, preset_errors, to_dict, to_yaml

# ----------------------------------------------------------------------------------- config


def parse_args(argv: Sequence[str] | None) -> tuple[Config, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m paravt.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny_cpu", help="tiny_cpu | tiny_cpu_vanilla | ...")
    p.add_argument("--config", action="append", default=[], help="YAML file (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("overrides", nargs="*", help="dotted key=value, e.g. algo.kl_coef=0.02")
    a = p.parse_args(argv)
    cfg = load_config(a.preset, a.config, a.overrides)
    if errs := preset_errors(a.preset, cfg):
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errs))
    if a.resume:
        cfg.train.resume = True
    return cfg, a


def validate_run(cfg: Config, world_size: int) -> None:
    """Checks that need the world size or files on disk, run before anything loads."""
    from paravt.distributed import resolve_device

    errs: list[str] = []
    t, r, a = cfg.train, cfg.rollout, cfg.algo
    if t.steps < 1:
        errs.append(f"train.steps={t.steps} must be >= 1")
    if t.prompts_per_step % world_size:
        errs.append(
            f"train.prompts_per_step={t.prompts_per_step} is not divisible by the world size "
            f"{world_size}; each rank rolls out whole groups (use a multiple of {world_size})"
        )
    else:
        per_rank = t.prompts_per_step // world_size
        if per_rank < a.minibatches:
            errs.append(
                f"algo.minibatches={a.minibatches} exceeds the {per_rank} prompt(s) each of the "
                f"{world_size} rank(s) gets per step; lower algo.minibatches"
            )
    if cfg.sft.steps > 0 and cfg.sft.batch_size < world_size:
        errs.append(
            f"sft.batch_size={cfg.sft.batch_size} is smaller than the world size {world_size}"
        )
    if r.temperature <= 0:
        errs.append(
            f"rollout.temperature={r.temperature}: RL needs sampling (> 0); greedy rollouts "
            "give identical group members and zero advantages"
        )
    if cfg.sft.data and not Path(cfg.sft.data).is_file():
        errs.append(f"sft.data='{cfg.sft.data}' does not exist")
    dev = None
    try:
        dev = resolve_device(cfg.model.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            errs.append(f"model.device='{cfg.model.device}' but CUDA is not available; use cpu")
    except RuntimeError as e:
        errs.append(f"model.device='{cfg.model.device}': {e}")
    errs += _attention_errors(cfg, dev)
    if r.engine == "vllm":
        from paravt.rollout import vllm_missing

        why = vllm_missing()
        if why:
            errs.append(why)
    if t.resume and not Path(t.out_dir).is_dir():
        errs.append(f"--resume: train.out_dir='{t.out_dir}' does not exist (nothing to resume)")
    # The largest K must fit the model's context: estimate its prompt from the pixel budget.
    from paravt.models.tiny import tiny_checkpoint_args

    model_dir = Path(cfg.model.path or tiny_checkpoint_args(cfg)[0])
    if (model_dir / "config.json").is_file():
        from paravt.agent.context import context_budget_errors

        errs += context_budget_errors(cfg, model_dir)
    if errs:
        raise ConfigError("invalid configuration for this run:\n  - " + "\n  - ".join(errs))


# transformers' flash attention implementations: the module each imports, the package's name
# and how to install it.
_FLASH_PACKAGES = {
    "flash_attention_2": (
        "flash_attn",
        "flash-attn",
        "pip install flash-attn --no-build-isolation (builds against the CUDA toolkit)",
    ),
    "flash_attention_3": (
        "flash_attn_interface",
        "flash-attn 3 (flash_attn_interface)",
        "build flash-attention's hopper/ directory",
    ),
}


def _attention_errors(cfg: Config, dev: torch.device | None) -> list[str]:
    """``model.attn_implementation=flash_attention_*`` needs a CUDA device and its package;
    without them transformers fails the model load, after the data and any tiny model were
    built. ``dev``: the resolved ``model.device`` (None when it did not resolve)."""
    import importlib.util

    attn = cfg.model.attn_implementation
    if attn not in _FLASH_PACKAGES:
        return []
    module, package, install = _FLASH_PACKAGES[attn]
    other = "run with model.attn_implementation=sdpa (PyTorch's attention: any device, no package)"
    if dev is not None and dev.type != "cuda":
        return [
            f"model.attn_implementation='{attn}' needs CUDA, but model.device="
            f"'{cfg.model.device}' is {dev}{'' if torch.cuda.is_available() else ' (no CUDA)'}: "
            f"{other}, or use a CUDA device"
        ]
    if importlib.util.find_spec(module) is None:
        return [
            f"model.attn_implementation='{attn}' needs the {package} package, which is not "
            f"installed: {install}, or {other}"
        ]
    return []


# ------------------------------------------------------------------------------- assets


def prepare_data(cfg: Config, ctx: Any) -> str:
    """Dataset directory; the synthetic task is generated on rank 0 if absent (others wait)."""
    from paravt.distributed import barrier

    data_dir = cfg.data.path or cfg.data.synth_dir
    if ctx.is_main and not cfg.data.path:
        from paravt.data.synth import generate_from_config

        generate_from_config(cfg, data_dir)
    barrier(ctx)
    return data_dir


def prepare_model(cfg: Config, ctx: Any) -> str:
    """Model directory; the tiny model is built on rank 0 if absent (others wait)."""
    from paravt.distributed import barrier
    from paravt.models.tiny import tiny_checkpoint_args

    tiny_dir, head_dim = tiny_checkpoint_args(cfg)
    model_dir = cfg.model.path or tiny_dir
    if ctx.is_main and not cfg.model.path:
        from paravt.models import build_tiny_checkpoint

        build_tiny_checkpoint(
            model_dir, seed=cfg.train.seed, vocab=cfg.model.tiny_vocab, head_dim=head_dim
        )
    barrier(ctx)
    return model_dir


def prepare_assets(cfg: Config, ctx: Any) -> tuple[str, str]:
    """Dataset directory and model directory (``prepare_data``, ``prepare_model``)."""
    return prepare_data(cfg, ctx), prepare_model(cfg, ctx)


def read_datasets(cfg: Config, data_dir: str) -> tuple[list[Any], list[Any]]:
    """Training and validation samples, every row validated (``DatasetError`` names the file,
    the row and the field). The trainer calls it before any model is built or loaded, so a
    bad row costs a second, not a checkpoint load. An absent val split falls back to the
    train prompts; a bad one raises. Validation keeps ``train.eval_prompts`` prompts."""
    from paravt.data.readers import DatasetError, has_split, load_samples

    root = cfg.data.video_root
    train = load_samples(data_dir, video_root=root, split="train", max_samples=cfg.data.max_samples)
    val = load_samples(data_dir, video_root=root, split="val") if has_split(data_dir, "val") else []
    if not train:
        raise DatasetError(
            f"{data_dir}: no usable training row (the split is empty, or every row's video is "
            "missing: see the warning above); check data.path and data.video_root"
        )
    return train, (val or train)[: cfg.train.eval_prompts]


@dataclass
class PromptSampler:
    """Epoch-wise shuffled prompts; the permutation is a pure function of (seed, epoch), so
    the sampler's whole state is ``(epoch, pos)`` and resumes exactly."""

    samples: list[Any]
    seed: int
    epoch: int = 0
    pos: int = 0
    _perm: list[int] = field(default_factory=list, repr=False)

    def _permutation(self) -> list[int]:
        perm = list(range(len(self.samples)))
        random.Random(f"paravt-data:{self.seed}:{self.epoch}").shuffle(perm)
        return perm

    def next(self, n: int) -> list[tuple[Any, int]]:
        """``n`` (sample, epoch) pairs; epochs roll over mid-batch."""
        out = []
        while len(out) < n:
            if not self._perm:
                self._perm = self._permutation()
            if self.pos >= len(self._perm):
                self.epoch, self.pos = self.epoch + 1, 0
                self._perm = self._permutation()
            out.append((self.samples[self._perm[self.pos]], self.epoch))
            self.pos += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._perm = self._permutation()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


# --------------------------------------------------------------------------------- state


@dataclass
class Trainer:
    """Everything a step touches (built once by ``build_trainer``)."""

    cfg: Config
    ctx: Any
    policy: torch.nn.Module
    bundle: Any  # the policy's ModelBundle (tokenizer, vision spec)
    engine: Any
    runner: Any
    reference: Any  # ReferencePolicy or None
    objective: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sampler: PromptSampler
    val_samples: list[Any]
    logger: Any
    init_dir: str
    start_step: int = 0
    thumbs: Any = None  # ThumbnailStore of the viewer's overview thumbnails (rank 0)
    preempt: Any = None  # paravt.preempt.Preemption of the run (None: no mid-step check)


def build_trainer(cfg: Config, ctx: Any) -> Trainer:
    from paravt.agent.loop import AgentRunner
    from paravt.algo.loss import make_objective
    from paravt.algo.reference import ReferencePolicy
    from paravt.checkpoint import latest_checkpoint, load_trainer_state, set_rng_state
    from paravt.distributed import load_full_optimizer_state, shard_model
    from paravt.metrics import MetricsLogger, ThumbnailStore
    from paravt.models import load_model_from_config
    from paravt.rollout import make_engine
    from paravt.sft import run_sft

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

    def load(path: Any) -> Any:
        return load_model_from_config(path, cfg.model, device=str(ctx.device))

    bundle = load(ckpt or init_dir)
    policy = bundle.model
    if cfg.algo.freeze_vision_tower:
        from paravt.sft import freeze_vit

        freeze_vit(policy)  # before sharding and the optimizer: frozen tensors never train
    if cfg.model.gradient_checkpointing and hasattr(policy, "gradient_checkpointing_enable"):
        policy.gradient_checkpointing_enable()
    objective = make_objective(cfg.algo)
    reference = None
    if objective.needs_ref:
        reference = ReferencePolicy(load(init_dir).model)
    if ctx.distributed and cfg.rollout.engine == "hf":
        # The HF engine decodes with its own full replica: sharded parameters cannot generate
        # (every decode step would be a collective over ranks that stop at different times).
        engine_bundle = load(ckpt or init_dir)
    else:
        # Colocated: one process, or vLLM (which loads its own copy from the checkpoint, and
        # gets the policy's weights streamed after each update: no HF replica anywhere).
        engine_bundle = bundle
    shard_model(policy, ctx)  # a no-op on one rank
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
        out, enabled=ctx.is_main, wandb=t.wandb, run_name=out.name, config=to_dict(cfg)
    )
    trainer = Trainer(
        cfg, ctx, policy, bundle, engine, runner, reference, objective, optimizer, scheduler,
        sampler, val_samples, logger, init_dir,
    )  # fmt: skip

    if ctx.is_main:
        trainer.thumbs = ThumbnailStore(
            out, max_bytes=int(t.viewer_max_mb * 1e6), max_px=t.viewer_thumb_px
        )

    # 4. Resume: optimizer, schedule, RNG, data position; metrics past the checkpoint dropped.
    if ckpt is not None:
        st = load_trainer_state(ckpt)
        load_full_optimizer_state(policy, optimizer, st["optimizer"], ctx)
        scheduler.load_state_dict(st["scheduler"])
        sampler.load(st["data"])
        rngs = st.get("rng", [])
        if len(rngs) == ctx.world_size:
            set_rng_state(rngs[ctx.rank])
        trainer.start_step = int(st["step"])
        logger.truncate_after(trainer.start_step)
        if ctx.is_main:
            print(f"[train] resumed from {ckpt} (step {trainer.start_step})")
    else:
        seed_everything(t.seed + ctx.rank)
    return trainer


# ---------------------------------------------------------------------------------- step


def train_step(tr: Trainer, step: int) -> dict[str, float]:
    """One PARA-GRPO step; returns the step's metrics (global over ranks, on every rank)."""
    from paravt.agent.loop import stable_seed
    from paravt.algo.advantages import apply_kl_reward, build_units
    from paravt.algo.gating import frame_budget
    from paravt.algo.guard import NonFiniteGuard
    from paravt.algo.loss import agg_denominator, policy_minibatch_backward
    from paravt.algo.packing import microbatches, pack_units, split_units
    from paravt.distributed import (
        all_gather_objects,
        all_reduce_sum,
        balance_buckets,
        clip_grad_norm,
        shard_list,
    )
    from paravt.metrics import rollout_metrics, trajectory_record
    from paravt.rewards import score_groups

    cfg, ctx, algo = tr.cfg, tr.ctx, tr.cfg.algo
    times: dict[str, float] = {}
    t_step = time.perf_counter()

    # 1. Prompts and their frame budgets K (stable hash of seed, epoch, sample id).
    picked = shard_list(tr.sampler.next(cfg.train.prompts_per_step), ctx)
    samples = [s for s, _ in picked]
    budgets = [
        frame_budget(
            s.id,
            seed=cfg.train.seed,
            epoch=epoch,
            budgets=cfg.video.frame_budgets,
            gating=cfg.video.gating,
            fixed=cfg.video.fixed_frames,
        )
        for s, epoch in picked
    ]

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
        from paravt.preempt import StepAbandoned

        raise StepAbandoned(step)

    # 3. Rewards (sub-agents inherit their parent's). A non-finite reward or advantage on any
    # rank skips the step's update on every rank (paravt.algo.guard); so do a non-finite loss
    # or gradient norm, per optimizer step.
    _enter(tr, step, "reward")
    t0 = time.perf_counter()
    score_groups(groups, cfg.reward)
    guard = NonFiniteGuard(ctx, step)
    guard.check_rewards(groups)
    times["time/reward"] = time.perf_counter() - t0

    # 4. Advantages, packed minibatches, reference / proximal log-probs (no grad).
    _enter(tr, step, "logprobs")
    t0 = time.perf_counter()
    units = build_units(groups, algo)
    guard.check_advantages(units)
    buckets = split_units(units, algo.minibatches)
    shaping: dict[str, float] = {}
    if algo.balance_ranks:  # the same global minibatches, each rank about the same tokens
        buckets, shaping = balance_buckets(
            buckets, lambda u: u.num_tokens, ctx, portable=lambda u: u.portable()
        )
        units = [u for b in buckets for u in b]
    batches = [pack_units(mb) for mb in buckets]
    kl_pen = torch.zeros(2, dtype=torch.float64)  # sum of per-row KL penalties, rows
    with torch.no_grad():
        for b in batches:
            if tr.reference is not None:
                b.extras["ref_logprobs"] = tr.reference.logprobs(
                    b, max_tokens=algo.max_tokens_per_microbatch
                )
            if tr.objective.needs_prox:
                b.extras["prox_logprobs"] = proximal_logprobs(tr, b)
            pen = apply_kl_reward(b, algo)  # kl_mode=reward: KL penalty into the advantages
            kl_pen += torch.tensor([float(pen.sum()), float(pen.numel())], dtype=torch.float64)
    kl_pen = all_reduce_sum(kl_pen, ctx)
    shaping["kl_penalty"] = float(kl_pen[0] / kl_pen[1]) if kl_pen[1] > 0 else 0.0
    times["time/logprobs"] = time.perf_counter() - t0
    if cfg.train.dump_batches:
        dump = Path(cfg.train.out_dir) / "debug" / f"step{step}_rank{ctx.rank}.pt"
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

    # 6. Push the new weights to the rollout engine.
    _enter(tr, step, "sync")
    t0 = time.perf_counter()
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
        [trajectory_record(t, g.num_frames) for g in groups for t in g.trajectories], ctx
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
            "skipped_prompts": float(all_reduce_sum(float(len(tr.runner.errors)), ctx)[0]),
        }
    )
    # Episodes the engine's context cut short (paravt.agent.loop: never a failed request).
    keys = ("context_forced_answers", "context_cut_answers", "context_ended")
    counts = all_reduce_sum(torch.tensor([float(tr.runner.stats.get(k, 0)) for k in keys]), ctx)
    m.update({f"rollout/{k}": float(v) for k, v in zip(keys, counts)})
    m.update(guard.metrics())
    if ctx.is_main and cfg.train.log_trajectories:
        tr.logger.log_trajectories(step, trajectory_samples(tr, groups, cfg.train.log_trajectories))
    return m


def _enter(tr: Trainer, step: int, phase: str) -> None:
    """Tell the run's preemption handler where the step is (its log line names it)."""
    if tr.preempt is not None:
        tr.preempt.enter(step, phase)


def proximal_logprobs(tr: Trainer, batch: Any) -> torch.Tensor:
    """π_prox: the policy before this step's updates, no-grad packed forwards (one per
    micro-batch of ``algo.max_tokens_per_microbatch`` tokens; ``packed_logprobs``) through
    the policy itself (under FSDP2 the sharded policy: no replica is needed for it; the
    root is resharded after each no-grad forward, see ``paravt.algo.packing._as_root_forward``).
    """
    from paravt.algo.packing import packed_logprobs

    # Each row under its own sampling T / top-p; packed forwards (algo.max_tokens_per_microbatch).
    lp, _ = packed_logprobs(tr.policy, batch, max_tokens=tr.cfg.algo.max_tokens_per_microbatch)
    return lp.float().cpu()


def sync_engine(tr: Trainer) -> None:
    """Push the updated policy into the rollout engine.

    One process: the HF engine shares the policy module (nothing to copy); vLLM gets its state
    dict. FSDP2: the full weights are streamed (``paravt.distributed.full_weights``: one
    entry all-gathered at a time, never a full state dict) into the rank's engine: vLLM's
    reload path, or the HF engine's replica, copied in place."""
    from paravt.distributed import full_weights

    tr.engine.sync_weights(full_weights(tr.policy) if tr.ctx.distributed else tr.policy)


def trajectory_samples(tr: Trainer, groups: list[Any], n: int) -> list[dict[str, Any]]:
    """A few decoded trajectories for ``trajectories.jsonl``: what the model saw and wrote.

    Per trajectory: question, gold answer, K, the video's duration, the overview frames' times
    and thumbnails (``thumbs``: paths relative to the run folder, None past the
    ``train.viewer_max_mb`` cap; ``ThumbnailStore``), each turn's text and its calls (status,
    clamped window, the sub-agent's summary, the parse error, the raw call text), reward and
    breakdown. This is what ``python -m paravt.view`` renders."""
    from paravt.metrics import call_record
    from paravt.video import overview_timestamps

    out = []
    for g in groups:
        for t in g.trajectories:
            if len(out) >= n:
                return out
            vis = t.visuals
            meta = tr.runner.meta(g.sample.video)
            if vis is not None and vis.timestamps:
                times = [float(x) for x in vis.timestamps[0]]
            else:  # visuals without their source frames: the times the loop sampled
                times = overview_timestamps(meta, g.num_frames)
            thumbs = None
            if vis is not None and vis.frames and tr.thumbs is not None:
                thumbs = tr.thumbs.save(f"{g.sample.id}_K{g.num_frames}", vis.frames[0])
            out.append(
                {
                    "uid": t.uid,
                    "sample_id": t.sample_id,
                    "K": g.num_frames,
                    "question": g.sample.question,
                    "task": g.sample.question_type,
                    "answer": g.sample.answer,
                    "duration": float(meta.duration),
                    "frame_times": times,
                    "thumbs": thumbs,
                    "turns": [
                        {
                            "prefix": x.prefix,
                            "text": x.text,
                            "forced_answer": x.forced_answer,
                            "calls": [call_record(c) for c in x.calls],
                        }
                        for x in t.turns
                    ],
                    "reward": t.reward,
                    "breakdown": t.reward_breakdown,
                    "num_sub_agents": sum(s.parent == t.uid for s in g.sub_trajectories),
                }
            )
    return out


# ---------------------------------------------------------------------------- evaluation


#: Per-condition metrics of :func:`evaluate` (``{condition}/{key}``), besides the interval.
EVAL_CONDITION_KEYS = (
    "accuracy",
    "format_compliance",
    "parse_error_rate",
    "tool_calls_per_rollout",
    "tool_call_rate",
    "summary_accuracy",
)


def table_rows(cfg: Config) -> list[tuple[str, str]]:
    """The final table's rows: the first evaluation condition's (and the last step's)
    behaviour metrics, then accuracy with its 95% interval and the summary accuracy of each
    ``train.eval_conditions`` entry."""
    from paravt.config import eval_conditions
    from paravt.metrics import TABLE_ROWS

    rows = list(TABLE_ROWS)
    for name, _, tools in eval_conditions(cfg):
        rows.append((f"{name}/accuracy", f"accuracy {name}"))
        rows.append((f"{name}/accuracy_ci95", "  +/- (95% interval)"))
        if tools:
            rows.append((f"{name}/summary_accuracy", f"summary accuracy {name}"))
    return rows


@torch.no_grad()
def evaluate(tr: Trainer, seed: int) -> dict[str, float]:
    """Roll out the validation prompts under each ``train.eval_conditions`` entry
    (``eval_samples`` each, rollout temperature, one fixed seed for every condition) and score
    them: the before/after numbers of the final table.

    Per condition ``{name}/accuracy`` with ``{name}/accuracy_ci95`` (the half-width of its 95%
    interval, rollouts of one prompt averaged first), format compliance, parse-error rate, tool
    calls per rollout and ``summary_accuracy`` — the share of executed crops whose sub-agent
    summary is right about the target (``paravt.data.synth.summary_correct``; synthetic task
    only). The first condition's metrics are also reported unprefixed (``rollout_metrics``).
    """
    from paravt.agent import AgentRunner
    from paravt.agent.loop import stable_seed
    from paravt.config import eval_conditions
    from paravt.data.synth import summary_correct
    from paravt.distributed import all_gather_objects, shard_list
    from paravt.metrics import clustered_mean_ci95, rollout_metrics, trajectory_record
    from paravt.rewards import score_groups

    cfg = tr.cfg
    if not tr.val_samples:
        return {}
    n = len(tr.val_samples) - len(tr.val_samples) % tr.ctx.world_size
    mine = shard_list(tr.val_samples[:n], tr.ctx)
    tr.policy.eval()
    out: dict[str, float] = {}
    for i, (name, k, tools) in enumerate(eval_conditions(cfg)):
        runner = tr.runner
        if not tools:  # the answer is forced in the first turn: no tool round
            no_tools = replace(cfg, agent=replace(cfg.agent, max_turns=0))
            runner = AgentRunner(runner.engine, runner.bundle, no_tools, planner=runner.planner)
        groups = runner.rollout(
            mine, [k] * len(mine), group_size=cfg.train.eval_samples, seed=stable_seed("eval", seed)
        )
        score_groups(groups, cfg.reward)
        recs = []
        for g in groups:
            for t in g.trajectories:
                r = trajectory_record(t, g.num_frames)
                r["prompt"] = g.sample.id
                checks = [
                    summary_correct(c.response, c.start, c.end, g.sample)
                    for turn in t.turns
                    for c in turn.calls
                    if c.status == "ok" and c.start is not None and c.end is not None
                ]
                r["summary_ok"] = [float(x) for x in checks if x is not None]
                recs.append(r)
        recs = [r for part in all_gather_objects(recs, tr.ctx) for r in part]
        m = rollout_metrics(recs)
        acc = [r["breakdown"].get("acc", 0.0) for r in recs]
        m["accuracy"], m["accuracy_ci95"] = clustered_mean_ci95(acc, [r["prompt"] for r in recs])
        oks = [x for r in recs for x in r["summary_ok"]]
        m["summary_accuracy"] = sum(oks) / len(oks) if oks else float("nan")
        m["prompts"] = float(len({r["prompt"] for r in recs}))
        if i == 0:
            out.update(m)
        for key in (*EVAL_CONDITION_KEYS, "accuracy_ci95", "prompts"):
            out[f"{name}/{key}"] = m[key]
    return out


# ---------------------------------------------------------------------------- checkpoint


def save(tr: Trainer, step: int, *, data: dict[str, int] | None = None, rng: Any = None) -> bool:
    """Checkpoint ``step`` (rank 0 writes; every rank takes part in gathering the state).

    ``data`` / ``rng``: the prompt sampler's position and this rank's RNG states to record
    instead of the current ones (a preemption that abandoned step ``step + 1`` saves the state
    that step started from; the weights, optimizer and schedule are still step ``step``'s).

    A failed write (disk full ...) leaves the previous checkpoint the newest; then
    ``train.on_save_error`` decides: ``fail`` raises ``CheckpointSaveError`` on every rank
    (``main`` exits 1 with its message), ``continue`` prints it and returns False."""
    from paravt.checkpoint import CheckpointSaveError, rng_state, save_checkpoint
    from paravt.distributed import (
        all_gather_objects,
        full_optimizer_state,
        full_state_dict,
    )

    model_state = full_state_dict(tr.policy, tr.ctx)
    optim_state = full_optimizer_state(tr.policy, tr.optimizer, tr.ctx)
    rngs = all_gather_objects(rng_state() if rng is None else rng, tr.ctx)
    failed: CheckpointSaveError | None = None
    if tr.ctx.is_main:
        try:
            save_checkpoint(
                tr.cfg.train.out_dir,
                step,
                model=tr.policy,
                model_state=model_state,
                trainer_state={
                    "optimizer": optim_state,
                    "scheduler": tr.scheduler.state_dict(),
                    "rng": rngs,
                    "data": tr.sampler.state() if data is None else data,
                    "world_size": tr.ctx.world_size,
                },
                tokenizer=tr.bundle.tokenizer,
                source_dir=tr.init_dir,
                keep_last=tr.cfg.train.keep_last,
            )
        except CheckpointSaveError as e:
            failed = e
    # Every rank learns rank 0's outcome (this is also the barrier after the save).
    said = all_gather_objects("" if failed is None else str(failed), tr.ctx)[0]
    if not said:
        return True
    if tr.cfg.train.on_save_error == "continue":
        if tr.ctx.is_main:
            print(
                f"[train] warning: {said} Training goes on without it "
                "(train.on_save_error=continue).",
                file=sys.stderr,
                flush=True,
            )
        return False
    raise failed or CheckpointSaveError(said)


# ---------------------------------------------------------------------------------- main


def run(cfg: Config) -> dict[str, Any]:
    """Train with a validated config; returns ``{"before", "after", "last", "out_dir"}``, and
    ``"preempted"`` (``_preempted``) when a SIGTERM/SIGUSR1 stopped it early (``after`` then
    empty): the run, not the caller, handles those signals while it runs (``paravt.preempt``).
    """
    from paravt.distributed import init_distributed, world_size_from_env
    from paravt.preempt import Preemption

    validate_run(cfg, world_size_from_env())  # before anything heavy loads
    ctx = init_distributed(cfg.model.device)
    with Preemption(cfg.train.preempt_grace_s, ctx) as pre:
        return _run(cfg, ctx, pre)


def _run(cfg: Config, ctx: Any, pre: Any) -> dict[str, Any]:
    from paravt.alarms import CollapseDetector
    from paravt.checkpoint import rng_state
    from paravt.distributed import cleanup
    from paravt.metrics import format_table, plot_summary, postfix, progress_bar, read_metrics
    from paravt.preempt import StepAbandoned

    out = Path(cfg.train.out_dir)
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(to_yaml(cfg))
        print(to_yaml(cfg), flush=True)
    t_run = time.perf_counter()
    tr = build_trainer(cfg, ctx)
    tr.preempt = pre
    t = cfg.train

    before: dict[str, float] = {}
    pre.enter(tr.start_step, "eval")
    if t.eval_prompts and t.eval_before:
        prev = [r for r in read_metrics(out / "metrics.jsonl") if r.get("kind") == "eval_before"]
        if prev and tr.start_step > 0:
            before = prev[-1]
        else:
            before = evaluate(tr, seed=t.seed)
            tr.logger.log(tr.start_step, before, kind="eval_before")

    bar = progress_bar(
        t.steps, initial=tr.start_step, enabled=ctx.is_main and t.progress, desc="PARA-GRPO"
    )
    # Collapse alarms; on --resume the kept rows restore starting levels and armed states.
    alarms = CollapseDetector.from_config(t)
    if tr.start_step > 0:
        alarms.replay(read_metrics(out / "metrics.jsonl"))
    last: dict[str, float] = {}
    # Preemption (paravt.preempt): the last completed step, the step the newest checkpoint
    # holds, and what the step in progress started from (what an abandoned step leaves).
    done = saved = tr.start_step
    begin: tuple[dict[str, int], Any] | None = None
    abandoned = 0
    for step in range(tr.start_step + 1, t.steps + 1):
        if pre.requested():  # any rank, during the previous step or before the first
            break
        begin = (tr.sampler.state(), rng_state())
        try:
            last = train_step(tr, step)
        except StepAbandoned:
            abandoned = step
            break
        done = step
        pre.rest_s = last["time/step"] - last["time/rollout"]  # for should_abandon
        tr.logger.log(step, last)
        for a in alarms.update(step, last):
            tr.logger.log(step, a.row(), kind="alarm")
            if ctx.is_main:
                bar.write(f"[alarm] step {step}: {a.message}")
        bar.set_postfix(postfix(last))
        bar.update(1)
        if (t.save_every and step % t.save_every == 0) or step == t.steps:
            pre.enter(step, "checkpoint")
            t0 = time.perf_counter()
            if save(tr, step):
                saved = step
            pre.save_s = time.perf_counter() - t0
    bar.close()
    if abandoned or pre.requested():
        info = _preempted(tr, done, saved, begin if abandoned else None)
        tr.logger.close()
        cleanup(ctx, getattr(tr.engine, "close", lambda: None))
        return {"before": before, "after": {}, "last": last, "out_dir": str(out), "preempted": info}
    pre.enter(t.steps, "eval")

    after = evaluate(tr, seed=t.seed) if t.eval_prompts else {}
    if after:
        tr.logger.log(t.steps, after, kind="eval_after")
    if ctx.is_main:
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
    from paravt.checkpoint import step_dirname

    pre, t = tr.preempt, tr.cfg.train
    ckpt_dir = Path(t.out_dir) / "checkpoints"
    ok, wrote = True, ""
    if done > saved:
        pre.enter(done, "checkpoint")
        t0 = time.perf_counter()
        if begin is None:
            ok = save(tr, done)
        else:
            ok = save(tr, done, data=begin[0], rng=begin[1])
        wrote = f" written in {time.perf_counter() - t0:.1f} s"
        path = str(ckpt_dir / step_dirname(done))
    elif done > 0:
        wrote, path = " (already written)", str(ckpt_dir / step_dirname(done))
    else:
        path = ""
    arrivals = pre.arrivals()  # after the save: how long since the earliest signal
    first, seconds = arrivals[0]
    where = f"{first.signal} at step {first.step} ({first.phase})"
    if tr.ctx.world_size > 1:
        ranks = sorted(a[0].rank for a in arrivals)
        where += f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    if begin is not None:
        outcome = f"abandoned step {done + 1} after its rollout (finishing it would pass the grace)"
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


def main(argv: Sequence[str] | None = None) -> int:
    from paravt.checkpoint import CheckpointSaveError
    from paravt.data.readers import DatasetError

    try:
        cfg, _ = parse_args(argv)
        res = run(cfg)
        if not res.get("preempted", {}).get("ok", True):
            return 1
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except CheckpointSaveError as e:  # train.on_save_error=fail; the previous one is intact
        print(f"error: {e}", file=sys.stderr)
        return 1
    except DatasetError as e:  # raised before any model loads (read_datasets)
        print(
            f"error: {e}\n(the dataset is checked before any model loads: fix it, or point "
            "data.path at another dataset)",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
