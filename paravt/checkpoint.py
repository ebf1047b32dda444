"""Checkpoints: HF-format safetensors weights + everything needed to resume a killed run.

Layout (one directory per saved step, under ``<out_dir>/checkpoints``)::

    step_000004/
      config.json, model.safetensors, tokenizer files ...   <- the exported model, written by
                                                              rank 0: ``from_pretrained``-
                                                              loadable in the compute dtype
                                                              (model.dtype); what eval, vLLM
                                                              and --resume's model load read
      trainer_state.pt                                      <- rank 0, small: step, scheduler,
                                                              sampler position ("data"), every
                                                              rank's RNG states ("rng"),
                                                              world_size, "format": 2
      train_state/                                          <- the training state, sharded
        .metadata                                              (torch.distributed.checkpoint):
        __0_0.distcp, __1_0.distcp, ...                        AdamW's state ("optim") and,
                                                              when train.master_dtype !=
                                                              model.dtype, the float32 masters
                                                              ("model"); each rank writes its
                                                              own shards, in parallel
      manifest.json                                         <- rank 0, last: the run id,
                                                              the step, every file's size and
                                                              sha256 (``verify_checkpoint``)
    latest                                                  <- text file: "step_000004"
  <out_dir>/run_id                                          <- the run's identity, written
                                                              when the run folder is created

Who writes what (``save_trainer``, every rank): no rank gathers the optimizer state or the
masters. Each rank writes its ``__<rank>_0.distcp`` (its FSDP2 shards) and rank 0 the
``.metadata`` (``save_sharded``); the HF export is the only thing gathered, one tensor at a
time and already cast to the compute dtype, onto rank 0 (``distributed.gathered_state_dict``).
``--resume`` (``load_train_state``) reads each rank's pieces back onto any world size (DCP
reshards: 2 ranks -> 1, 1 -> 2), into the FSDP2-sharded policy and its optimizer. The
checkpoint folder must be on a file system every rank sees (as ``out_dir`` already is).

Older checkpoints (format 1: no "format" key) held the full optimizer state ("optimizer") and
the float32 masters ("masters") in ``trainer_state.pt``; ``load_train_state`` still resumes
them, and ``read_train_state`` reads either format whole in one process (inspection, tests).

Atomicity: a checkpoint is written into ``.tmp-step_000004`` (every rank's shards first, then
rank 0's export and ``trainer_state.pt``) and renamed into place by rank 0 with one
``os.replace`` (atomic on POSIX within a file system) once every rank's writes are synced,
then ``latest`` is rewritten the same way.
A process killed at any instant leaves either the previous complete checkpoint or the new
complete one, never a torn one; stale ``.tmp-*`` directories are removed on the next save.
Deleting is the mirror image: an old checkpoint (pruned by ``keep_last``, or replaced when a
resumed run saves a step again) is first renamed to ``.tmp-del-*`` and only then removed, so a
``step_*`` directory is complete whenever it exists (``tests/test_checkpoint_kill.py`` kills a
saving process at each of these points). The one window left: re-saving an existing step
renames the old copy aside and the new one in with two renames; a kill between them leaves
``latest`` naming a missing directory, and ``latest_checkpoint`` falls back to the newest
complete one.

Failed writes (disk full, quota, I/O errors): rank 0 first checks that the file system has
room for the estimated size (``checkpoint_bytes``: the whole checkpoint, every rank's shards
counted), then on any ``OSError``, on any rank, the save is undone — the ``.tmp-*`` directory
is removed, a step directory it was replacing is put back, ``latest`` is left as it was — and
``CheckpointSaveError`` is raised naming the path, the bytes needed and free, and the fix. The
previous checkpoint stays the newest and loadable (``tests/test_checkpoint_disk_full.py`` fails
each write in turn; ``tests/test_checkpoint_sharded.py`` a rank's shard write).

Written in the background (``train.async_save``; ``save_trainer(background=True)``): the save
call gathers the export and the small state as always, then DCP's ``async_save`` copies this
rank's shards into fresh CPU tensors (``_CopyStager``: one copy, a GPU shard's or a CPU one's;
the update after the save does not reach it, checked bitwise by
``tests/test_checkpoint_async.py``) and writes them from a thread, coordinating over a gloo
process group of its own (``_save_group``) while the training step's collectives use the
default one; rank 0 writes the export from a second thread. The call returns after the copy.
``finish_trainer_save`` commits it at the end of the first step by which every rank's write
is done (each rank adds ``background_save_written`` to the step's one all-reduce, the
``save_written`` sum of ``StepStats``; the sum equal to the world size: no rank waits) or,
whichever comes first, waits for every rank's write at the next save, the run's end, a
preemption's or a lost worker's checkpoint; then commits as above: ``trainer_state.pt``,
the rename into place, ``latest``, ``keep_last``. One save is in flight at a time. A failed
background write surfaces at that wait, on every rank, naming its step (``CheckpointSaveError``
under ``train.on_save_error``, as a foreground save's); a kill during it leaves only a
``.tmp-step_*`` folder, which the next save removes. A run that raises for another reason
leaves the write uncommitted (the previous checkpoint is the newest).

The HF export is gathered onto rank 0 and written by it alone (in the background under
``train.async_save``), fsynced file by file before the folder is committed. The installed
torch has DCP's ``HuggingFaceStorageWriter`` (every rank writing its part of the
safetensors), not used yet: the export is what ``--resume``'s model load, eval and vLLM read
from every checkpoint as one ``model.safetensors`` in the compute dtype, and that writer's
per-rank files need a consolidation pass (and a reader of the sharded form) that is not
written; issue 61 item 4's other half, left open.

Trust (``resume_checkpoint``, ``--resume``'s pick, before anything loads): ``latest`` must
name a ``step_N`` folder beside it (no path, no link); the checkpoint's ``manifest.json``
must carry this run folder's ``run_id`` and list exactly its files, each of the size and
sha256 written at save; ``trainer_state.pt`` (and the SFT's ``state.pt``) are read with
``torch.load(weights_only=True)`` (NumPy's array records allowed: the RNG states), DCP's
``.metadata`` through ``_MetadataUnpickler`` (DCP's records only) and its non-tensor items
with ``weights_only=True`` (``_safe_load_planner``): no code in a checkpoint runs. Anything
wrong is one ``CheckpointLoadError`` line naming the step, the file and the newest intact
checkpoint, which ``train.resume_fallback`` continues from (``tests/test_checkpoint_trust.py``).
A checkpoint of an older paravt (no manifest, no ``run_id``) resumes without the digests.
"""

from __future__ import annotations

import copy
import errno
import fcntl
import hashlib
import json
import os
import pickle
import random
import re
import secrets
import shutil
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import AsyncStager

from paravt.config import ConfigError
from paravt.distributed import (
    DistContext,
    Precision,
    all_gather_objects,
    gathered_state_dict,
    load_full_optimizer_state,
    load_sharded_train_state,
    sharded_train_state,
)
from paravt.files import atomic_file, write_atomic
from paravt.log import get_logger

log = get_logger(__name__)

