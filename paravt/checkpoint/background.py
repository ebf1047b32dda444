"""Written in the background (``train.async_save``; ``Checkpointer.save(background=True)``): the
save call gathers the export and the small state as always, then DCP's ``async_save`` copies
this rank's shards into fresh CPU tensors (``_CopyStager``: one copy, a GPU shard's or a CPU
one's; the update after the save does not reach it, checked bitwise by
``tests/test_checkpoint_async.py``) and writes them from a thread, coordinating over a gloo
process group of its own (``_save_group``) while the training step's collectives use the
default one; each rank writes its part of the export from a second thread (one rank: the
whole export; ``start_background``). The call
returns after the copy, and the ``Checkpointer`` holds the ``AsyncSave`` until it commits it
(``Checkpointer.finish``): at the end of the first step by which every rank's write is done
(each rank adds ``AsyncSave.written`` to the step's one all-reduce, the ``save_written`` sum
of ``StepStats``; the sum equal to the world size: no rank waits) or, whichever comes first,
at the next save, the run's end, a preemption's or a lost worker's checkpoint. One save is in
flight at a time. A failed background write surfaces at that wait, on every rank, naming its
step; a kill during it leaves only a ``.tmp-step_*`` folder, which the next save removes. A
run that raises for another reason leaves the write uncommitted (the previous checkpoint is
the newest).
"""

from __future__ import annotations

import copy
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import AsyncStager

from paravt.checkpoint.export import save_model_dir, write_export_meta, write_export_part
from paravt.checkpoint.layout import TRAIN_STATE_DIR
from paravt.checkpoint.manifest import shard_digests, top_digests
from paravt.checkpoint.sharded import group_up, quiet_single_process
from paravt.distributed import DistContext, ExportSplit


@dataclass
class AsyncSave:
    """A ``Checkpointer.save(background=True)`` in flight (``Checkpointer.pending``): the
    shard write (DCP ``async_save``, every rank) and rank 0's export write, both into
    ``job.tmp``, that ``Checkpointer.finish`` waits for and commits."""

    job: SaveJob
    shards: Future[Any]
    export: Future[Any] | None  # this rank's export part (one rank: the whole export)
    started: float  # time.perf_counter() at the start

    def written(self) -> bool:
        """Whether this rank's part of the write is finished (its shard write, and rank 0's
        export): ``Checkpointer.written``, the flag of the step's all-reduce."""
        return all(f is None or f.done() for f in (self.shards, self.export))


@dataclass
class SaveJob:
    """What one ``Checkpointer.save`` call writes and where (every rank; ``prev`` rank 0's)."""

    step: int
    run_dir: str
    root: Path
    tmp: Path
    needed: int
    prev: Path | None
    keep_last: int
    small: dict[str, Any] = field(repr=False)
    export: dict[str, torch.Tensor] = field(repr=False)  # this rank's part when ``split``
    split: ExportSplit | None = field(default=None, repr=False)  # several ranks: spread


