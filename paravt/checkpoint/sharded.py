"""The sharded training state (``train_state/``, torch.distributed.checkpoint): every rank writes
its own shards of the masters (under mixed precision) and of AdamW's state, in parallel, and
rank 0 the ``.metadata`` (``save_sharded``); no rank gathers them. ``--resume``
(``load_train_state``, through ``Checkpointer.load``) reads each rank's pieces back onto any
world size (DCP reshards: 2 ranks -> 1, 1 -> 2). The checkpoint folder must be on a file
system every rank sees (as ``out_dir`` already is).

Older checkpoints (format 1: no "format" key) held the full optimizer state ("optimizer") and
the float32 masters ("masters") in ``trainer_state.pt``; ``load_train_state`` still resumes
them, and ``read_train_state`` reads either format whole in one process (inspection, tests).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paravt.checkpoint.layout import SHARDED_FORMAT, STATE_FILE
from paravt.checkpoint.manifest import shard_digests
from paravt.checkpoint.safe_load import checked_reader, safe_load_planner
from paravt.checkpoint.small import load_trainer_state
from paravt.distributed import (
    DistContext,
    all_gather_objects,
    load_full_optimizer_state,
    load_sharded_train_state,
    sharded_train_state,
)


def group_up() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns on every call without a process group that it assumes one process: that is
    what a one-rank run without mixed precision is, not news."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*assuming the intent is to")
        yield


def save_sharded(path: str | Path, state: dict[str, Any]) -> None:
    """Every rank writes its own shards of ``state`` (``paravt.distributed.sharded_train_state``)
    into the folder ``path`` with ``torch.distributed.checkpoint``: ``__<rank>_0.distcp`` per
    rank, in parallel, and rank 0 the ``.metadata`` (which tensor pieces lie where) once every
    rank's files are written and fsynced; a tensor every rank holds whole (a step count) is
    written once. Collective over the default process group (none: one process). Raises
    ``OSError`` (this rank's) or DCP's ``CheckpointException`` (every rank, naming the ranks
    whose writes failed) on failure. ``Checkpointer.save``'s path."""
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True)
    with quiet_single_process():
        dcp.save(state, storage_writer=writer, no_dist=not group_up())


def load_sharded(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, masters: bool
) -> None:
    """Read the training state ``save_sharded`` wrote at ``path`` into ``model`` (the masters,
    when ``masters``) and ``optimizer``, on any world size: each rank reads the pieces of the
    files that overlap its own shards (``--resume``, through ``load_train_state``).
    Collective over the default process group (none: one process)."""
    import torch.distributed.checkpoint as dcp

    state = sharded_train_state(model, optimizer, masters=masters)
    reader = checked_reader(path)  # no code runs from the files (``safe_load``)
    with quiet_single_process():
        dcp.load(state, storage_reader=reader, planner=safe_load_planner(), no_dist=not group_up())
    load_sharded_train_state(model, optimizer, state)


def write_shards(
    path: Path,
    sharded: dict[str, Any],
    ctx: DistContext,
    then: Callable[[], dict[str, Any]] | None = None,
) -> tuple[tuple[int | None, str | None, Any] | None, dict[str, Any]]:
    """Every rank writes its shards (``save_sharded``) and digests them (``shard_digests``),
    then runs ``then`` (its other files' write, returning their digests: its part of a spread
    HF export); the first failed rank's ``(errno, strerror, filename)``, the same on every
    rank, or None when every write succeeded, and every rank's digests (one gather). A failure
    that is not the file system's (a bug) raises, on every rank alike (DCP's; ``then``'s after
    the gather, so that no rank waits in it for the one that failed).
    ``Checkpointer.save``'s and ``save_sft_state``'s shard write."""
    from torch.distributed.checkpoint import CheckpointException

    err: OSError | None = None
    bug = ""
    digests: dict[str, Any] = {}
    try:
        save_sharded(path, sharded)
        digests = shard_digests(path, ctx.rank)
    except (OSError, CheckpointException) as e:
        err = dcp_failure(e)
        if err is None:
            raise
    if then is not None and err is None:
        try:
            digests.update(then())
        except OSError as e:
            err = e
        except Exception as e:  # noqa: BLE001 - a bug: raised on every rank after the gather
            bug = f"{type(e).__name__}: {e}"
    mine = None if err is None else (err.errno, err.strerror, err.filename)
    got = all_gather_objects((mine, digests, bug), ctx)
    bugs = [(r, b) for r, (_, _, b) in enumerate(got) if b]
    if bugs:  # (no rank is left waiting in a collective for the rank that failed)
        raise RuntimeError(f"checkpoint write of {path}: rank {bugs[0][0]} failed: {bugs[0][1]}")
    return next((x for x, _, _ in got if x is not None), None), {
        k: v for _, d, _ in got for k, v in d.items()
    }