CKPT_DIR = "checkpoints"
STATE_FILE = "trainer_state.pt"
# The sharded training state's folder inside a checkpoint (torch.distributed.checkpoint), and
# the trainer_state.pt "format" that says it is there. Format 1 (no "format" key) held the
# full optimizer state and masters in trainer_state.pt itself.
TRAIN_STATE_DIR = "train_state"
SHARDED_FORMAT = 2
LATEST = "latest"
# Files of a source model directory that are not weights (copied so the checkpoint is a
# complete HF directory: tokenizer, chat template, processor configs).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json")


#: The run folder's identity (``run_id``: written once, when the folder's run is created)
#: and each checkpoint's record of it and of its files (``manifest.json``: the run id, the
#: step, every file's size and sha256, written at save; ``verify_checkpoint`` checks it).
RUN_ID_FILE = "run_id"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_STEP_NAME = re.compile(r"step_\d{6,}")


class CheckpointLoadError(RuntimeError):
    """A checkpoint (or the SFT state) that ``--resume`` refuses: damaged, not this run's, or
    holding code to run on load. The message is one line naming the step, the file and the
    newest intact checkpoint (``--resume train.resume_fallback=true`` continues from it)."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (disk full, quota, I/O error). The previous checkpoint
    is untouched; ``path`` is what failed, ``needed``/``free`` are bytes (estimate / free on the
    file system when the save gave up), ``cause`` the ``OSError``."""

    def __init__(
        self,
        message: str,
        *,
        path: str = "",
        needed: int = 0,
        free: int = -1,
        cause: OSError | None = None,
    ) -> None:
        super().__init__(message)
        self.path, self.needed, self.free, self.cause = path, needed, free, cause


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


# Headroom over the tensor bytes: safetensors/pickle headers, config and tokenizer JSON written
# by ``save_pretrained``, RNG states.
_SAVE_SLACK_BYTES = 1 << 20


def checkpoint_bytes(
    model_state: dict[str, torch.Tensor],
    trainer_state: dict[str, Any],
    source_dir: str | Path | None = None,
) -> int:
    """Estimated bytes of one checkpoint: every tensor of the weights and the trainer state
    (optimizer moments dominate: 2x the weights for Adam), the copied non-weight files of
    ``source_dir`` (twice: the tokenizer is saved again), plus 1 MiB of headers and JSON."""
    extra = 0
    if source_dir is not None and Path(source_dir).is_dir():
        extra = 2 * sum(
            f.stat().st_size
            for f in Path(source_dir).iterdir()
            if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES)
        )
    return _tensor_bytes(model_state) + _tensor_bytes(trainer_state) + extra + _SAVE_SLACK_BYTES


def _free_bytes(path: Path) -> int:
    try:
        return int(shutil.disk_usage(path).free)
    except OSError:
        return -1


def _save_error(
    step: int, root: Path, path: Path | str, needed: int, cause: OSError | None, prev: Path | None
) -> CheckpointSaveError:
    """``path``: what failed; the checkpoint's own directory is ``root/step_N``."""
    free = _free_bytes(root)
    if cause is None:
        problem = "not enough free space for it"
    else:
        code = errno.errorcode.get(cause.errno, cause.errno) if cause.errno else "?"
        problem = f"{cause.strerror or cause} ({code})"
    kept = (
        f"The previous checkpoint {prev} is intact and is what --resume loads."
        if prev is not None
        else "There is no earlier checkpoint of this run."
    )
    msg = (
        f"checkpoint step {step} ({root / step_dirname(step)}) could not be written: {path}: "
        f"{problem}. A checkpoint needs "
        f"about {needed / 2**20:.1f} MiB ({needed} bytes); {free} bytes are free on the file "
        f"system of {root}. {kept} Fix: free space there (or lower train.keep_last, or point "
        "train.out_dir at a larger disk) and rerun with --resume; or set "
        "train.on_save_error=continue to train on without checkpoints until one fits."
    )
    return CheckpointSaveError(msg, path=str(path), needed=needed, free=free, cause=cause)


def sft_save_error(
    out_dir: str | Path, state: dict[str, torch.Tensor], source_dir: str | Path, cause: OSError
) -> CheckpointSaveError:
    """The error for a cold-start SFT checkpoint that could not be written (``paravt.sft``)."""
    out = Path(out_dir)
    needed = checkpoint_bytes(state, {}, source_dir)
    free = _free_bytes(out.parent)
    msg = (
        f"the SFT checkpoint {out} could not be written: {cause.filename or out}: "
        f"{cause.strerror or cause}. It needs about {needed / 2**20:.1f} MiB ({needed} bytes); "
        f"{free} bytes are free on the file system of {out.parent}. Free space there (or point "
        "train.out_dir at a larger disk) and rerun; nothing half-written was left behind."
    )
    return CheckpointSaveError(
        msg, path=str(cause.filename or out), needed=needed, free=free, cause=cause
    )


def step_dirname(step: int) -> str:
    return f"step_{step:06d}"


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU, and CUDA when present) RNG states of this process."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _move_aside(path: Path) -> Path:
    """Rename ``path`` out of the ``step_*`` namespace (atomic); delete the result later."""
    aside = path.with_name(f".tmp-del-{path.name}")
    if aside.exists():
        shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)
    return aside


def save_model_dir(
    out: str | Path,
    model: torch.nn.Module,
    state_dict: dict[str, torch.Tensor],
    *,
    tokenizer: Any = None,
    source_dir: str | Path | None = None,
) -> Path:
    """Write ``state_dict`` as an HF model directory (safetensors) at ``out`` (not atomic),
    every file fsynced before it returns (``_fsync_files``).

    ``model`` supplies ``save_pretrained`` (config.json, tied-weight handling); a plain
    ``nn.Module`` gets ``model.safetensors`` only. ``source_dir``'s non-weight files
    (tokenizer, chat template, processor configs) are copied first so the result is complete.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if source_dir is not None and Path(source_dir).is_dir():
        for f in Path(source_dir).iterdir():
            if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name != STATE_FILE:
                shutil.copy2(f, out / f.name)
    state_dict = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
        _set_config_dtype(out / "config.json", state_dict)
    else:
        from safetensors.torch import save_file

        save_file(state_dict, str(out / "model.safetensors"))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    _fsync_files(out)
    return out


def _fsync_files(folder: Path) -> None:
    """Every regular file directly in ``folder`` synced to disk, then the folder's names: a
    checkpoint's export is renamed into place (and becomes ``latest``) only once it is on
    disk, not in the page cache that a crash loses (``save_model_dir``)."""
    for f in sorted(folder.iterdir()):
        if f.is_file() and not f.is_symlink():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(folder)


def _set_config_dtype(path: Path, state_dict: dict[str, torch.Tensor]) -> None:
    """Make ``config.json``'s dtype (and its sub-configs') that of the weights written: a
    float32 master module saving its bf16 cast would otherwise declare float32, and plain
    ``from_pretrained`` (dtype "auto") would load the bf16 file at twice its size."""
    import json

    dtypes = {v.dtype for v in state_dict.values() if v.is_floating_point()}
    if len(dtypes) != 1 or not path.is_file():
        return
    name = str(dtypes.pop()).removeprefix("torch.")
    cfg = json.loads(path.read_text())
    for d in (cfg, *(v for v in cfg.values() if isinstance(v, dict))):
        for key in ("dtype", "torch_dtype"):
            if key in d:
                d[key] = name
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _prepare(root: Path, step: int, needed: int, prev: Path | None) -> None:
    """Rank 0, before anything of checkpoint ``step`` is written: make ``root``, clear what
    killed saves left (``.tmp-*`` folders, a torn ``latest`` write), and refuse a save that the
    file system has no room for (``CheckpointSaveError``; nothing written)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _save_error(step, root, root, needed, e, prev) from e
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in root.glob(f".{LATEST}.*.tmp"):  # a pointer write killed mid-way (write_atomic)
        stale.unlink(missing_ok=True)
    free = _free_bytes(root)
    if 0 <= free < needed:  # fail before filling the disk that other writers (metrics) share
        raise _save_error(step, root, root / step_dirname(step), needed, None, prev)


