"""The trainer's checkpoints: ``Checkpointer`` (built once by ``paravt.train.build_trainer``
from the policy, its optimizer and ``states={"trainer": trainer}``), in torchtitan's
contract: it saves and loads the model and optimizer itself (``sharded``: each rank its
shards; the HF export, ``export``: rank 0's, or each rank's part under several) and every entry of ``states`` (anything with
``state_dict`` / ``load_state_dict``: the trainer's small state) through
``trainer_state.pt`` (``small``). It never sees a trainer: it holds the background save in
flight itself (``pending``) and returns what it measured (``Saved.times``) instead of writing
it anywhere. ``paravt.trainer.Trainer.checkpoint`` / ``finish_checkpoint`` are the run loop's
calls; ``tests/test_checkpoint*.py`` drive it directly.

A failed write (disk full ...) on any rank leaves the previous checkpoint the newest; then
``train.on_save_error`` decides: ``fail`` raises ``CheckpointSaveError`` on every rank
(``main`` exits 1 with its message), ``continue`` logs it and the save reports ``ok`` False.
"""

from __future__ import annotations

import copy
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from paravt.checkpoint.background import AsyncSave, SaveJob, detached, start_background
from paravt.checkpoint.commit import commit_folder, prepare_save
from paravt.checkpoint.export import gather_export, write_export_part, write_export_rank0
from paravt.checkpoint.layout import (
    CKPT_DIR,
    SHARDED_FORMAT,
    TRAIN_STATE_DIR,
    CheckpointSaveError,
    checkpoint_bytes,
    fsync_dir,
    latest_checkpoint,
    save_error,
    step_dirname,
)
from paravt.checkpoint.manifest import run_id, write_manifest
from paravt.checkpoint.sharded import dcp_failure, load_train_state, write_shards
from paravt.checkpoint.small import write_state
from paravt.config import Config, TrainConfig
from paravt.distributed import (
    DistContext,
    Precision,
    all_gather_objects,
    sharded_train_state,
)
from paravt.log import get_logger

log = get_logger("paravt.checkpoint")  # the package's one logger (its name before the split)

#: The keys of ``trainer_state.pt`` that are the layout's (the checkpointer's own): a state's
#: ``state_dict`` may not use them. "step" is the save's, checked against a state's "step".
LAYOUT_KEYS = ("format", "train_state", "optim_empty")