def detached(export: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``export`` with every entry that shares storage with ``model``'s live tensors copied."""
    live = set()
    for t in (*model.parameters(), *model.buffers()):
        local = t.to_local() if hasattr(t, "to_local") else t
        live.add(local.untyped_storage().data_ptr())
    return {
        k: v.clone() if v.untyped_storage().data_ptr() in live else v for k, v in export.items()
    }


# The process group the background shard writes coordinate over (DCP's plan and metadata
# exchange), beside the default group that the training step's collectives use at the same
# time: gloo over every rank, created once per default group (torchtitan's async mode does
# the same). (default group, its gloo twin); None while no group is up.
_SAVE_GROUP: list[Any] = [None, None]


def _save_group() -> Any:
    if not group_up():
        return None
    world = dist.group.WORLD
    if _SAVE_GROUP[0] is not world:  # collective: every rank's first background save
        _SAVE_GROUP[:] = [world, dist.new_group(backend="gloo")]
    return _SAVE_GROUP[1]


def _cpu_snapshot(obj: Any) -> Any:
    """A copy of a state dict that nothing live shares: every tensor copied once to the CPU
    (a DTensor stays one, with its local shard copied: ``DTensor.to``, as DCP's own stager
    moves a GPU one; ``from_local`` would put it back on the mesh's device), containers
    rebuilt, other values deep-copied."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_snapshot(v) for v in obj)
    return copy.deepcopy(obj)


class _CopyStager(AsyncStager):
    """DCP ``async_save``'s stager for the background write: ``_cpu_snapshot``, in the calling
    thread, before the call returns. DCP's default (``FileSystemWriter.stage``) copies too, but
    a DTensor on the CPU twice (a deep copy, then a copy into a new tensor): measured 0.21 s
    against 0.03 s for the copy itself on bench/test_bench_checkpoint_save.py's 190 MB, and
    twice the memory while it runs."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return _cpu_snapshot(state_dict)

    def synchronize_staging(self) -> None:
        """Nothing: ``stage`` returns with the copy done."""

    def close(self) -> None:
        """Nothing held."""


def start_background(
    job: SaveJob,
    sharded: dict[str, Any],
    ctx: DistContext,
    model: torch.nn.Module,
    tokenizer: Any,
    source_dir: str | None,
) -> AsyncSave:
    """Every rank: stage this rank's shards (a CPU copy, in this thread) and write them in a
    DCP background thread; rank 0 also writes the HF export of ``model`` (``job.export``,
    with ``tokenizer`` and ``source_dir``'s files) into ``job.tmp`` in a thread."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    started = time.perf_counter()
    writer = dcp.FileSystemWriter(
        str(job.tmp / TRAIN_STATE_DIR), single_file_per_rank=True, sync_files=True
    )
    group = _save_group()
    if group is None:  # DCP's one-process warning comes from the write's thread: not news
        warnings.filterwarnings("ignore", message=r".*assuming the intent is to")
    with quiet_single_process():
        shards = dcp.async_save(
            sharded,
            storage_writer=writer,
            process_group=group,
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
            async_stager=_CopyStager(),
            no_dist=group is None,
        )
    # This rank's digests of what it wrote, in the background too (its shards; rank 0 also
    # the export): the commit at a step's end reads no byte.
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="paravt-save")
    written = cast("Future[Any]", shards)  # the THREAD type's handle
    shards = pool.submit(_then_digest, written, job.tmp / TRAIN_STATE_DIR, ctx.rank)
    export = None
    if job.split is not None:  # several ranks: each writes its part of the export
        export = pool.submit(
            _part_and_digest, job.tmp, model, job.export, job.split, ctx.rank, tokenizer,
            source_dir,
        )  # fmt: skip
    elif ctx.is_main:
        export = pool.submit(_export_and_digest, job.tmp, model, job.export, tokenizer, source_dir)
    pool.shutdown(wait=False)
    job.export = {}  # the export thread holds it; nothing else needs it
    return AsyncSave(job, shards, export, started)


def _then_digest(shards: Future[Any], folder: Path, rank: int) -> dict[str, Any]:
    """The background shard write's outcome (raises as it did), then this rank's digests."""
    shards.result()
    return shard_digests(folder, rank)


def _export_and_digest(
    tmp: Path, model: torch.nn.Module, export: dict[str, torch.Tensor], tok: Any, src: str | None
) -> dict[str, Any]:
    """Rank 0's background export (``save_model_dir``, fsynced), then its digests."""
    save_model_dir(tmp, model, export, tokenizer=tok, source_dir=src)
    return top_digests(tmp)


def _part_and_digest(
    tmp: Path,
    model: torch.nn.Module,
    part: dict[str, torch.Tensor],
    split: ExportSplit,
    rank: int,
    tok: Any,
    src: str | None,
) -> dict[str, Any]:
    """A rank's background share of a spread export (``write_export_part``; rank 0 also the
    non-weight files and the index, digested at the commit), then its part's digests."""
    written = write_export_part(tmp, part, split, rank)
    if rank == 0:
        write_export_meta(tmp, model, split, tokenizer=tok, source_dir=src)
    return written