def _write_files(
    tmp: Path,
    step: int,
    model: torch.nn.Module,
    model_state: dict[str, torch.Tensor],
    trainer_state: dict[str, Any],
    tokenizer: Any,
    source_dir: str | Path | None,
) -> None:
    """Rank 0: the HF export and ``trainer_state.pt`` into ``tmp``, synced to disk."""
    save_model_dir(tmp, model, model_state, tokenizer=tokenizer, source_dir=source_dir)
    _write_state(tmp, step, trainer_state)


def _write_state(tmp: Path, step: int, trainer_state: dict[str, Any]) -> None:
    """Rank 0: ``trainer_state.pt`` into ``tmp``, synced to disk with the folder's names."""
    with open(tmp / STATE_FILE, "wb") as f:
        torch.save({"step": int(step), **trainer_state}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)


def _commit(
    run_dir: str | Path, step: int, tmp: Path, needed: int, prev: Path | None, keep_last: int
) -> Path:
    """Rank 0: rename the complete ``tmp`` into place as ``step_N`` (a step saved before is
    moved aside first and put back if this fails), point ``latest`` at it, prune to the newest
    ``keep_last``. On an ``OSError`` everything is undone and ``CheckpointSaveError`` raised."""
    root = Path(run_dir) / CKPT_DIR
    name = step_dirname(step)
    final = root / name
    old: Path | None = None
    moved_in = False
    try:
        old = _move_aside(final) if final.exists() else None  # re-saving a step after a resume
        os.replace(tmp, final)
        moved_in = True
        _fsync_dir(root)
        write_atomic(root / LATEST, name)
    except OSError as e:
        # Undo: the new copy out of the step_* namespace, the replaced copy back in its place.
        if moved_in:
            shutil.rmtree(_move_aside(final), ignore_errors=True)
        if old is not None:
            os.replace(old, final)
        shutil.rmtree(tmp, ignore_errors=True)
        raise _save_error(step, root, e.filename or tmp, needed, e, prev) from e
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if keep_last > 0:
        for done in list_checkpoints(run_dir)[:-keep_last]:
            try:
                _prune(done)
            except OSError as e:  # the new checkpoint is complete: pruning is best effort
                log.warning("could not remove old checkpoint %s: %s", done, e)
    return final


class CheckpointGone(ConfigError):
    """The checkpoint folder a reader was about to pin was pruned first (``pin_checkpoint``)."""


_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


def _pin_file(folder: Path) -> Path:
    """The lock file of checkpoint ``folder``'s readers: beside it (``.pin-step_N``), never
    inside (a checkpoint's files are exactly its manifest's), a regular file opened for
    writing (NFS emulates ``flock`` with POSIX locks, which need that for ``LOCK_EX``)."""
    return folder.with_name(f".pin-{folder.name}")


@contextmanager
def pin_checkpoint(path: str | Path) -> Iterator[Path]:
    """Hold a reader's pin on checkpoint folder ``path`` for the block (``python -m
    paravt.eval`` holds one on the checkpoint it evaluates, for its whole run): the training
    run's ``keep_last`` pruning skips a pinned checkpoint (``_prune``: it is pruned at a later
    save, once free), so an evaluation of a live run never loses its files mid-load. The pin
    is a shared ``flock`` on ``_pin_file``; where it cannot be taken (no ``flock``, a
    read-only checkpoints folder, which no run prunes either) nothing is pinned and a warning
    says so. Raises ``CheckpointGone`` when ``path`` was pruned before the pin took hold (the
    caller resolves the newest checkpoint again)."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointGone(f"checkpoint {p} was pruned before it could be read")
    fd = None
    try:
        try:
            fd = os.open(_pin_file(p), os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_SH)
        except OSError as e:  # no flock, or a folder this reader cannot write
            log.warning(
                f"cannot pin {p} against pruning ({e.strerror}); if the run that writes it "
                "is live, keep train.keep_last large enough"
            )
        if not p.is_dir():  # pruned between resolving the path and the pin
            raise CheckpointGone(f"checkpoint {p} was pruned before it could be read")
        yield p
    finally:
        if fd is not None:
            os.close(fd)


def _pinned(pin: Path) -> bool:
    """Whether a reader holds ``pin`` (``pin_checkpoint``). Never creates it (a save killed
    mid-prune leaves no file behind); a pin that cannot be locked for another reason than a
    filesystem without ``flock`` counts as held (deleting what a reader may hold is worse
    than a full disk's clear error)."""
    try:
        fd = os.open(pin, os.O_RDWR)
    except FileNotFoundError:
        return False
    except OSError as e:
        log.warning(f"cannot check the pin {pin} ({e.strerror}): its checkpoint is kept")
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError as e:
        if e.errno not in _NO_FLOCK:
            log.warning(f"cannot lock the pin {pin} ({e.strerror}): its checkpoint is kept")
            return True
    finally:
        os.close(fd)
    return False


def _prune(done: Path) -> None:
    """Delete old checkpoint ``done`` unless a reader pins it (``pin_checkpoint``): then it is
    kept, said in the log, and pruned by a later save. A reader that pins it while it is
    moved aside finds it gone (``CheckpointGone``) or, pinned before the second check, gets it
    back in place."""
    pin = _pin_file(done)
    kept = f"kept {done}: a reader (an evaluation) has it open; pruned at a later save"
    if _pinned(pin):
        log.info(kept)
        return
    aside = _move_aside(done)
    if _pinned(pin):  # pinned while it moved
        os.replace(aside, done)
        log.info(kept)
        return
    shutil.rmtree(aside, ignore_errors=True)
    pin.unlink(missing_ok=True)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: torch.nn.Module,
    model_state: dict[str, torch.Tensor],
    trainer_state: dict[str, Any],
    tokenizer: Any = None,
    source_dir: str | Path | None = None,
    keep_last: int = 2,
) -> Path:
    """Atomically write checkpoint ``step`` under ``run_dir/checkpoints`` (call on rank 0 only):
    an HF export and a ``trainer_state.pt`` holding ``trainer_state``, nothing sharded (the
    trainer's checkpoints are ``save_trainer``'s; this one serves tools and tests that save a
    model folder with a small state).

    ``model_state`` is the *full* (unsharded) state dict to export. Keeps the newest
    ``keep_last`` checkpoints (0 = keep all). Returns the checkpoint directory.

    Raises ``CheckpointSaveError`` when the file system lacks the estimated room
    (``checkpoint_bytes``; nothing is written then) or any write fails; everything this call
    wrote is undone first, so the previous checkpoint stays the newest (module docstring).
    Pruning old checkpoints after a successful save never raises (it only logs).
    """
    root = Path(run_dir) / CKPT_DIR
    tmp = root / f".tmp-{step_dirname(step)}"
    needed = checkpoint_bytes(model_state, trainer_state, source_dir)
    prev = latest_checkpoint(run_dir)
    _prepare(root, step, needed, prev)
    try:
        _write_files(tmp, step, model, model_state, trainer_state, tokenizer, source_dir)
        _write_manifest(tmp, step, run_id(run_dir, create=True), {})
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _save_error(step, root, e.filename or tmp, needed, e, prev) from e
    return _commit(run_dir, step, tmp, needed, prev, keep_last)