class Stateful(Protocol):
    """What ``Checkpointer`` saves besides the model and optimizer (torchtitan's contract):
    ``state_dict`` on every rank at each save (it may be collective), written flat into
    ``trainer_state.pt``; ``load_state_dict`` on ``--resume`` with that whole file."""

    def state_dict(self) -> Mapping[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@dataclass
class Saved:
    """The outcome of a ``Checkpointer.save`` / ``finish``: ``ok`` False when the write failed
    under ``train.on_save_error=continue`` (a background save: True once it started);
    ``times`` the phases it measured (``time/checkpoint_write``: a background save's whole
    write, from its start to its commit), for the caller's step metrics."""

    step: int
    ok: bool
    times: dict[str, float] = field(default_factory=dict)


class Checkpointer:
    """Checkpoints of ``policy`` and ``optimizer`` (``sharded``, ``export``) and of ``states``
    under ``train.out_dir/checkpoints`` (the layout: ``layout``), on every rank.

    ``train``: ``keep_last``, ``on_save_error``, ``async_save`` (read at each save) and
    ``out_dir``; ``precision``: masters kept apart (saved sharded) and the export's dtype;
    ``tokenizer`` / ``source_dir``: what the HF export copies beside the weights."""

    def __init__(
        self,
        policy: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        states: Mapping[str, Stateful],
        ctx: DistContext,
        train: TrainConfig,
        precision: Precision,
        tokenizer: Any = None,
        source_dir: str | None = None,
    ) -> None:
        self.policy, self.optimizer, self.states = policy, optimizer, dict(states)
        self.ctx, self.train, self.precision = ctx, train, precision
        self.tokenizer, self.source_dir = tokenizer, source_dir
        # The save written in the background (``train.async_save``), committed by ``finish``.
        self.pending: AsyncSave | None = None

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        ctx: DistContext,
        policy: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        states: Mapping[str, Stateful],
        tokenizer: Any = None,
        source_dir: str | None = None,
    ) -> Checkpointer:
        """The run's checkpointer: ``cfg.train``'s settings, ``Precision.from_config(cfg)``."""
        return cls(
            policy, optimizer, states=states, ctx=ctx, train=cfg.train,
            precision=Precision.from_config(cfg), tokenizer=tokenizer, source_dir=source_dir,
        )  # fmt: skip

    # ------------------------------------------------------------------------------ save

    def save(self, step: int, *, background: bool | None = None) -> Saved:
        """Checkpoint step ``step``, on every rank: each rank writes its own shards of the
        masters (under mixed precision) and of the optimizer state (``save_sharded``) and its
        part of the HF export (the compute-dtype weights, gathered one tensor at a time onto
        their owner rank; one rank: all of it), rank 0 ``trainer_state.pt`` (``{"step": step}``, the layout's flags and each state's
        ``state_dict``).

        ``background`` (None: ``train.async_save``): write the shards and the export parts
        in background threads and return once the state is copied (``pending``); ``finish``
        commits it, and runs first here for a save still in flight (one at a time): its
        ``times`` are this call's."""
        if background is None:
            background = bool(getattr(self.train, "async_save", False))
        before = self.finish()  # the save in flight, if any: committed before the next begins
        times = before.times if before is not None else {}
        # An optimizer that has not stepped yet (every update so far skipped) has no state;
        # DCP's state dict creates it (a step at lr 0: step counts 1, zero moments), which
        # would shift the run's Adam bias correction by one. It is cleared again after the
        # save (the background write has its own copy by then), and the checkpoint says so
        # (``optim_empty``) for the resume to do the same.
        optim_empty = not self.optimizer.state
        try:
            ok = self._save(step, optim_empty, background)
        finally:
            if optim_empty:
                self.optimizer.state.clear()
        return Saved(step, ok, times)

    def small_state(self, step: int, optim_empty: bool) -> dict[str, Any]:
        """``trainer_state.pt`` less its "step" (``small.write_state`` adds it): the layout's
        flags and every state's ``state_dict`` (collective where a state's is)."""
        small: dict[str, Any] = {
            "format": SHARDED_FORMAT,
            "train_state": {"dir": TRAIN_STATE_DIR, "masters": self.precision.mixed},
            "optim_empty": optim_empty,
        }
        for name, state in self.states.items():
            sd = dict(state.state_dict())
            if "step" in sd and int(sd.pop("step")) != step:
                raise ValueError(f"checkpoint step {step}: state {name!r} is at another step")
            if clash := sorted(sd.keys() & small.keys()):
                raise ValueError(f"state {name!r} uses the checkpoint's own keys {clash}")
            small.update(sd)
        return small

    def _save(self, step: int, optim_empty: bool, background: bool) -> bool:
        ctx, prec = self.ctx, self.precision
        small = self.small_state(step, optim_empty)
        # Each rank's shards, nothing gathered: float32 masters under bf16 compute (so that
        # --resume continues from the exact masters, not from their bf16 cast) and AdamW's.
        sharded = sharded_train_state(self.policy, self.optimizer, masters=prec.mixed)
        # The HF export holds the compute dtype (what plain transformers, vLLM and eval load).
        export, split = gather_export(self.policy, ctx, prec.compute)
        run_dir, keep_last = self.train.out_dir, self.train.keep_last
        root = Path(run_dir) / CKPT_DIR
        tmp = root / f".tmp-{step_dirname(step)}"
        # DTensors count their global size: the estimate is the whole checkpoint's.
        total = None if split is None else sum(split.nbytes.values())
        needed = checkpoint_bytes(
            export, {**small, "sharded": sharded}, self.source_dir, export_bytes=total
        )
        failed: CheckpointSaveError | None = None
        prev = latest_checkpoint(run_dir) if ctx.is_main else None
        if ctx.is_main:
            try:
                prepare_save(root, step, needed, prev)
                try:
                    (tmp / TRAIN_STATE_DIR).mkdir(parents=True)
                except OSError as e:
                    raise save_error(step, root, e.filename or tmp, needed, e, prev) from e
            except CheckpointSaveError as e:
                failed = e
        said = all_gather_objects("" if failed is None else str(failed), ctx)[0]
        if said:
            return self._on_save_error(said, failed)
        if background:
            # The background write gets a snapshot: the step after this one updates the live
            # tensors in place. The shards are copied as DCP stages them (``_CopyStager``);
            # the export's entries are new tensors already (gathered, cast) except where one
            # is a live tensor itself (no cast, one rank): copied.
            export = detached(export, self.policy)
            small = copy.deepcopy(small)
        job = SaveJob(step, run_dir, root, tmp, needed, prev, keep_last, small, export, split)
        if background:
            self.pending = start_background(
                job, sharded, ctx, self.policy, self.tokenizer, self.source_dir
            )
            return True
        # Every rank writes its shards into the folder rank 0 made (and its export part).
        part = None if split is None else lambda: write_export_part(tmp, export, split, ctx.rank)
        bad, written = write_shards(tmp / TRAIN_STATE_DIR, sharded, ctx, then=part)
        return self._complete(job, bad, written, exported=False)

    def written(self) -> bool:
        """Whether this rank's part of the background write is finished (``AsyncSave.written``):
        the flag ``paravt.train.train_step`` adds to the step's one all-reduce (``StepStats``,
        ``save_written``). Summed to the world size, every rank's is, and the step commits the
        save (``finish``) at its end without waiting; False while none is in flight."""
        return self.pending is not None and self.pending.written()

    def finish(self) -> Saved | None:
        """Wait for the background write (``save(background=True)``) and commit it, on every
        rank: once every rank's shards and export part are written, rank 0 writes
        ``trainer_state.pt`` and renames the folder into place (``latest``, ``keep_last``), as
        a synchronous save does. None when no save is in flight.

        Called by the next ``save``, by ``paravt.train.train_step`` at a step's end (every
        rank's write done) and by ``paravt.run`` before the run ends or stops (preemption, a lost rollout worker). A
        write that failed on any rank fails on every rank, naming the step:
        ``CheckpointSaveError`` (disk full, I/O: ``train.on_save_error`` decides, as for a
        synchronous save; ``ok`` False under ``continue``) or a ``RuntimeError`` (anything
        else). The previous checkpoint stays the newest either way."""
        from torch.distributed.checkpoint import CheckpointException

        pending, self.pending = self.pending, None
        if pending is None:
            return None
        job, ctx = pending.job, self.ctx
        mine: tuple[Any, ...] | None = None
        digests: dict[str, Any] = {}
        for fut in (pending.shards, pending.export):
            if fut is None or mine is not None:
                continue
            try:
                digests.update(fut.result())
            # (DCP's CheckpointException is a BaseException.) Decided after the gather, the
            # same on every rank.
            except (Exception, CheckpointException) as e:
                err = dcp_failure(e)
                mine = (
                    ("os", err.errno, err.strerror, err.filename)
                    if err is not None
                    else ("bug", f"{type(e).__name__}: {e}")
                )
        got = all_gather_objects((mine, digests), ctx)
        outcomes = [o for o, _ in got]
        bug = next(((r, o[1]) for r, o in enumerate(outcomes) if o and o[0] == "bug"), None)
        if bug is not None:
            if ctx.is_main:
                shutil.rmtree(job.tmp, ignore_errors=True)
            raise RuntimeError(
                f"checkpoint step {job.step} ({job.root / step_dirname(job.step)}): the "
                f"background write failed on rank {bug[0]}: {bug[1]}. Nothing of it was "
                "committed; the previous checkpoint is the newest. Fix: rerun with --resume "
                "(or set train.async_save=false to save in the foreground)"
            )
        bad = next((tuple(o[1:]) for o in outcomes if o), None)
        every = {k: v for _, d in got for k, v in d.items()}
        ok = self._complete(job, bad, every, exported=True)
        times = {"time/checkpoint_write": time.perf_counter() - pending.started} if ok else {}
        return Saved(job.step, ok, times)

    def _complete(
        self,
        job: SaveJob,
        bad: tuple[Any, ...] | None,
        digests: dict[str, Any],
        *,
        exported: bool,
    ) -> bool:
        """Every rank, after the shard write (``bad``: the first failed rank's ``(errno,
        strerror, filename)``; ``digests``: every rank's shard digests): rank 0 writes the
        export (unless ``exported``: the background did) and ``trainer_state.pt``, then the
        manifest, and commits; every rank learns the outcome."""
        ctx, step, root, tmp = self.ctx, job.step, job.root, job.tmp
        failed: CheckpointSaveError | None = None
        if ctx.is_main:
            try:
                if bad is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
                    cause = OSError(bad[0], bad[1], bad[2])
                    raise save_error(step, root, bad[2] or tmp, job.needed, cause, job.prev)
                try:
                    fsync_dir(tmp / TRAIN_STATE_DIR)  # the shard files' names
                    if not exported:  # (a spread export's parts are written)
                        write_export_rank0(
                            tmp, self.policy, job.export, job.split, self.tokenizer,
                            self.source_dir,
                        )  # fmt: skip
                    write_state(tmp, step, job.small)
                    write_manifest(tmp, step, run_id(job.run_dir, create=True), digests)
                except OSError as e:
                    shutil.rmtree(tmp, ignore_errors=True)
                    where = e.filename or tmp
                    raise save_error(step, root, where, job.needed, e, job.prev) from e
                commit_folder(job.run_dir, step, tmp, job.needed, job.prev, job.keep_last)
            except CheckpointSaveError as e:
                failed = e
        # Every rank learns rank 0's outcome (this is also the barrier after the save).
        said = all_gather_objects("" if failed is None else str(failed), ctx)[0]
        if not said:
            return True
        return self._on_save_error(said, failed)

    def _on_save_error(self, said: str, failed: CheckpointSaveError | None) -> bool:
        """``train.on_save_error`` on a failed save (every rank): raise, or warn and go on."""
        if self.train.on_save_error == "continue":
            if self.ctx.is_main:
                log.warning(
                    f"[train] warning: {said} Training goes on without it "
                    "(train.on_save_error=continue)."
                )
            return False
        raise failed or CheckpointSaveError(said)

    # ------------------------------------------------------------------------------ load

    def load(self, ckpt: str | Path, small: Mapping[str, Any]) -> None:
        """``--resume`` (every rank, after ``shard_model`` and the optimizer): the optimizer
        state and the masters of checkpoint ``ckpt`` (whose ``trainer_state.pt`` is
        ``small``, read already: ``load_trainer_state``) onto this run's world size
        (``load_train_state``), then ``small`` into every state (``load_state_dict``)."""
        load_train_state(ckpt, small, self.policy, self.optimizer, self.ctx)
        for state in self.states.values():
            state.load_state_dict(small)
