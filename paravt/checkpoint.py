"""Checkpoints: HF-format safetensors weights + everything needed to resume a killed run.

Layout (one directory per saved step, under ``<out_dir>/checkpoints``)::

    step_000004/
      config.json, model.safetensors, tokenizer files ...   ← ``from_pretrained``-loadable
      trainer_state.pt                                      ← optimizer, scheduler, RNG, data
    latest                                                  ← text file: "step_000004"

Atomicity: a checkpoint is written into ``.tmp-step_000004`` and renamed into place with one
``os.replace`` (atomic on POSIX within a file system), then ``latest`` is rewritten the same way.
A process killed at any instant leaves either the previous complete checkpoint or the new
complete one, never a torn one; stale ``.tmp-*`` directories are removed on the next save.
Deleting is the mirror image: an old checkpoint (pruned by ``keep_last``, or replaced when a
resumed run saves a step again) is first renamed to ``.tmp-del-*`` and only then removed, so a
``step_*`` directory is complete whenever it exists (``tests/test_checkpoint_kill.py`` kills a
saving process at each of these points). The one window left: re-saving an existing step
renames the old copy aside and the new one in with two renames; a kill between them leaves
``latest`` naming a missing directory, and ``latest_checkpoint`` falls back to the newest
complete one.

``trainer_state.pt`` is a ``torch.save`` pickle written by this module and read back with
``weights_only=False`` (it holds Python/NumPy RNG states); only load checkpoints you wrote.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

CKPT_DIR = "checkpoints"
STATE_FILE = "trainer_state.pt"
LATEST = "latest"
# Files of a source model directory that are not weights (copied so the checkpoint is a
# complete HF directory: tokenizer, chat template, processor configs).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json")


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


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
    """Write ``state_dict`` as an HF model directory (safetensors) at ``out`` (not atomic).

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
    else:
        from safetensors.torch import save_file

        save_file(state_dict, str(out / "model.safetensors"))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


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
    """Atomically write checkpoint ``step`` under ``run_dir/checkpoints`` (call on rank 0 only).

    ``model_state`` is the *full* (unsharded) state dict (``paravt.distributed.full_state_dict``).
    ``trainer_state`` holds whatever resume needs: optimizer/scheduler state dicts, RNG states,
    data-loader position, the step. Keeps the newest ``keep_last`` checkpoints (0 = keep all).
    Returns the checkpoint directory.
    """
    root = Path(run_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    name = step_dirname(step)
    tmp = root / f".tmp-{name}"
    save_model_dir(tmp, model, model_state, tokenizer=tokenizer, source_dir=source_dir)
    with open(tmp / STATE_FILE, "wb") as f:
        torch.save({"step": int(step), **trainer_state}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    final = root / name
    old = _move_aside(final) if final.exists() else None  # re-saving a step after a resume
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(root)
    _write_text_atomic(root / LATEST, name)
    if keep_last > 0:
        for prev in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(_move_aside(prev), ignore_errors=True)
    return final


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints under ``run_dir/checkpoints``, oldest first."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    dirs = [d for d in root.glob("step_*") if d.is_dir() and (d / STATE_FILE).is_file()]
    return sorted(dirs, key=lambda d: int(d.name.split("_")[1]))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint ``latest`` points to, else the newest complete one, else None."""
    root = Path(run_dir) / CKPT_DIR
    pointer = root / LATEST
    if pointer.is_file():
        cand = root / pointer.read_text().strip()
        if (cand / STATE_FILE).is_file():
            return cand
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def load_trainer_state(ckpt_dir: str | Path) -> dict[str, Any]:
    """The ``trainer_state.pt`` of a checkpoint written by ``save_checkpoint``."""
    path = Path(ckpt_dir) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint '{ckpt_dir}' has no {STATE_FILE}; it is not a paravt training "
            "checkpoint (or was cut short) — pick another or start without --resume"
        )
    return torch.load(path, map_location="cpu", weights_only=False)


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
    from paravt.config import ConfigError

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


def run_config(model_path: str) -> Path | None:
    """The ``config.yaml`` of the training run a checkpoint ``<run>/checkpoints/step_N`` came
    from (its pixel budgets, prompts and caps are what the model learned with), or None."""
    p = Path(model_path).resolve()
    if p.parent.name == "checkpoints" and (p.parent.parent / "config.yaml").is_file():
        return p.parent.parent / "config.yaml"
    return None