def _group_up() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextmanager
def _quiet_single_process() -> Iterator[None]:
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
    whose writes failed) on failure. ``save_trainer``'s path."""
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True)
    with _quiet_single_process():
        dcp.save(state, storage_writer=writer, no_dist=not _group_up())


def load_sharded(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, masters: bool
) -> None:
    """Read the training state ``save_sharded`` wrote at ``path`` into ``model`` (the masters,
    when ``masters``) and ``optimizer``, on any world size: each rank reads the pieces of the
    files that overlap its own shards (``--resume``, through ``load_train_state``).
    Collective over the default process group (none: one process)."""
    import torch.distributed.checkpoint as dcp

    state = sharded_train_state(model, optimizer, masters=masters)
    reader = _checked_reader(path)  # no code runs from the files (the module docstring)
    with _quiet_single_process():
        dcp.load(
            state, storage_reader=reader, planner=_safe_load_planner(), no_dist=not _group_up()
        )
    load_sharded_train_state(model, optimizer, state)


def _write_shards(
    path: Path, sharded: dict[str, Any], ctx: DistContext
) -> tuple[tuple[int, str, str] | None, dict[str, Any]]:
    """Every rank writes its shards (``save_sharded``) and digests them (``_shard_digests``);
    the first failed rank's ``(errno, strerror, filename)``, the same on every rank, or None
    when every write succeeded, and every rank's digests (one gather). A failure that is not
    the file system's (a bug) raises, on every rank alike (DCP's). ``save_trainer``'s and
    ``save_sft_state``'s shard write."""
    from torch.distributed.checkpoint import CheckpointException

    err: OSError | None = None
    digests: dict[str, Any] = {}
    try:
        save_sharded(path, sharded)
        digests = _shard_digests(path, ctx.rank)
    except (OSError, CheckpointException) as e:
        err = _dcp_failure(e)
        if err is None:
            raise
    mine = None if err is None else (err.errno, err.strerror, err.filename)
    got = all_gather_objects((mine, digests), ctx)
    return next((x for x, _ in got if x is not None), None), {
        k: v for _, d in got for k, v in d.items()
    }


def _dcp_failure(e: BaseException) -> OSError | None:
    """The first ``OSError`` behind a failed DCP save (its own, or a rank's in the
    ``CheckpointException``'s failures), for the error's path and errno."""
    if isinstance(e, OSError):
        return e
    for exc, _ in getattr(e, "failures", {}).values():
        if isinstance(exc, OSError):
            return exc
    return None


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
    optim_empty = not optimizer.state  # as save_trainer: DCP would create the state
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
            failed, digests = _write_shards(tmp / TRAIN_STATE_DIR, sharded, ctx)
        finally:
            if optim_empty:
                optimizer.state.clear()
        bad = None if failed is None else str(OSError(*failed))
    if bad is None and ctx.is_main:
        try:
            with atomic_file(tmp / SFT_STATE_FILE) as f:
                torch.save({**small, "format": SHARDED_FORMAT, "optim_empty": optim_empty}, f)
            _fsync_dir(tmp / TRAIN_STATE_DIR)
            step = int(small.get("step", 0))
            _write_manifest(tmp, step, run_id(path.parent, create=True), digests)
            _fsync_dir(tmp)
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            if path.exists():
                os.replace(path, old)
            os.replace(tmp, path)
            _fsync_dir(path.parent)
            shutil.rmtree(old, ignore_errors=True)
        except OSError as e:
            err = e
    bad = bad or all_gather_objects(err and str(err), ctx)[0]
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
        problem, _ = _problem_of(where, run_id(run_dir), slice(None))
        target = where / SFT_STATE_FILE
    else:
        target = where
    if not problem:
        try:
            small = safe_torch_load(target)
        except Exception as e:  # noqa: BLE001 - a torn or planted file: torch raises many kinds
            problem = f"{target.name} cannot be read without running code or is torn ({_why(e)})"
    if not problem and where.is_dir():  # the shards' .metadata, before DCP reads it
        meta = where / TRAIN_STATE_DIR / ".metadata"
        try:
            read_dcp_metadata(meta)
        except Exception as e:  # noqa: BLE001
            problem = f"{TRAIN_STATE_DIR}/.metadata cannot be read safely ({_why(e)})"
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


def save_trainer(
    tr: Any,
    step: int,
    *,
    data: dict[str, int] | None = None,
    rng: Any = None,
    background: bool | None = None,
) -> bool:
    """Checkpoint the run ``tr`` (a ``paravt.trainer.Trainer``) at ``step``, on every rank:
    each rank writes its own shards of the masters (under mixed precision) and of the
    optimizer state (``save_sharded``), rank 0 the HF export (the compute-dtype weights,
    gathered one tensor at a time) and the small ``trainer_state.pt``
    (``load_train_state`` reads them back; layout in the module docstring).

    ``data`` / ``rng``: the prompt sampler's position and this rank's RNG states to record
    instead of the current ones (a preemption that abandoned step ``step + 1`` saves the state
    that step started from; the weights, optimizer and schedule are still step ``step``'s).

    ``background`` (None: ``train.async_save``): write the shards (and rank 0 the export) in
    a background thread and return once the state is copied (``AsyncSave``); the checkpoint
    is committed by ``finish_trainer_save``, which this call runs first for a save still in
    flight (one at a time). Returns True then when the write started (its outcome is the
    next ``finish_trainer_save``'s).

    A failed write (disk full ...) on any rank leaves the previous checkpoint the newest; then
    ``train.on_save_error`` decides: ``fail`` raises ``CheckpointSaveError`` on every rank
    (``main`` exits 1 with its message), ``continue`` prints it and returns False."""
    if background is None:
        background = bool(getattr(tr.cfg.train, "async_save", False))
    finish_trainer_save(tr)  # the save in flight, if any: committed before the next begins
    # An optimizer that has not stepped yet (every update so far skipped) has no state; DCP's
    # state dict creates it (a step at lr 0: step counts 1, zero moments), which would shift
    # the run's Adam bias correction by one. It is cleared again after the save (the
    # background write has its own copy by then), and the checkpoint says so
    # (``optim_empty``) for the resume to do the same.
    optim_empty = not tr.optimizer.state
    try:
        return _save_trainer(tr, step, data, rng, optim_empty, background)
    finally:
        if optim_empty:
            tr.optimizer.state.clear()


@dataclass
class AsyncSave:
    """A ``save_trainer(background=True)`` in flight (``tr.pending_save``): the shard write
    (DCP ``async_save``, every rank) and rank 0's export write, both into ``job.tmp``, that
    ``finish_trainer_save`` waits for and commits."""

    job: _SaveJob
    shards: Future[Any]
    export: Future[Any] | None  # rank 0's HF export (None elsewhere)
    started: float  # time.perf_counter() at the start


