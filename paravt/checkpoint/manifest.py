"""A run folder's identity (``run_id``: written once, when the folder's run is created) and each
checkpoint's record of it and of its files (``manifest.json``: the run id, the step, every
file's size and sha256, written last before the commit by ``write_manifest``; each rank
digests its own shards, ``shard_digests``). ``trust.verify_checkpoint`` checks it.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from pathlib import Path
from typing import Any

from paravt.checkpoint.layout import MANIFEST, MANIFEST_FORMAT, RUN_ID_FILE, TRAIN_STATE_DIR
from paravt.files import atomic_file, write_atomic


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


def digests(folder: Path, names: list[str]) -> dict[str, list[Any]]:
    """``{name: [size, sha256]}`` of ``folder/name`` for each name."""
    return {n: [(folder / n).stat().st_size, file_digest(folder / n)] for n in names}


def shard_digests(folder: Path, rank: int) -> dict[str, list[Any]]:
    """This rank's shard files in ``folder`` (DCP's ``__<rank>_*.distcp``), keyed as the
    manifest names them (``train_state/__0_0.distcp``): each rank digests what it wrote, in
    parallel, while the bytes are still in its page cache."""
    names = sorted(f.name for f in folder.glob(f"__{rank}_*.distcp"))
    return {f"{folder.name}/{n}": v for n, v in digests(folder, names).items()}


def top_digests(folder: Path, skip: Any = ()) -> dict[str, list[Any]]:
    """Every regular file directly in ``folder`` but the manifest and ``skip`` (digested
    already: a background save's export, by its thread): rank 0's part of the manifest."""
    names = sorted(
        f.name for f in folder.iterdir() if f.is_file() and f.name not in {MANIFEST, *skip}
    )
    return digests(folder, names)


def write_manifest(folder: Path, step: int, rid: str | None, files: dict[str, Any]) -> None:
    """Rank 0, last before the rename into place: ``manifest.json`` (run id, step, every
    file's size and digest), synced. ``files`` holds every rank's shard digests already; the
    ``.metadata`` and the top-level files are digested here."""
    meta = folder / TRAIN_STATE_DIR / ".metadata"
    files = dict(files)
    if meta.is_file():
        files[f"{TRAIN_STATE_DIR}/.metadata"] = [meta.stat().st_size, file_digest(meta)]
    files.update(top_digests(folder, skip=files))
    body = {"format": MANIFEST_FORMAT, "run_id": rid, "step": int(step), "files": files}
    with atomic_file(folder / MANIFEST) as f:
        f.write((json.dumps(body, indent=1, sort_keys=True) + "\n").encode())
