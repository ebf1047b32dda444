"""The HF export of a checkpoint (and of the SFT's model folder), every file fsynced before the
folder is committed. One rank (``save_model_dir``): the compute-dtype weights gathered onto it
and written as ``model.safetensors`` with ``config.json`` and the source folder's tokenizer
files. Several ranks (issue 61 item 4: ``Checkpointer.save``): each entry is gathered onto one
owner rank (``paravt.distributed.spread_state_dict``: contiguous runs balanced by bytes) and
every rank writes its own file at once (``write_export_part``: HF's sharded names,
``model-00001-of-00008.safetensors``), rank 0 the index that names each entry's file and the
non-weight files (``write_export_meta``): the layout ``save_pretrained`` writes for a large
model, which transformers, vLLM and ``load_model_state`` read as they are (no consolidation
pass). Rank 0 no longer gathers and writes the whole model while the other ranks wait.
``load_model_state`` and ``weights_fingerprint`` read a model folder (tests, eval, run.json).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch

from paravt.checkpoint.layout import STATE_FILE, WEIGHT_SUFFIXES, fsync_dir
from paravt.checkpoint.manifest import digests
from paravt.distributed import DistContext, ExportSplit, gathered_state_dict, spread_state_dict

#: A spread export's index (HF's sharded layout): every entry's file, and the total bytes.
EXPORT_INDEX = "model.safetensors.index.json"


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
    _copy_source_files(out, source_dir)
    state_dict = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    if hasattr(model, "save_pretrained"):
        hf: Any = model  # a transformers model (``save_pretrained``)
        with os_errors(out):
            hf.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
        _set_config_dtype(out / "config.json", {v.dtype for v in state_dict.values()})
    else:
        from safetensors.torch import save_file

        with os_errors(out / "model.safetensors"):
            save_file(state_dict, str(out / "model.safetensors"))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    _fsync_files(out)
    return out


@contextlib.contextmanager
def os_errors(path: Path) -> Iterator[None]:
    """safetensors' writer (Rust) reports a failed write (a full disk, an I/O error) as a
    ``SafetensorError`` ("... (os error 28)"), not an ``OSError``: turned into the
    ``OSError`` (its errno, ``path``) that a save's error path reports (``CheckpointSaveError``,
    ``train.on_save_error``) instead of treating it as a bug."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as e:
        m = re.search(r"os error (\d+)", str(e))
        if m is None:
            raise
        code = int(m.group(1))
        raise OSError(code, os.strerror(code), str(path)) from e


def _copy_source_files(out: Path, source_dir: str | Path | None) -> None:
    """``out`` made, and ``source_dir``'s non-weight files (tokenizer, chat template,
    processor configs) copied into it."""
    out.mkdir(parents=True, exist_ok=True)
    if source_dir is not None and Path(source_dir).is_dir():
        for f in Path(source_dir).iterdir():
            if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and f.name != STATE_FILE:
                shutil.copy2(f, out / f.name)


def gather_export(
    model: torch.nn.Module, ctx: DistContext, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], ExportSplit | None]:
    """A save's export in ``dtype`` (every rank calls it: each entry is a collective): on one
    rank the whole state dict and None; on several this rank's part and the split (each rank
    writes its own file, ``write_export_part``)."""
    if ctx.world_size > 1:
        return spread_state_dict(model, ctx, dtype)
    return gathered_state_dict(model, ctx, dtype), None


def part_files(split: ExportSplit) -> dict[int, str]:
    """Each writing rank's file of a spread export, HF's sharded names
    (``model-00001-of-00004.safetensors``); a rank that owns no entry writes none."""
    ranks = sorted(set(split.owners.values()))
    return {r: f"model-{i + 1:05d}-of-{len(ranks):05d}.safetensors" for i, r in enumerate(ranks)}


def write_export_part(
    out: Path, part: dict[str, torch.Tensor], split: ExportSplit, rank: int
) -> dict[str, list[Any]]:
    """Rank ``rank``'s file of a spread export: ``part``, the entries ``spread_state_dict``
    gathered onto it, fsynced (every rank of a ``Checkpointer.save``, in parallel). Its
    manifest digests ({} when the rank owns no entry)."""
    from safetensors.torch import save_file

    name = part_files(split).get(rank)
    if name is None:
        return {}
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in part.items()}
    with os_errors(out / name):
        save_file(tensors, str(out / name), metadata={"format": "pt"})
    _fsync_files(out, [name])
    return digests(out, [name])


def write_export_rank0(
    out: Path,
    model: torch.nn.Module,
    export: dict[str, torch.Tensor],
    split: ExportSplit | None,
    tokenizer: Any,
    source_dir: str | Path | None,
) -> None:
    """Rank 0's share of a save's export besides its part: the whole export on one rank
    (``save_model_dir``), the index and non-weight files on several (``write_export_meta``)."""
    if split is None:
        save_model_dir(out, model, export, tokenizer=tokenizer, source_dir=source_dir)
    else:
        write_export_meta(out, model, split, tokenizer=tokenizer, source_dir=source_dir)


def write_export_meta(
    out: Path,
    model: torch.nn.Module,
    split: ExportSplit,
    *,
    tokenizer: Any = None,
    source_dir: str | Path | None = None,
) -> None:
    """Rank 0's share of a spread export besides its part: ``source_dir``'s non-weight files,
    the model's ``config.json`` (its dtype that of the weights, ``split.dtypes``) and generation
    config as ``save_pretrained`` writes them, the tokenizer, and the index naming every
    entry's file (``EXPORT_INDEX``); fsynced."""
    _copy_source_files(out, source_dir)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.architectures = [type(model).__name__]  # as save_pretrained sets it
        config.save_pretrained(out)
        _set_config_dtype(out / "config.json", set(split.dtypes))
        can_generate = getattr(model, "can_generate", lambda: False)
        if can_generate() and getattr(model, "generation_config", None) is not None:
            cast(Any, model).generation_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    files = part_files(split)
    index = {
        "metadata": {"total_size": sum(split.nbytes.values())},
        "weight_map": {k: files[r] for k, r in split.owners.items()},
    }
    (out / EXPORT_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    parts = set(files.values())  # each rank syncs its own (``write_export_part``)
    _fsync_files(out, sorted(f.name for f in out.iterdir() if f.name not in parts))


def _fsync_files(folder: Path, names: list[str] | None = None) -> None:
    """Every regular file directly in ``folder`` (or the ``names`` this rank wrote: a spread
    export's other files are their ranks') synced to disk, then the folder's names: a
    checkpoint's export is renamed into place (and becomes ``latest``) only once it is on
    disk, not in the page cache that a crash loses (``save_model_dir``)."""
    files = [folder / n for n in names] if names is not None else sorted(folder.iterdir())
    for f in files:
        if f.is_file() and not f.is_symlink():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(folder)


def _set_config_dtype(path: Path, dtypes: set[torch.dtype]) -> None:
    """Make ``config.json``'s dtype (and its sub-configs') that of the weights written: a
    float32 master module saving its bf16 cast would otherwise declare float32, and plain
    ``from_pretrained`` (dtype "auto") would load the bf16 file at twice its size."""

    floats = {d for d in dtypes if d.is_floating_point}
    if len(floats) != 1 or not path.is_file():
        return
    name = str(floats.pop()).removeprefix("torch.")
    cfg = json.loads(path.read_text())
    for d in (cfg, *(v for v in cfg.values() if isinstance(v, dict))):
        for key in ("dtype", "torch_dtype"):
            if key in d:
                d[key] = name
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


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