@dataclass
class _SaveJob:
    """What one ``save_trainer`` call writes and where (every rank; ``prev`` rank 0's)."""

    step: int
    run_dir: str
    root: Path
    tmp: Path
    needed: int
    prev: Path | None
    keep_last: int
    small: dict[str, Any] = field(repr=False)
    export: dict[str, torch.Tensor] = field(repr=False)


def _save_trainer(
    tr: Any, step: int, data: dict[str, int] | None, rng: Any, optim_empty: bool, background: bool
) -> bool:
    prec = Precision.from_config(tr.cfg)
    ctx = tr.ctx
    rngs = all_gather_objects(rng_state() if rng is None else rng, ctx)
    # Each rank's shards, nothing gathered: float32 masters under bf16 compute (so that
    # --resume continues from the exact masters, not from their bf16 cast) and AdamW's state.
    sharded = sharded_train_state(tr.policy, tr.optimizer, masters=prec.mixed)
    # The HF export holds the compute dtype (what plain transformers, vLLM and the eval load).
    export = gathered_state_dict(tr.policy, ctx, prec.compute)
    small = {
        "format": SHARDED_FORMAT,
        "train_state": {"dir": TRAIN_STATE_DIR, "masters": prec.mixed},
        "scheduler": tr.scheduler.state_dict(),
        "rng": rngs,
        "data": tr.sampler.state() if data is None else data,
        "world_size": ctx.world_size,
        "optim_empty": optim_empty,
    }
    run_dir, keep_last = tr.cfg.train.out_dir, tr.cfg.train.keep_last
    root = Path(run_dir) / CKPT_DIR
    tmp = root / f".tmp-{step_dirname(step)}"
    # DTensors count their global size: the estimate is the whole checkpoint's, all ranks'.
    needed = checkpoint_bytes(export, {**small, "sharded": sharded}, tr.init_dir)
    failed: CheckpointSaveError | None = None
    prev = latest_checkpoint(run_dir) if ctx.is_main else None
    if ctx.is_main:
        try:
            _prepare(root, step, needed, prev)
            try:
                (tmp / TRAIN_STATE_DIR).mkdir(parents=True)
            except OSError as e:
                raise _save_error(step, root, e.filename or tmp, needed, e, prev) from e
        except CheckpointSaveError as e:
            failed = e
    said = all_gather_objects("" if failed is None else str(failed), ctx)[0]
    if said:
        return _on_save_error(tr, said, failed)
    if background:
        # The background write gets a snapshot: the step after this one updates the live
        # tensors in place. The shards are copied as DCP stages them (``_CopyStager``); the
        # export's entries are new tensors already (gathered, cast) except where one is a live
        # tensor itself (no cast, one rank): copied.
        export = _detached(export, tr.policy)
        small = copy.deepcopy(small)
    job = _SaveJob(step, run_dir, root, tmp, needed, prev, keep_last, small, export)
    if background:
        tr.pending_save = _start_background(tr, job, sharded)
        return True
    # Every rank writes its shards into the folder rank 0 made.
    bad, digests = _write_shards(tmp / TRAIN_STATE_DIR, sharded, ctx)
    return _complete(tr, job, bad, digests, exported=False)


