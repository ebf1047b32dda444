"""Which model folder a command reads: ``resolve_model_path`` (``--model``, ``model.path`` or
the newest checkpoint of a run), ``resolve_and_pin`` (with a reader's pin on it:
``python -m paravt.eval``), ``run_config`` (the training run's ``config.yaml`` beside it).
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

from paravt.checkpoint.commit import pin_checkpoint
from paravt.checkpoint.layout import CKPT_DIR, CheckpointGone, latest_checkpoint
from paravt.config import ConfigError


def resolve_model_path(cfg: Any, given: str) -> str:
    """``--model``, else ``model.path``, else the newest checkpoint of ``train.out_dir``
    (``python -m paravt.eval`` and ``python -m paravt.episodes``). A given training run folder
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


def run_config(model_path: str) -> Path | None:
    """The ``config.yaml`` of the training run a checkpoint ``<run>/checkpoints/step_N`` came
    from (its pixel budgets, prompts and caps are what the model learned with), or None."""
    p = Path(model_path).resolve()
    if p.parent.name == "checkpoints" and (p.parent.parent / "config.yaml").is_file():
        return p.parent.parent / "config.yaml"
    return None
