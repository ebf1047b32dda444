"""The small file of a checkpoint, ``trainer_state.pt`` (rank 0): written by
``Checkpointer`` (``write_state``), read without running code (``safe_torch_load``:
``weights_only=True``, NumPy's array records allowed for the RNG states) by ``--resume``
(``load_trainer_state``) and ``trust.verify_checkpoint``. What it holds besides the layout's
flags is the trainer's one schema (``paravt.trainer.Trainer.state_dict``); ``rng_state`` /
``set_rng_state`` are the RNG part of it.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paravt.checkpoint.layout import STATE_FILE, fsync_dir

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


def write_state(tmp: Path, step: int, trainer_state: dict[str, Any]) -> None:
    """Rank 0: ``trainer_state.pt`` into ``tmp``, synced to disk with the folder's names."""
    with open(tmp / STATE_FILE, "wb") as f:
        torch.save({"step": int(step), **trainer_state}, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)


def load_trainer_state(ckpt_dir: str | Path) -> dict[str, Any]:
    """The ``trainer_state.pt`` of a checkpoint (``Checkpointer.save``'s or ``save_checkpoint``'s):
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