def _detached(export: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
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
    if not _group_up():
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


def _start_background(tr: Any, job: _SaveJob, sharded: dict[str, Any]) -> AsyncSave:
    """Every rank: stage this rank's shards (a CPU copy, in this thread) and write them in a
    DCP background thread; rank 0 also writes the HF export into ``job.tmp`` in a thread."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    started = time.perf_counter()
    writer = dcp.FileSystemWriter(
        str(job.tmp / TRAIN_STATE_DIR), single_file_per_rank=True, sync_files=True
    )
    group = _save_group()
    if group is None:  # DCP's one-process warning comes from the write's thread: not news
        warnings.filterwarnings("ignore", message=r".*assuming the intent is to")
    with _quiet_single_process():
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
    shards = pool.submit(_then_digest, shards, job.tmp / TRAIN_STATE_DIR, tr.ctx.rank)
    export = None
    if tr.ctx.is_main:
        export = pool.submit(
            _export_and_digest, job.tmp, tr.policy, job.export, tr.bundle.tokenizer, tr.init_dir
        )
    pool.shutdown(wait=False)
    job.export = {}  # the export thread holds it; nothing else needs it
    return AsyncSave(job, shards, export, started)


def background_save_written(tr: Any) -> bool:
    """Whether this rank's part of ``tr``'s background checkpoint write is finished (its shard
    write, and rank 0's export): the flag ``paravt.train.train_step`` adds to the step's one
    all-reduce (``StepStats``, ``save_written``). Summed to the world size, every rank's is,
    and the step commits the save (``finish_trainer_save``) at its end, without waiting for
    anything; False while none is in flight."""
    pending: AsyncSave | None = getattr(tr, "pending_save", None)
    if pending is None:
        return False
    return all(f is None or f.done() for f in (pending.shards, pending.export))


def _then_digest(shards: Future[Any], folder: Path, rank: int) -> dict[str, Any]:
    """The background shard write's outcome (raises as it did), then this rank's digests."""
    shards.result()
    return _shard_digests(folder, rank)


def _export_and_digest(
    tmp: Path, model: torch.nn.Module, export: dict[str, torch.Tensor], tok: Any, src: str
) -> dict[str, Any]:
    """Rank 0's background export (``save_model_dir``, fsynced), then its digests."""
    save_model_dir(tmp, model, export, tokenizer=tok, source_dir=src)
    return _top_digests(tmp)


def finish_trainer_save(tr: Any) -> tuple[int, bool] | None:
    """Wait for ``tr``'s background checkpoint write (``save_trainer(background=True)``) and
    commit it, on every rank: once every rank's shards and rank 0's export are written, rank 0
    writes ``trainer_state.pt`` and renames the folder into place (``latest``, ``keep_last``),
    as a synchronous save does. None when no save is in flight; else ``(step, ok)``.

    Called by the next ``save_trainer``, and by ``paravt.train`` before the run ends or
    stops (preemption, a lost rollout worker). A write that failed on any rank fails on every
    rank, naming the step: ``CheckpointSaveError`` (disk full, I/O: ``train.on_save_error``
    decides, as for a synchronous save; ``ok`` False under ``continue``) or a ``RuntimeError``
    (anything else). The previous checkpoint stays the newest either way."""
    from torch.distributed.checkpoint import CheckpointException

    pending: AsyncSave | None = getattr(tr, "pending_save", None)
    if pending is None:
        return None
    tr.pending_save = None
    job, ctx = pending.job, tr.ctx
    mine: tuple[Any, ...] | None = None
    digests: dict[str, Any] = {}
    for fut in (pending.shards, pending.export):
        if fut is None or mine is not None:
            continue
        try:
            digests.update(fut.result())
        # (DCP's CheckpointException is a BaseException.) Decided after the gather, the same
        # on every rank.
        except (Exception, CheckpointException) as e:
            err = _dcp_failure(e)
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
            f"checkpoint step {job.step} ({job.root / step_dirname(job.step)}): the background "
            f"write failed on rank {bug[0]}: {bug[1]}. Nothing of it was committed; the "
            "previous checkpoint is the newest. Fix: rerun with --resume (or set "
            "train.async_save=false to save in the foreground)"
        )
    bad = next((tuple(o[1:]) for o in outcomes if o), None)
    ok = _complete(tr, job, bad, {k: v for _, d in got for k, v in d.items()}, exported=True)
    if ok:
        tr.times["time/checkpoint_write"] = time.perf_counter() - pending.started
    return job.step, ok


def _complete(
    tr: Any,
    job: _SaveJob,
    bad: tuple[Any, ...] | None,
    digests: dict[str, Any],
    *,
    exported: bool,
) -> bool:
    """Every rank, after the shard write (``bad``: the first failed rank's ``(errno,
    strerror, filename)``; ``digests``: every rank's shard digests): rank 0 writes the export
    (unless ``exported``: the background did) and ``trainer_state.pt``, then the manifest,
    and commits; every rank learns the outcome."""
    ctx, step, root, tmp = tr.ctx, job.step, job.root, job.tmp
    failed: CheckpointSaveError | None = None
    if ctx.is_main:
        try:
            if bad is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                cause = OSError(bad[0], bad[1], bad[2])
                raise _save_error(step, root, bad[2] or tmp, job.needed, cause, job.prev)
            try:
                _fsync_dir(tmp / TRAIN_STATE_DIR)  # the shard files' names
                if exported:
                    _write_state(tmp, step, job.small)
                else:
                    model, tok = tr.policy, tr.bundle.tokenizer
                    _write_files(tmp, step, model, job.export, job.small, tok, tr.init_dir)
                _write_manifest(tmp, step, run_id(job.run_dir, create=True), digests)
            except OSError as e:
                shutil.rmtree(tmp, ignore_errors=True)
                raise _save_error(step, root, e.filename or tmp, job.needed, e, job.prev) from e
            _commit(job.run_dir, step, tmp, job.needed, job.prev, job.keep_last)
        except CheckpointSaveError as e:
            failed = e
    # Every rank learns rank 0's outcome (this is also the barrier after the save).
    said = all_gather_objects("" if failed is None else str(failed), ctx)[0]
    if not said:
        return True
    return _on_save_error(tr, said, failed)


def _on_save_error(tr: Any, said: str, failed: CheckpointSaveError | None) -> bool:
    """``train.on_save_error`` on a failed save (every rank): raise, or warn and go on."""
    if tr.cfg.train.on_save_error == "continue":
        if tr.ctx.is_main:
            log.warning(
                f"[train] warning: {said} Training goes on without it "
                "(train.on_save_error=continue)."
            )
        return False
    raise failed or CheckpointSaveError(said)


# ------------------------------------------------------------------- trust: identity, digests


def run_id(run_dir: str | Path, *, create: bool = False) -> str | None:
    """The run folder's identity: the random id in ``<run_dir>/run_id``, written once when
    the folder's run is created (``paravt.train``'s start, or the first save: ``create``).
    Every checkpoint's ``manifest.json`` records it; ``verify_checkpoint`` refuses one whose
    id is another's. None when the folder has none (a run of an older paravt)."""
    path = Path(run_dir) / RUN_ID_FILE
    try:
        text = path.read_text().strip() if path.is_file() and not path.is_symlink() else ""
    except (OSError, UnicodeDecodeError):
        text = ""
    if text or not create:
        return text or None
    new = secrets.token_hex(16)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    write_atomic(path, new + "\n")
    return new


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes, read in 4 MiB pieces (the manifest's per-file digest)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            h.update(chunk)
    return h.hexdigest()


def _digests(folder: Path, names: list[str]) -> dict[str, list[Any]]:
    """``{name: [size, sha256]}`` of ``folder/name`` for each name."""
    return {n: [(folder / n).stat().st_size, file_digest(folder / n)] for n in names}


def _shard_digests(folder: Path, rank: int) -> dict[str, list[Any]]:
    """This rank's shard files in ``folder`` (DCP's ``__<rank>_*.distcp``), keyed as the
    manifest names them (``train_state/__0_0.distcp``): each rank digests what it wrote, in
    parallel, while the bytes are still in its page cache."""
    names = sorted(f.name for f in folder.glob(f"__{rank}_*.distcp"))
    return {f"{folder.name}/{n}": v for n, v in _digests(folder, names).items()}


def _top_digests(folder: Path, skip: Any = ()) -> dict[str, list[Any]]:
    """Every regular file directly in ``folder`` but the manifest and ``skip`` (digested
    already: a background save's export, by its thread): rank 0's part of the manifest."""
    names = sorted(
        f.name for f in folder.iterdir() if f.is_file() and f.name not in {MANIFEST, *skip}
    )
    return _digests(folder, names)


def _write_manifest(folder: Path, step: int, rid: str | None, files: dict[str, Any]) -> None:
    """Rank 0, last before the rename into place: ``manifest.json`` (run id, step, every
    file's size and digest), synced. ``files`` holds every rank's shard digests already; the
    ``.metadata`` and the top-level files are digested here."""
    meta = folder / TRAIN_STATE_DIR / ".metadata"
    files = dict(files)
    if meta.is_file():
        files[f"{TRAIN_STATE_DIR}/.metadata"] = [meta.stat().st_size, file_digest(meta)]
    files.update(_top_digests(folder, skip=files))
    body = {"format": MANIFEST_FORMAT, "run_id": rid, "step": int(step), "files": files}
    with atomic_file(folder / MANIFEST) as f:
        f.write((json.dumps(body, indent=1, sort_keys=True) + "\n").encode())


# NumPy's array reconstruction (the RNG states' key arrays): data, no code. With it, a
# checkpoint's small state loads under ``weights_only=True``; anything else a pickle names
# (a planted ``os.system``) is refused by torch's weights-only unpickler.
_NP_CORE = getattr(np, "_core", None) or np.core  # numpy 2 renamed np.core (1.x has only it)
_NUMPY_SAFE = [_NP_CORE.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def safe_torch_load(path: str | Path, *, mmap: bool = False) -> Any:
    """``torch.load`` that runs no code: ``weights_only=True`` with NumPy arrays allowed
    (``trainer_state.pt``, the SFT's ``state.pt``). Raises what torch raises (an
    ``UnpicklingError`` for a pickle that names anything else, ``RuntimeError`` / ``EOFError``
    for a torn file); the callers turn it into one line."""
    with torch.serialization.safe_globals(_NUMPY_SAFE):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


#: What a DCP ``.metadata`` pickle may name: DCP's own records, ``torch.Size`` and dtypes,
#: the layout decoder, a path. ``_MetadataUnpickler`` refuses anything else before DCP reads
#: the file (``FileSystemReader.read_metadata`` is a plain ``pickle.load``).
_DCP_METADATA_NAMES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "Path"},
}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_METADATA_NAMES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (
            name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"names {module}.{name}, which no checkpoint's metadata holds (code to run on load)"
        )


def read_dcp_metadata(path: str | Path) -> Any:
    """A DCP ``.metadata`` file read through ``_MetadataUnpickler`` (DCP's records only)."""
    with open(path, "rb") as f:
        return _MetadataUnpickler(f).load()


def _checked_reader(path: str | Path) -> Any:
    """DCP's ``FileSystemReader`` whose metadata read is ``read_dcp_metadata`` (no code runs
    from a planted ``.metadata``). ``load_sharded`` and ``read_train_state`` read with it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            md = read_dcp_metadata(self._get_metadata_path(kwargs.get("rank")))
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return _Reader(str(path))


def _safe_load_planner(empty: bool = False) -> Any:
    """DCP's default load planner (``empty``: the one that builds the state dict from the
    metadata, ``read_train_state``'s) with its non-tensor items (AdamW's param groups) read by
    ``torch.load(weights_only=True)``, not ``weights_only=False`` as DCP's own does."""
    import io

    from torch.distributed.checkpoint.default_planner import (
        DefaultLoadPlanner,
        _EmptyStateDictLoadPlanner,
    )
    from torch.distributed.checkpoint.planner import ReadItem

    class _Planner(_EmptyStateDictLoadPlanner if empty else DefaultLoadPlanner):  # type: ignore[misc]
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            from torch.distributed.checkpoint._nested_dict import set_element

            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return _Planner()