def dcp_failure(e: BaseException) -> OSError | None:
    """The first ``OSError`` behind a failed DCP save (its own, or a rank's in the
    ``CheckpointException``'s failures), for the error's path and errno."""
    if isinstance(e, OSError):
        return e
    for exc, _ in getattr(e, "failures", {}).values():
        if isinstance(exc, OSError):
            return exc
    return None


def load_train_state(
    ckpt_dir: str | Path,
    state: Mapping[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    ctx: DistContext,
) -> None:
    """``--resume`` (``paravt.train.build_trainer``, every rank, after ``shard_model`` and the
    optimizer): the optimizer state, and the masters if the checkpoint holds them, of the
    checkpoint ``ckpt_dir`` whose ``trainer_state.pt`` is ``state``, onto this run's world
    size, whatever the saving run's was.

    Sharded checkpoints (``format`` 2, ``Checkpointer.save``'s): every rank reads its shards from
    ``train_state/`` (``load_sharded``). Older ones (format 1): the full optimizer state in
    ``state["optimizer"]``, loaded on every rank (``load_full_optimizer_state``); their full
    masters, ``state["masters"]``, are the caller's to load into the unsharded model."""
    if "optimizer" in state:  # format 1
        load_full_optimizer_state(model, optimizer, state["optimizer"], ctx)
        return
    fmt = state.get("format")
    if fmt != SHARDED_FORMAT or "train_state" not in state:
        raise ValueError(
            f"checkpoint '{ckpt_dir}': {STATE_FILE} has format {fmt!r} and no 'optimizer' "
            f"entry; this paravt reads format {SHARDED_FORMAT} (sharded) and the older full "
            "format. Resume it with the paravt that wrote it, or start without --resume"
        )
    path = Path(ckpt_dir) / state["train_state"]["dir"]
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(
            f"checkpoint '{ckpt_dir}' has no sharded training state ({path}/.metadata is "
            "missing): the folder was altered after it was written (a complete checkpoint "
            "always has it). Remove it so that --resume takes the one before, or start "
            "without --resume"
        )
    load_sharded(path, model, optimizer, masters=bool(state["train_state"]["masters"]))
    if state.get("optim_empty"):  # saved before the first optimizer step: no state then
        optimizer.state.clear()


def read_train_state(ckpt_dir: str | Path) -> dict[str, Any]:
    """A checkpoint's whole training state in this one process, in either format:
    ``{"optimizer": {"state": {param name: {"exp_avg", "exp_avg_sq", "step"}},
    "param_groups": [...]}, "masters": {name: tensor}}`` (``masters`` only when the run kept
    masters apart from its export, i.e. under mixed precision). For inspection and the tests
    that compare two runs' states; needs memory for all of it. ``--resume`` never calls it
    (``load_train_state`` reads only each rank's shards)."""
    state = load_trainer_state(ckpt_dir)
    if "optimizer" in state:  # format 1
        return {k: state[k] for k in ("optimizer", "masters") if k in state}
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    out: dict[str, Any] = {}
    # No target state dict: DCP's own planner builds one from the metadata, every tensor whole
    # (what torch.distributed.checkpoint.format_utils.dcp_to_torch_save does, minus its file).
    path = Path(ckpt_dir) / state["train_state"]["dir"]
    _load_state_dict(
        out,
        storage_reader=checked_reader(path),
        planner=safe_load_planner(empty=True),
        no_dist=True,
    )
    res = {"optimizer": out["optim"]}
    if "model" in out:
        res["masters"] = out["model"]
    return res
