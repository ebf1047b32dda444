"""The HF export of a checkpoint (and of the SFT's model folder): ``save_model_dir`` writes the
compute-dtype weights as one ``model.safetensors`` with ``config.json`` and the source folder's
tokenizer files, every file fsynced before the folder is committed. Gathered onto rank 0 and
written by it alone (in a thread under ``train.async_save``: ``background``). The installed
torch has DCP's ``HuggingFaceStorageWriter`` (every rank writing its part of the
safetensors), not used yet: the export is what ``--resume``'s model load, eval and vLLM read
as one file, and that writer's per-rank files need a consolidation pass (and a reader of the
sharded form) that is not written; issue 61 item 4's other half, left open.
``load_model_state`` and ``weights_fingerprint`` read a model folder (tests, eval, run.json).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from paravt.checkpoint.layout import STATE_FILE, WEIGHT_SUFFIXES, fsync_dir


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
            if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and f.name != STATE_FILE:
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
    fsync_dir(folder)


def _set_config_dtype(path: Path, state_dict: dict[str, torch.Tensor]) -> None:
    """Make ``config.json``'s dtype (and its sub-configs') that of the weights written: a
    float32 master module saving its bf16 cast would otherwise declare float32, and plain
    ``from_pretrained`` (dtype "auto") would load the bf16 file at twice its size."""

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
