"""Trust (``resume_checkpoint``, ``--resume``'s pick, before anything loads): ``latest`` must
name a ``step_N`` folder beside it (no path, no link); the checkpoint's ``manifest.json`` must
carry this run folder's ``run_id`` and list exactly its files, each of the size and sha256
written at save; ``trainer_state.pt`` (and the SFT's ``state.pt``) are read with
``torch.load(weights_only=True)`` (``small.safe_torch_load``), DCP's ``.metadata`` through
``safe_load.read_dcp_metadata`` and its non-tensor items with ``weights_only=True``: no code in
a checkpoint runs. Anything wrong is one ``CheckpointLoadError`` line naming the step, the file
and the newest intact checkpoint, which ``train.resume_fallback`` continues from
(``tests/test_checkpoint_trust.py``). A checkpoint of an older paravt (no manifest, no
``run_id``) resumes without the digests.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from paravt.checkpoint.layout import (
    CKPT_DIR,
    LATEST,
    MANIFEST,
    RUN_ID_FILE,
    STATE_FILE,
    STEP_NAME,
    TRAIN_STATE_DIR,
    CheckpointLoadError,
    list_checkpoints,
    step_of,
)
from paravt.checkpoint.manifest import file_digest, run_id
from paravt.checkpoint.safe_load import read_dcp_metadata, short_reason
from paravt.checkpoint.small import safe_torch_load
from paravt.distributed import (
    DistContext,
    all_gather_objects,
)
from paravt.log import get_logger

log = get_logger("paravt.checkpoint")  # the package's one logger (its name before the split)


def problem_of(ckpt: Path, rid: str | None, mine: slice) -> tuple[str, bool]:
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
    problem, _ = problem_of(ckpt, rid, slice(rank, None, world))
    if ctx is not None and ctx.world_size > 1:
        problem = next((p for p in all_gather_objects(problem, ctx) if p), "")
    if problem:
        return problem
    state = ckpt / STATE_FILE
    try:
        small = safe_torch_load(state)
    except Exception as e:  # noqa: BLE001 - a torn or planted file: torch raises many kinds
        return f"{STATE_FILE} cannot be read without running code or is torn ({short_reason(e)})"
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
            return (
                f"{small['train_state']['dir']}/.metadata cannot be read safely ({short_reason(e)})"
            )
    return ""


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
        if pointer.is_symlink() or not STEP_NAME.fullmatch(name):
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
        where = f"checkpoint step {step_of(target)} ({target}): "
    if not problem:
        return target
    others = [c for c in reversed(found) if c != target]
    good = next((c for c in others if not verify_checkpoint(c, run_dir, ctx)), None)
    head = f"{where}{problem}" if target is not None else f"{where} {problem}"
    if good is not None and fallback:
        if ctx is None or ctx.is_main:
            log.warning(
                f"[train] warning: {head}; train.resume_fallback=true: resuming from the "
                f"newest intact checkpoint, step {step_of(good)} ({good})"
            )
        return good
    if good is not None:
        offer = (
            f"The newest intact checkpoint is step {step_of(good)} ({good}): rerun with "
            "--resume train.resume_fallback=true to continue from it, or restore the file"
        )
    else:
        offer = (
            "No other checkpoint of this run is intact: restore the file, or start the run "
            "again in a new train.out_dir"
        )
    raise CheckpointLoadError(f"--resume refused: {head}. {offer}")