def _problem_of(ckpt: Path, rid: str | None, mine: slice) -> tuple[str, bool]:
    """The first thing wrong with checkpoint folder ``ckpt`` against its manifest, checking
    the files of ``mine`` (this rank's share of the sorted manifest), or "" when nothing is;
    and whether the checkpoint has a manifest at all."""
    path = ckpt / MANIFEST
    if not path.is_file() or path.is_symlink():
        if rid is None:  # a run of an older paravt: its checkpoints carry no manifest
            return "", False
        return (
            f"{MANIFEST} is missing (every checkpoint of this run has one: the folder was "
            "altered, or copied in from elsewhere)",
            False,
        )
    try:
        man = json.loads(path.read_text())
        files = {str(k): (int(v[0]), str(v[1])) for k, v in man["files"].items()}
        their = man["run_id"]
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        return f"{MANIFEST} is damaged ({type(e).__name__}: {e})", True
    if their != rid:
        return (
            f"it belongs to another run (run id {their}; this run folder's {RUN_ID_FILE} is "
            f"{rid}): its files were copied in from another run folder",
            True,
        )
    present = {
        str(f.relative_to(ckpt)) for f in ckpt.rglob("*") if not f.is_dir() or f.is_symlink()
    }
    for name in sorted(present - files.keys() - {MANIFEST}):
        return (
            f"{name} is not one of the files this run wrote there (copied in from another "
            "run folder?)",
            True,
        )
    for name in sorted(files)[mine]:
        size, digest = files[name]
        f = ckpt / name
        if f.is_symlink() or (f.exists() and not f.is_file()):
            return f"{name} is not a regular file (a link or other node planted there)", True
        if not f.is_file():
            return f"{name} is missing", True
        got = f.stat().st_size
        if got != size:
            return f"{name} is {got} bytes, {size} were written (cut short or damaged)", True
        if file_digest(f) != digest:
            return (
                f"{name} does not match the digest written at save (damaged, or replaced by "
                "another run's file)",
                True,
            )
    return "", True


def verify_checkpoint(ckpt: str | Path, run_dir: str | Path, ctx: DistContext | None = None) -> str:
    """What is wrong with checkpoint ``ckpt`` of the run folder ``run_dir`` ("" when
    nothing): its manifest's run id against the folder's, every file present, regular, of
    the size and sha256 written at save, no file that the save did not write; then its
    ``trainer_state.pt`` read without running code (``safe_torch_load``) and its DCP
    ``.metadata`` through ``read_dcp_metadata``. On several ranks each digests its share of
    the files and the ranks agree (one gather). ``resume_checkpoint``'s check."""
    ckpt = Path(ckpt)
    rank, world = (ctx.rank, ctx.world_size) if ctx is not None else (0, 1)
    rid = run_id(run_dir)
    problem, _ = _problem_of(ckpt, rid, slice(rank, None, world))
    if ctx is not None and ctx.world_size > 1:
        problem = next((p for p in all_gather_objects(problem, ctx) if p), "")
    if problem:
        return problem
    state = ckpt / STATE_FILE
    try:
        small = safe_torch_load(state)
    except Exception as e:  # noqa: BLE001 - a torn or planted file: torch raises many kinds
        return f"{STATE_FILE} cannot be read without running code or is torn ({_why(e)})"
    if isinstance(small, dict) and isinstance(small.get("train_state"), dict):
        # Read through the checked unpickler before DCP touches it: a manifest rewritten to
        # match a planted .metadata is refused here, naming the file, not mid-load.
        if small["train_state"].get("dir") != TRAIN_STATE_DIR:
            return (
                f"{STATE_FILE} names its sharded state {small['train_state'].get('dir')!r}, "
                f"not {TRAIN_STATE_DIR!r} beside it"
            )
        try:
            read_dcp_metadata(ckpt / small["train_state"]["dir"] / ".metadata")
        except Exception as e:  # noqa: BLE001
            return f"{small['train_state']['dir']}/.metadata cannot be read safely ({_why(e)})"
    return ""


def _why(e: BaseException) -> str:
    """An exception's first line, short (torch's weights-only refusal is a page long)."""
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    if "Weights only load failed" in first or "weights_only" in first:
        names = re.findall(r"GLOBAL ([\w.]+)", str(e))
        first = f"it names {names[0]}, code that only a trusted file may run" if names else first
    return f"{type(e).__name__}: {first[:200]}"


def _step_of(ckpt: Path) -> int:
    return int(ckpt.name.split("_")[1])


