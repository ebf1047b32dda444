"""The cold-start SFT's resumable state (``paravt.sft``): a folder of each rank's shards
(``sharded.save_sharded``) and rank 0's ``state.pt``, replaced whole at each save
(``save_sft_state``), checked against its manifest and read without running code on resume
(``read_sft_small``, ``load_sft_state``).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from paravt.checkpoint.layout import (
    SHARDED_FORMAT,
    TRAIN_STATE_DIR,
    CheckpointLoadError,
    fsync_dir,
)
from paravt.checkpoint.manifest import run_id, write_manifest
from paravt.checkpoint.safe_load import read_dcp_metadata, short_reason
from paravt.checkpoint.sharded import load_sharded, write_shards
from paravt.checkpoint.small import safe_torch_load
from paravt.checkpoint.trust import problem_of
from paravt.distributed import (
    DistContext,
    all_gather_objects,
    sharded_train_state,
)
from paravt.files import atomic_file

#: The small file of a sharded SFT state folder (``save_sft_state``).
SFT_STATE_FILE = "state.pt"


def save_sft_state(
    path: str | Path,
    small: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    ctx: DistContext,
) -> None:
    """The cold-start SFT's state (``paravt.sft``: a preemption's, or every
    ``sft.save_every`` steps) as the folder ``path``, on every rank, nothing gathered: each
    rank writes its shards of the masters and of AdamW's state (``save_sharded``, into
    ``train_state/``) and rank 0 ``small`` (settings, step, schedule, each rank's shuffle
    state, the losses) as ``state.pt``. The folder replaces the previous one only once
    complete (a kill mid-save leaves the previous state; ``sft_state_folder`` finds it even
    between the two renames). A failed write on any rank raises ``OSError`` on every rank."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    optim_empty = not optimizer.state  # as Checkpointer.save: DCP would create the state
    sharded = sharded_train_state(model, optimizer, masters=True)
    err: OSError | None = None
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            (tmp / TRAIN_STATE_DIR).mkdir(parents=True)
        except OSError as e:
            err = e
    bad = all_gather_objects(None if err is None else str(err), ctx)[0]
    if bad is None:
        try:
            failed, digests = write_shards(tmp / TRAIN_STATE_DIR, sharded, ctx)
        finally:
            if optim_empty:
                optimizer.state.clear()
        bad = None if failed is None else str(OSError(*failed))
    if bad is None and ctx.is_main:
        try:
            with atomic_file(tmp / SFT_STATE_FILE) as f:
                torch.save({**small, "format": SHARDED_FORMAT, "optim_empty": optim_empty}, f)
            fsync_dir(tmp / TRAIN_STATE_DIR)
            step = int(small.get("step", 0))
            write_manifest(tmp, step, run_id(path.parent, create=True), digests)
            fsync_dir(tmp)
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            if path.exists():
                os.replace(path, old)
            os.replace(tmp, path)
            fsync_dir(path.parent)
            shutil.rmtree(old, ignore_errors=True)
        except OSError as e:
            err = e
    bad = bad or all_gather_objects(str(err) if err else None, ctx)[0]
    if bad:
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(errno.EIO, f"could not save the SFT state to {path}: {bad}")


def sft_state_folder(path: str | Path) -> Path | None:
    """The complete SFT state folder ``save_sft_state`` left at ``path`` (or, after a kill
    between its two renames, the previous one it had moved aside); None when there is none."""
    path = Path(path)
    for cand in (path, path.with_name(f".{path.name}.old")):
        if (cand / SFT_STATE_FILE).is_file() and (cand / TRAIN_STATE_DIR / ".metadata").is_file():
            return cand
    return None


def read_sft_small(where: Path) -> dict[str, Any]:
    """The small state of a cold-start SFT state (``paravt.sft``'s resume): ``where`` a
    ``save_sft_state`` folder (its ``state.pt``, after the folder is checked against its
    manifest: run id, sizes, digests, as ``verify_checkpoint``) or an older paravt's one-file
    ``sft.resume.pt``; read without running code. Anything wrong is ``CheckpointLoadError``,
    one line naming the file and the way out (the SFT has no older state to fall back to)."""
    run_dir = where.parent
    fix = (
        f"Remove {where} to run the cold-start SFT again from its start (--resume does so "
        "when there is no SFT state), or restore the file"
    )
    problem = ""
    if where.is_dir():
        problem, _ = problem_of(where, run_id(run_dir), slice(None))
        target = where / SFT_STATE_FILE
    else:
        target = where
    if not problem:
        try:
            small = safe_torch_load(target)
        except Exception as e:  # noqa: BLE001 - a torn or planted file: torch raises many kinds
            problem = (
                f"{target.name} cannot be read without running code or is torn ({short_reason(e)})"
            )
    if not problem and where.is_dir():  # the shards' .metadata, before DCP reads it
        meta = where / TRAIN_STATE_DIR / ".metadata"
        try:
            read_dcp_metadata(meta)
        except Exception as e:  # noqa: BLE001
            problem = f"{TRAIN_STATE_DIR}/.metadata cannot be read safely ({short_reason(e)})"
    if not problem:
        return small
    raise CheckpointLoadError(f"--resume refused: the SFT state {where}: {problem}. {fix}")


def load_sft_state(
    folder: Path, small: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Read a ``save_sft_state`` folder's shards into ``model`` (the masters) and
    ``optimizer``, on any world size (every rank, after ``shard_model`` and the optimizer);
    ``small``: its ``state.pt``, read already (whether the optimizer had stepped)."""
    load_sharded(folder / TRAIN_STATE_DIR, model, optimizer, masters=True)
    if small.get("optim_empty"):
        optimizer.state.clear()
