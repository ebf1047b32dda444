"""``python -m paravt.sft`` — cold-start SFT on tool-use trajectories.

Why: a freshly initialised (or instruct) model rarely emits well-formed parallel
``<tool_call>`` blocks, so RL has nothing to reinforce. A short SFT on oracle trajectories
(think → parallel crops → think → answer) teaches the protocol first.

Data: a JSONL of records, one per trajectory, joined to the dataset rows by sample id:

* the synthetic task's ``sft.jsonl`` (default)::

      {"sample_id", "num_frames": K, "turns": [{"role": "assistant", "content": str},
                                               {"role": "tool", "content": [summary, ...]}, ...]}

* the ParaVT SFT message format for real data: ``{"id"|"sample_id", "messages": [...]}`` with
  OpenAI-style ``system``/``user``/``assistant``/``tool`` messages. The system and user
  messages are *not* copied: the prompt (tool schema, overview frames with timestamps,
  question) is rebuilt by the same code RL and eval use, so SFT, RL and eval see one encoding.
  Consecutive ``tool`` messages form one tool turn (one summary per valid call).

Every record becomes a token-exact ``Trajectory`` through
``paravt.agent.encoder.encode_oracle_trajectory`` (the RL context builder): loss mask 1 on the
assistant's generated tokens (and their ``<|im_end|>``), 0 on the prompt, the forced
``<think>`` prefix and the tool responses — tool-response and prompt tokens are not trained.

Loss: token-mean negative log-likelihood over masked tokens (temperature 1), AdamW; with
torchrun each rank takes its share of every batch and the normaliser is global.
The result is an HF checkpoint directory (``from_pretrained``-loadable).

Preemption: inside a training run (``paravt.train``, whose handler ``paravt.preempt.active``
returns) the SFT checks for a SIGTERM/SIGUSR1 before each of its steps. After one it saves
its state after the last finished step — weights, AdamW moments, schedule, each rank's
shuffle RNG and order, the losses so far — to the folder ``<out>.resume``
(``paravt.runfolder.sft_resume_dir``; each rank writes its own shards of the masters and
moments, nothing is gathered: ``paravt.checkpoint.save_sft_state``) and stops the run (``SFTPreempted``, exit 0). The next
``run_sft`` of the same settings (the resumed run) continues from that step: on CPU the final
weights equal an uninterrupted SFT's bitwise. On another number of ranks it continues too
(the shards are read on any world size; the records are split per rank, so each rank's order
is drawn again: not bitwise). A state made with other settings is set aside and the SFT
starts over; the finished SFT deletes it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from paravt import preempt
from paravt.agent.encoder import encode_oracle_sub_trajectories, encode_oracle_trajectory
from paravt.algo.logprobs import packed_logprob_rows
from paravt.algo.packing import microbatches, pack_units
from paravt.assets import prepare_assets
from paravt.checkpoint import (
    MANIFEST,
    CheckpointLoadError,
    load_sft_state,
    read_sft_small,
    save_model_dir,
    save_sft_state,
    sft_save_error,
    sft_state_folder,
)
from paravt.config import AlgoConfig, Config, ConfigError, load_config, preset_errors, to_yaml
from paravt.data.readers import load_samples
from paravt.data.sft_records import SFTRecord, read_sft_records
from paravt.distributed import (
    DistContext,
    Precision,
    all_gather_objects,
    all_reduce_sum,
    barrier,
    cast_floats,
    cleanup,
    clip_grad_norm,
    full_state_dict,
    init_distributed,
    load_full_optimizer_state,
    release_single_rank_group,
    shard_model,
)
from paravt.log import get_logger
from paravt.models import load_model_from_config
from paravt.models.forward import as_root_forward
from paravt.models.loader import freeze_vit
from paravt.preempt import SFTPreempted
from paravt.runfolder import sft_resume_dir
from paravt.types import Sample, SequenceUnit, Trajectory
from paravt.video import DecodePlanner, VideoError

log = get_logger(__name__)


def encode_records(
    records: Sequence[SFTRecord],
    samples: Sequence[Sample],
    bundle: Any,
    cfg: Config,
    planner: Any = None,
) -> list[Trajectory]:
    """Token-exact SFT trajectories (records whose sample or video is missing are skipped):
    each record's main trajectory and, with ``sft.sub_agents``, one sub-agent trajectory per
    answered crop (the crop's frames → the record's summary). Records are read with
    ``paravt.data.sft_records.read_sft_records``; the agent's encoder reads each as its JSON
    object (``SFTRecord.to_dict``)."""

    by_id = {s.id: s for s in samples}
    out: list[Trajectory] = []
    skipped = 0
    for rec in records:
        sample = by_id.get("" if rec.sample_id is None else str(rec.sample_id))
        if sample is None:
            skipped += 1
            continue
        try:
            main = encode_oracle_trajectory(bundle, cfg, sample, rec.to_dict(), planner)
            out.append(main)
            # The same weights learn to describe the crops it asks for; a "main_only" record
            # (a colour-swapped copy, paravt.data.synth.colour_swaps) has summaries that are
            # not what its crops show, and trains the main agent alone.
            if cfg.sft.sub_agents and not rec.main_only:
                out += encode_oracle_sub_trajectories(bundle, cfg, sample, main, planner)
        except VideoError as e:
            log.warning(f"[sft] skipping {sample.id}: {e}")
            skipped += 1
    if skipped:
        log.warning(f"[sft] skipped {skipped} record(s) without a readable sample")
    return out


def sft_loss(
    model: torch.nn.Module,
    trajs: Sequence[Trajectory],
    *,
    global_tokens: float,
    world: int = 1,
    max_tokens: int | None = None,
    share_prefix: bool = False,
) -> tuple[float, float]:
    """Back-propagate the token-mean NLL of ``trajs`` through packed forwards.

    ``loss = -sum_{s,t} m_t log p(x_t | x_<t) / global_tokens`` (times ``world`` to undo FSDP
    gradient averaging). The sequences are packed (``paravt.algo.packing.pack_units``) and
    grouped into micro-batches of at most ``max_tokens`` tokens
    (``algo.max_tokens_per_microbatch``; ``microbatches``); each micro-batch is ONE backbone
    forward with no attention across sequences, only the target rows meet the lm_head (the
    trainer's ``paravt.algo.logprobs.packed_logprob_rows``, T = 1), and each micro-batch is back-propagated on
    its own, so activations never outlive their micro-batch. Same value and gradient as one
    forward per sequence (``sequence_logprobs``; tests/test_sft.py). On the tiny CPU default,
    same 4-row batches: 38-46 ms per step against 73 ms for one forward per sequence. Returns
    ``(sum of -log p over masked tokens, masked token count)``.
    """

    for t in trajs:
        if t.temperature != 1.0 or t.top_p != 1.0:
            raise ValueError(
                f"SFT trajectory {t.uid}: temperature {t.temperature} / top_p {t.top_p}; SFT "
                "scores targets at T = 1, top_p = 1 (oracle rows carry no sampling settings)"
            )
    # share_prefix (algo.share_prefix): records of one prompt group share its encoding.
    batch = pack_units([SequenceUnit(t, [], 0.0, t.group_id) for t in trajs], share_prefix)
    budget = max_tokens or AlgoConfig().max_tokens_per_microbatch
    nll_sum = 0.0
    for seqs in microbatches(batch, budget):
        index, lp_n, _ = as_root_forward(model, packed_logprob_rows, batch, seqs, False)
        m = batch.loss_mask.to(lp_n.device).index_select(0, index)
        nll = -(lp_n * m).sum()
        (nll * (world / max(global_tokens, 1.0))).backward()
        nll_sum += float(nll.detach())
    return nll_sum, float(batch.loss_mask.sum())


def lr_factor(schedule: str, step: int, steps: int) -> float:
    """The SFT learning-rate multiplier at ``step`` of ``steps`` (``sft.schedule``):
    ``constant`` 1, or ``cosine`` from 1 down to 0.1 over the run."""
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(step, steps) / max(1, steps)))
    raise ValueError(f"sft.schedule='{schedule}' is not one of constant|cosine")


def param_groups(model: torch.nn.Module, lr: float, vision_lr: float) -> list[dict[str, Any]]:
    """AdamW groups: the vision tower's trainable parameters (``.visual.``) at ``vision_lr``
    (0 = ``lr``), the rest at ``lr``. See :func:`freeze_vit` for what one shared lr of 3e-3
    does to the tiny model's tower."""
    vis = [p for n, p in model.named_parameters() if p.requires_grad and ".visual." in f".{n}"]
    ids = {id(p) for p in vis}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
    groups: list[dict[str, Any]] = [{"params": rest, "lr": lr}]
    if vis:
        groups.append({"params": vis, "lr": vision_lr or lr})
    return groups


def _sft_settings(
    cfg: Config, model_dir: str | Path, sft_path: str, counts: list[int], world: int
) -> dict[str, Any]:
    """What a saved SFT state must match to be continued (``run_sft``)."""
    from dataclasses import asdict

    sft = asdict(cfg.sft)
    sft.pop("save_every")  # how often the state is saved, not what it is
    return json.loads(
        json.dumps(
            {
                "sft": sft,
                "seed": cfg.train.seed,
                "model_dir": str(model_dir),
                "data": str(sft_path),
                "trajectories": counts,
                "world_size": world,
            }
        )
    )


def _continues(saved: Any, settings: dict[str, Any]) -> bool:
    """Whether an SFT state saved with ``saved`` settings is continued under ``settings``: the
    same everything but the world size (the shards are read on any world size, as the RL
    state's; the records are split per rank, so only their total must match)."""
    if not isinstance(saved, dict):
        return False

    def portable(x: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in x.items() if k not in ("world_size", "trajectories")}

    try:
        total = sum(saved["trajectories"]) == sum(settings["trajectories"])
    except (KeyError, TypeError):
        return False
    return total and portable(saved) == portable(settings) and "world_size" in saved


def _sft_state(
    settings: dict[str, Any], step: int, sched: Any, rng: random.Random, order: list[int],
    losses: list[float], ctx: Any,
) -> dict[str, Any]:  # fmt: skip
    """The small part of the SFT's state after ``step`` steps (collective: every rank's
    shuffle state is gathered); the masters and AdamW's state are written sharded beside it
    (``paravt.checkpoint.save_sft_state``): what ``run_sft`` continues from."""

    return {
        "settings": settings,
        "step": step,
        "scheduler": sched.state_dict(),
        "ranks": all_gather_objects((rng.getstate(), list(order)), ctx),
        "losses": list(losses),
    }


def _read_sft_state(path: Path) -> tuple[dict[str, Any], Path | None] | None:
    """The saved SFT state at ``path`` (``sft_resume_dir``) as ``(small, folder)``: the
    sharded folder (or the one a kill between its renames left aside), else an older paravt's
    one-file ``<run>/sft.resume.pt`` (full weights and moments inside, ``folder`` None).
    Read without running code and checked against the folder's manifest
    (``paravt.checkpoint.read_sft_small``): a damaged or foreign state is one line
    (``CheckpointLoadError``)."""
    folder = sft_state_folder(path)
    if folder is None and (Path(path) / MANIFEST).is_file():
        folder = Path(path)  # a saved state missing a file: refused naming it, not redone
    if folder is not None:
        return read_sft_small(folder), folder
    legacy = Path(str(path) + ".pt")
    if legacy.is_file():
        return read_sft_small(legacy), None
    return None


def run_sft(
    cfg: Config,
    *,
    model_dir: str | Path,
    data_dir: str | Path,
    out_dir: str | Path,
    ctx: Any = None,
    log: Any = print,
) -> dict[str, float]:
    """Cold-start SFT of the checkpoint at ``model_dir``; writes an HF checkpoint to ``out_dir``
    (in the compute dtype ``model.dtype``; trained in ``train.master_dtype``).

    Returns ``{"sft/loss_first", "sft/loss_last", "sft/tokens", "sft/seconds"}``. Inside a
    training run a SIGTERM/SIGUSR1 stops it between two steps with its state saved
    (``SFTPreempted``); the next call with the same settings continues it (module docstring).
    """
    import torch.distributed as dist

    fresh = not dist.is_initialized()
    try:
        return _run_sft(cfg, model_dir, data_dir, out_dir, ctx, log)
    finally:  # one process under mixed precision: the group of one it started goes with it
        if fresh:
            release_single_rank_group()


def _run_sft(
    cfg: Config, model_dir: str | Path, data_dir: str | Path, out_dir: str | Path, ctx: Any,
    log: Any,
) -> dict[str, float]:  # fmt: skip

    ctx = ctx or DistContext()
    t_start = time.perf_counter()
    s = cfg.sft
    # The trained weights in train.master_dtype, computing in model.dtype (shard_model below).
    prec = Precision.from_config(cfg)
    bundle = load_model_from_config(
        model_dir, cfg.model, device=str(ctx.device), dtype=cfg.train.master_dtype
    )
    samples = load_samples(data_dir, video_root=cfg.data.video_root, split="train")
    sft_path = s.data or str(Path(data_dir) / "sft.jsonl")
    records = read_sft_records(sft_path)
    planner = DecodePlanner.from_config(cfg.video)
    # Each rank encodes only its own records (encoding decodes video; no rank needs all).
    mine = records[ctx.rank :: ctx.world_size]
    trajs = encode_records(mine, samples, bundle, cfg, planner)
    counts = all_gather_objects(len(trajs), ctx)
    if min(counts) <= 0:
        raise ValueError(
            f"SFT data '{sft_path}' gave no usable trajectory on some rank (records must match "
            f"train sample ids of '{data_dir}')"
        )
    model = bundle.model
    # A state saved by a preempted SFT of the same settings: continue from it.
    pre = preempt.active()
    resume_file = sft_resume_dir(out_dir)
    settings = _sft_settings(cfg, model_dir, sft_path, counts, ctx.world_size)
    saved, folder = _read_sft_state(resume_file) or (None, None)
    if saved is not None and not _continues(saved.get("settings"), settings):
        if ctx.is_main:
            log(f"[sft] {resume_file} was saved with other settings: not continued")
        saved = None
    if saved is not None and folder is None:  # an older paravt's full state
        model.load_state_dict(saved["model"])
    model.train()  # no dropout in Qwen-VL by default; train mode enables grad checkpointing
    if cfg.model.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable()
    if s.freeze_vision_tower:
        frozen = freeze_vit(model)
        if ctx.is_main:
            log(f"[sft] vision tower frozen except its mergers ({len(frozen)} tensors)")
    shard_model(model, ctx, prec)
    opt = torch.optim.AdamW(
        param_groups(model, s.lr, s.vision_lr), lr=s.lr, betas=(0.9, s.adam_beta2), weight_decay=0.0
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_factor(s.schedule, i, s.steps))
    rng = random.Random(f"paravt-sft:{cfg.train.seed}:{ctx.rank}")
    per_rank = max(1, s.batch_size // ctx.world_size)
    losses: list[float] = []
    order: list[int] = []
    first = 0
    if saved is not None:
        if folder is not None:  # each rank reads its shards, on any world size
            load_sft_state(folder, saved, model, opt)
        else:
            load_full_optimizer_state(model, opt, saved["optimizer"], ctx)
        sched.load_state_dict(saved["scheduler"])
        losses = list(saved["losses"])
        first = int(saved["step"])
        was = int(saved["settings"]["world_size"])
        if was == ctx.world_size:  # each rank's own shuffle: bitwise an uninterrupted SFT
            rng_state, order = saved["ranks"][ctx.rank]
            rng.setstate(rng_state)
            order = list(order)
        else:  # the records split another way: a fresh draw of each rank's order
            rng = random.Random(f"paravt-sft:{cfg.train.seed}:{ctx.rank}:from-{first}:{was}")
        if ctx.is_main:
            moved = (
                ""
                if was == ctx.world_size
                else f" (saved on {was} rank(s), now {ctx.world_size}: the weights, moments "
                "and schedule continue, the record order is drawn again)"
            )
            log(f"[sft] continuing from {resume_file}: step {first} of {s.steps} done{moved}")
    for step in range(first, s.steps):
        if pre is not None:
            pre.enter(0, f"sft step {step + 1}")
            if pre.requested():  # collective: every rank is at this step
                state = _sft_state(settings, step, sched, rng, order, losses, ctx)
                _stop_sft(pre, resume_file, step, first, s.steps, ctx, log, state, model, opt)
        batch = []
        while len(batch) < per_rank:
            if not order:
                order = list(range(len(trajs)))
                rng.shuffle(order)
            batch.append(trajs[order.pop()])
        local_tok = float(sum(sum(t.loss_mask) for t in batch))
        global_tok = float(all_reduce_sum(local_tok, ctx).sum())
        nll, _ = sft_loss(
            model, batch, global_tokens=global_tok, world=ctx.world_size,
            max_tokens=cfg.algo.max_tokens_per_microbatch, share_prefix=cfg.algo.share_prefix,
        )  # fmt: skip
        clip_grad_norm([p for p in model.parameters() if p.grad is not None], 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss = float(all_reduce_sum(nll, ctx).sum()) / max(global_tok, 1.0)
        losses.append(loss)
        if s.save_every and (step + 1) % s.save_every == 0 and step + 1 < s.steps:
            # sft.save_every: the state a signal would save, so that a kill -9 loses at most
            # one interval (the next run_sft of these settings continues from it).
            t0 = time.perf_counter()
            state = _sft_state(settings, step + 1, sched, rng, order, losses, ctx)
            save_sft_state(resume_file, state, model, opt, ctx)
            if ctx.is_main:
                log(f"[sft] state after step {step + 1} saved to {resume_file} "
                    f"({time.perf_counter() - t0:.1f} s)")  # fmt: skip
        if ctx.is_main and (step % max(1, s.steps // 8) == 0 or step == s.steps - 1):
            log(f"[sft] step {step + 1}/{s.steps} nll/token {loss:.4f}")
    if pre is not None:  # past the SFT's steps: a signal now stops the run before any RL step
        pre.enter(0, "startup")
    state = cast_floats(full_state_dict(model, ctx), prec.compute)  # exported: compute dtype
    if ctx.is_main:
        tmp = Path(str(out_dir) + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        try:
            save_model_dir(tmp, model, state, tokenizer=bundle.tokenizer, source_dir=model_dir)
        except OSError as e:  # disk full ...: leave no half-written copy behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise sft_save_error(out_dir, state, model_dir, e) from e
        _install(tmp, Path(out_dir))
        for done in (resume_file, resume_file.with_name(f".{resume_file.name}.old")):
            shutil.rmtree(done, ignore_errors=True)  # done: nothing left to continue
        Path(str(resume_file) + ".pt").unlink(missing_ok=True)  # an older paravt's
    barrier(ctx)
    return {
        "sft/loss_first": losses[0] if losses else float("nan"),
        "sft/loss_last": losses[-1] if losses else float("nan"),
        "sft/trajectories": float(sum(counts)),
        "sft/seconds": time.perf_counter() - t_start,
    }


def _stop_sft(
    pre: Any,
    path: Path,
    step: int,
    first: int,
    steps: int,
    ctx: Any,
    log: Any,
    state: dict[str, Any],
    model: Any,
    opt: Any,
) -> None:
    """After a signal before SFT step ``step + 1`` (every rank): every rank saves its shards
    of the state after ``step`` steps (``state``: the small part) unless this run did no step
    (the folder, if any, holds it already); the ``[preempt]`` line is printed; raises
    ``SFTPreempted``."""

    t0 = time.perf_counter()
    if step > first:
        save_sft_state(path, state, model, opt, ctx)
    barrier(ctx)
    if step > first:
        what = f"state {path} written in {time.perf_counter() - t0:.1f} s"
    elif _read_sft_state(path) is not None:
        what = f"state {path} (already written)"
    else:
        what = "nothing to save"
    outcome = f"stopped the cold-start SFT after step {step} of {steps}"
    line, info = pre.exit_line(
        outcome, f"{what} (--resume continues the SFT from there); exiting 0"
    )
    info["checkpoint"] = str(path) if path.exists() else ""
    if ctx.is_main:
        log(line)
        sys.stdout.flush()
    raise SFTPreempted(info)


def _install(tmp: Path, out: Path) -> None:
    """Move the finished checkpoint ``tmp`` to ``out``, never leaving ``out`` without a whole
    checkpoint: an older one is moved aside (``out.old``) until the new one is in place, put
    back if that move fails, and deleted after. (A killed SFT never leaves a half checkpoint at
    ``out``: it is written under ``tmp`` first.)"""
    old = out.with_name(out.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if out.exists():
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        if old.exists():
            os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m paravt.sft", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny_cpu")
    p.add_argument("--config", action="append", default=[], help="YAML file (repeatable)")
    p.add_argument("--out", default="", help="output checkpoint dir (default <out_dir>/sft)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. sft.steps=20")
    a = p.parse_intermixed_args(argv)
    try:
        cfg = load_config(a.preset, a.config, a.overrides)
        if errs := preset_errors(a.preset, cfg):  # e.g. the 8B presets' model.path
            raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errs))
    except ConfigError as e:
        log.error(f"error: {e}")
        return 2

    ctx = init_distributed(cfg.model.device, hsdp=cfg.train.hsdp)
    if ctx.is_main:
        log.info(to_yaml(cfg))
    data_dir, model_dir = prepare_assets(cfg, ctx)
    out = a.out or str(Path(cfg.train.out_dir) / "sft")
    try:
        res = run_sft(cfg, model_dir=model_dir, data_dir=data_dir, out_dir=out, ctx=ctx)
    except CheckpointLoadError as e:  # a damaged or planted saved state: one line
        log.error(f"error: {e}")
        cleanup(ctx)
        return 1
    if ctx.is_main:
        print(json.dumps(res, indent=1))  # the command's result (stdout)
        log.info(f"[sft] wrote {out}")
    cleanup(ctx)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
