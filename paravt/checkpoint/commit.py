"""Atomic commit, prune and pin (rank 0): the paths every save ends on.

A checkpoint is written into ``.tmp-step_000004`` (every rank's shards first, then rank 0's
export and ``trainer_state.pt``) and renamed into place by rank 0 with one ``os.replace``
(atomic on POSIX within a file system) once every rank's writes are synced (``commit_folder``),
then ``latest`` is rewritten the same way. A process killed at any instant leaves either the
previous complete checkpoint or the new complete one, never a torn one; stale ``.tmp-*``
directories are removed on the next save (``prepare_save``). Deleting is the mirror image: an old
checkpoint (pruned by ``keep_last``, or replaced when a resumed run saves a step again) is
first renamed to ``.tmp-del-*`` and only then removed, so a ``step_*`` directory is complete
whenever it exists (``tests/test_checkpoint_kill.py`` kills a saving process at each of these
points). The one window left: re-saving an existing step renames the old copy aside and the
new one in with two renames; a kill between them leaves ``latest`` naming a missing
directory, and ``latest_checkpoint`` falls back to the newest complete one. A reader's pin
(``pin_checkpoint``: ``python -m paravt.eval``) keeps ``_prune`` off a checkpoint it reads.
``save_checkpoint`` is the one-process save of a model folder with a small state (tools,
tests); the trainer's is ``Checkpointer.save``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from paravt.checkpoint.export import save_model_dir
from paravt.checkpoint.layout import (
    CKPT_DIR,
    LATEST,
    CheckpointGone,
    checkpoint_bytes,
    free_bytes,
    fsync_dir,
    latest_checkpoint,
    list_checkpoints,
    move_aside,
    save_error,
    step_dirname,
)
from paravt.checkpoint.manifest import run_id, write_manifest
from paravt.checkpoint.small import write_state
from paravt.files import write_atomic
from paravt.log import get_logger

log = get_logger("paravt.checkpoint")  # the package's one logger (its name before the split)


def prepare_save(root: Path, step: int, needed: int, prev: Path | None) -> None:
    """Rank 0, before anything of checkpoint ``step`` is written: make ``root``, clear what
    killed saves left (``.tmp-*`` folders, a torn ``latest`` write), and refuse a save that the
    file system has no room for (``CheckpointSaveError``; nothing written)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise save_error(step, root, root, needed, e, prev) from e
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in root.glob(f".{LATEST}.*.tmp"):  # a pointer write killed mid-way (write_atomic)
        stale.unlink(missing_ok=True)
    free = free_bytes(root)
    if 0 <= free < needed:  # fail before filling the disk that other writers (metrics) share
        raise save_error(step, root, root / step_dirname(step), needed, None, prev)


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
    write_state(tmp, step, trainer_state)


def commit_folder(
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
        old = move_aside(final) if final.exists() else None  # re-saving a step after a resume
        os.replace(tmp, final)
        moved_in = True
        fsync_dir(root)
        write_atomic(root / LATEST, name)
    except OSError as e:
        # Undo: the new copy out of the step_* namespace, the replaced copy back in its place.
        if moved_in:
            shutil.rmtree(move_aside(final), ignore_errors=True)
        if old is not None:
            os.replace(old, final)
        shutil.rmtree(tmp, ignore_errors=True)
        raise save_error(step, root, e.filename or tmp, needed, e, prev) from e
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if keep_last > 0:
        for done in list_checkpoints(run_dir)[:-keep_last]:
            try:
                _prune(done)
            except OSError as e:  # the new checkpoint is complete: pruning is best effort
                log.warning("could not remove old checkpoint %s: %s", done, e)
    return final


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
    aside = move_aside(done)
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
    trainer's checkpoints are ``Checkpointer.save``'s; this one serves tools and tests that save a
    model folder with a small state).

    ``model_state`` is the *full* (unsharded) state dict to export. Keeps the newest
    ``keep_last`` checkpoints (0 = keep all). Returns the checkpoint directory.

    Raises ``CheckpointSaveError`` when the file system lacks the estimated room
    (``checkpoint_bytes``; nothing is written then) or any write fails; everything this call
    wrote is undone first, so the previous checkpoint stays the newest (``commit`` and ``layout``'s docstrings).
    Pruning old checkpoints after a successful save never raises (it only logs).
    """
    root = Path(run_dir) / CKPT_DIR
    tmp = root / f".tmp-{step_dirname(step)}"
    needed = checkpoint_bytes(model_state, trainer_state, source_dir)
    prev = latest_checkpoint(run_dir)
    prepare_save(root, step, needed, prev)
    try:
        _write_files(tmp, step, model, model_state, trainer_state, tokenizer, source_dir)
        write_manifest(tmp, step, run_id(run_dir, create=True), {})
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise save_error(step, root, e.filename or tmp, needed, e, prev) from e
    return commit_folder(run_dir, step, tmp, needed, prev, keep_last)