def resume_checkpoint(
    run_dir: str | Path, ctx: DistContext | None = None, *, fallback: bool = False
) -> Path | None:
    """The checkpoint ``--resume`` continues from (``paravt.train.build_trainer``, every
    rank): ``latest`` if it names one of this run folder's own checkpoints and that one is
    intact (``verify_checkpoint``), else None when the run has none. A ``latest`` that
    points out of the run folder, or a checkpoint that is damaged or another run's, raises
    ``CheckpointLoadError``: one line naming the step, the file and the newest intact
    checkpoint, which ``fallback`` (``train.resume_fallback``) continues from instead."""
    root = Path(run_dir) / CKPT_DIR
    found = list_checkpoints(run_dir)
    pointer = root / LATEST
    target: Path | None = found[-1] if found else None
    problem = where = ""
    if pointer.exists() or pointer.is_symlink():
        try:
            name = pointer.read_text().strip() if pointer.is_file() else ""
        except (OSError, UnicodeDecodeError):
            name = ""
        if pointer.is_symlink() or not _STEP_NAME.fullmatch(name):
            where = f"{pointer}"
            problem = (
                f"names {name!r}, which is not a checkpoint of this run folder (a pointer "
                "must name a step_N folder beside it)"
            )
            target = None
        elif (root / name).is_symlink():
            where = f"{pointer}"
            problem = (
                f"names {name!r}, a link to {os.readlink(root / name)!r}, not a checkpoint "
                "folder of this run"
            )
            target = None
        elif (root / name) in found or (root / name).is_dir():
            # A folder without its trainer_state.pt is no complete checkpoint, but latest
            # naming it means it was one: damaged (verify names the file), not skipped.
            target = root / name
    if target is not None and not problem:
        problem = verify_checkpoint(target, run_dir, ctx)
        where = f"checkpoint step {_step_of(target)} ({target}): "
    if not problem:
        return target
    others = [c for c in reversed(found) if c != target]
    good = next((c for c in others if not verify_checkpoint(c, run_dir, ctx)), None)
    head = f"{where}{problem}" if target is not None else f"{where} {problem}"
    if good is not None and fallback:
        if ctx is None or ctx.is_main:
            log.warning(
                f"[train] warning: {head}; train.resume_fallback=true: resuming from the "
                f"newest intact checkpoint, step {_step_of(good)} ({good})"
            )
        return good
    if good is not None:
        offer = (
            f"The newest intact checkpoint is step {_step_of(good)} ({good}): rerun with "
            "--resume train.resume_fallback=true to continue from it, or restore the file"
        )
    else:
        offer = (
            "No other checkpoint of this run is intact: restore the file, or start the run "
            "again in a new train.out_dir"
        )
    raise CheckpointLoadError(f"--resume refused: {head}. {offer}")


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints under ``run_dir/checkpoints``, oldest first."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    dirs = [
        d
        for d in root.glob("step_*")
        if _STEP_NAME.fullmatch(d.name)
        and d.is_dir()
        and not d.is_symlink()  # a link to another run's folder is none of this run's
        and (d / STATE_FILE).is_file()
    ]
    return sorted(dirs, key=lambda d: int(d.name.split("_")[1]))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint ``latest`` points to, else the newest complete one, else None. Only a
    ``step_N`` folder of this run's ``checkpoints/`` is ever returned: a pointer naming
    anything else (``../../other/step_000004``, a link) is not followed (``--resume`` refuses
    it, naming it: ``resume_checkpoint``)."""
    root = Path(run_dir) / CKPT_DIR
    pointer = root / LATEST
    found = list_checkpoints(run_dir)
    if pointer.is_file() and not pointer.is_symlink():
        try:
            name = pointer.read_text().strip()
        except (OSError, UnicodeDecodeError):
            name = ""
        if _STEP_NAME.fullmatch(name) and root / name in found:
            return root / name
    return found[-1] if found else None


def load_trainer_state(ckpt_dir: str | Path) -> dict[str, Any]:
    """The ``trainer_state.pt`` of a checkpoint (``save_trainer``'s or ``save_checkpoint``'s):
    step, scheduler, sampler position, RNG states; in a format-1 checkpoint also the full
    optimizer state and masters (``load_train_state`` tells the formats apart)."""
    path = Path(ckpt_dir) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint '{ckpt_dir}' has no {STATE_FILE}; it is not a paravt training "
            "checkpoint (or was cut short) — pick another or start without --resume"
        )
    # mmap: a format-1 file's masters and AdamW's moments (16 bytes a parameter) are paged in
    # as they are copied into the model, not read into a second host copy first. No code runs
    # from the file (``safe_torch_load``: weights_only).
    return safe_torch_load(path, mmap=True)


def load_train_state(
    ckpt_dir: str | Path,
    state: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    ctx: DistContext,
) -> None:
    """``--resume`` (``paravt.train.build_trainer``, every rank, after ``shard_model`` and the
    optimizer): the optimizer state, and the masters if the checkpoint holds them, of the
    checkpoint ``ckpt_dir`` whose ``trainer_state.pt`` is ``state``, onto this run's world
    size, whatever the saving run's was.

    Sharded checkpoints (``format`` 2, ``save_trainer``'s): every rank reads its shards from
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
        storage_reader=_checked_reader(path),
        planner=_safe_load_planner(empty=True),
        no_dist=True,
    )
    res = {"optimizer": out["optim"]}
    if "model" in out:
        res["masters"] = out["model"]
    return res


def load_model_state(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """All safetensors tensors of a model directory (sharded or single file), on CPU."""
    from safetensors.torch import load_file

    files = sorted(Path(ckpt_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in '{ckpt_dir}'")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def resolve_model_path(cfg: Any, given: str) -> str:
    """``--model``, else ``model.path``, else the newest checkpoint of ``train.out_dir``
    (``python -m paravt.eval`` and ``python -m paravt.rollout``). A given training run folder
    (``runs/train/default``) means its newest checkpoint. Raises ``ConfigError`` when a given
    path is not a directory, is neither an HF model nor a run with checkpoints, or there is no
    checkpoint (the model is untrained)."""

    path = given or cfg.model.path
    if path:
        if not Path(path).is_dir():
            raise ConfigError(f"--model {path!r} is not a directory (an HF model or checkpoint)")
        if not (Path(path) / "config.json").is_file():
            ckpt = latest_checkpoint(path)
            if ckpt is None:
                raise ConfigError(
                    f"--model {path!r} has no config.json (not an HF model or checkpoint) and "
                    "no checkpoints/step_* (not a training run folder): pass a checkpoint "
                    "such as runs/train/default/checkpoints/step_000030, or its run folder"
                )
            return str(ckpt)
        return str(path)
    ckpt = latest_checkpoint(cfg.train.out_dir)
    if ckpt is None:
        raise ConfigError(
            f"no --model given and no checkpoint under {cfg.train.out_dir}/checkpoints: the "
            "model is untrained. Train one with `make train` (or python -m paravt.train), or "
            "pass --model PATH"
        )
    return str(ckpt)


def resolve_and_pin(cfg: Any, given: str, pins: ExitStack) -> str:
    """``resolve_model_path``, and where that is a run's checkpoint folder, a reader's pin on it
    held until ``pins`` closes (``pin_checkpoint``: the run's pruning skips it). A checkpoint
    pruned between the two is resolved again (a run folder's newest moved on)."""
    for _ in range(3):
        path = resolve_model_path(cfg, given)
        if Path(path).parent.name != CKPT_DIR:
            return path  # an HF model folder: no run prunes it
        try:
            pins.enter_context(pin_checkpoint(path))
            return path
        except CheckpointGone:
            continue
    raise ConfigError(
        f"the newest checkpoint of {given or cfg.train.out_dir} was pruned three times before "
        "it could be pinned (a run saving faster than it can be opened): pass a checkpoint "
        "folder, or raise the run's train.keep_last"
    )


def weights_fingerprint(model_dir: str | Path) -> str:
    """Identity of a model folder's files, cheap (no byte is read): sha256 over the name, size
    and modification time of each top-level file (weights, config.json, tokenizer; not a
    checkpoint's ``trainer_state.pt``). A checkpoint rewritten in place gets another one;
    so does a copy of the same weights (new times): a false alarm the message explains."""
    h = hashlib.sha256()
    for f in sorted(Path(model_dir).iterdir()):
        if f.name == STATE_FILE or f.name.startswith(".") or not f.is_file():
            continue
        st = f.stat()  # follows links (an HF cache's blobs)
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def run_config(model_path: str) -> Path | None:
    """The ``config.yaml`` of the training run a checkpoint ``<run>/checkpoints/step_N`` came
    from (its pixel budgets, prompts and caps are what the model learned with), or None."""
    p = Path(model_path).resolve()
    if p.parent.name == "checkpoints" and (p.parent.parent / "config.yaml").is_file():
        return p.parent.parent / "config.yaml"
    return None
