"""The run's inputs on disk: the dataset and the model directory, and the validated samples.

``prepare_assets`` is what every command that trains starts from (``paravt.train``,
``paravt.sft``, ``paravt.experiments``): the synthetic task and the tiny
model are built on rank 0 when the config names no dataset / model of its own, and the other
ranks wait. It sits below all of them, so none imports another's CLI for it.
"""

from __future__ import annotations

from typing import Any

from paravt.config import Config
from paravt.data.readers import DatasetError, has_split, load_samples
from paravt.data.synth import generate_from_config
from paravt.distributed import barrier
from paravt.models.tiny import (
    build_random_checkpoint,
    build_tiny_checkpoint,
    model_dir_of,
    tiny_checkpoint_args,
)
from paravt.types import Sample


def prepare_data(cfg: Config, ctx: Any) -> str:
    """Dataset directory; the synthetic task is generated on rank 0 if absent (others wait)."""
    data_dir = cfg.data.path or cfg.data.synth_dir
    if ctx.is_main and not cfg.data.path:
        generate_from_config(cfg, data_dir)
    barrier(ctx)
    return data_dir


def prepare_model(cfg: Config, ctx: Any) -> str:
    """Model directory; the tiny model (or, ``model.init=random``, ``model.config``'s
    architecture with random weights) is built on rank 0 if absent (others wait)."""
    if cfg.model.init == "random":
        model_dir = model_dir_of(cfg)
        if ctx.is_main:
            build_random_checkpoint(
                model_dir, cfg.model.config, seed=cfg.train.seed, dtype=cfg.model.dtype
            )
        barrier(ctx)
        return model_dir
    tiny_dir, head_dim = tiny_checkpoint_args(cfg)
    model_dir = cfg.model.path or tiny_dir
    if ctx.is_main and not cfg.model.path:
        build_tiny_checkpoint(
            model_dir, seed=cfg.train.seed, vocab=cfg.model.tiny_vocab, head_dim=head_dim
        )
    barrier(ctx)
    return model_dir


def prepare_assets(cfg: Config, ctx: Any) -> tuple[str, str]:
    """Dataset directory and model directory (``prepare_data``, ``prepare_model``)."""
    return prepare_data(cfg, ctx), prepare_model(cfg, ctx)


def read_datasets(cfg: Config, data_dir: str) -> tuple[list[Sample], list[Sample]]:
    """Training and validation samples, every row validated (``DatasetError`` names the file,
    the row and the field). The trainer calls it before any model is built or loaded, so a
    bad row costs a second, not a checkpoint load. An absent val split falls back to the
    train prompts; a bad one raises. Validation keeps ``train.eval_prompts`` prompts."""
    root = cfg.data.video_root
    train = load_samples(data_dir, video_root=root, split="train", max_samples=cfg.data.max_samples)
    val = load_samples(data_dir, video_root=root, split="val") if has_split(data_dir, "val") else []
    if not train:
        raise DatasetError(
            f"{data_dir}: no usable training row (the split is empty, or every row's video is "
            "missing: see the warning above); check data.path and data.video_root"
        )
    return train, (val or train)[: cfg.train.eval_prompts]
