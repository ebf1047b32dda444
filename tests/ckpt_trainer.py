"""A real ``paravt.trainer.Trainer`` around only what a checkpoint reads (the policy, its
optimizer and schedule, a rollout source that reports a fixed data position), with its
``Checkpointer``: what the checkpoint tests save and load without building a run. Not a test
module: tests import it by name, as pytest puts ``tests/`` on ``sys.path`` (the torchrun
scripts of ``test_checkpoint_sharded`` put it there themselves)."""

from __future__ import annotations

import types
from typing import Any

import torch

from paravt.checkpoint import Checkpointer
from paravt.distributed import DistContext
from paravt.trainer import Trainer


class FixedSource:
    """A rollout source whose data position is ``data`` at every step; what a resume loads
    into it is kept in ``loaded`` (``(state, step)``)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data, self.loaded = dict(data), None

    def data_state(self, done: int) -> dict[str, Any]:
        return dict(self.data)

    def load_data_state(self, state: dict[str, Any], start_step: int) -> None:
        self.loaded = (state, start_step)


def small_trainer(
    cfg: Any,
    ctx: DistContext,
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    data: dict[str, Any] | None = None,
) -> Trainer:
    """``cfg``: a namespace with ``train`` (``out_dir``, ``keep_last``, ``on_save_error``,
    ``master_dtype``, optionally ``async_save``) and ``model.dtype``, as ``Config``'s."""
    tr = Trainer(
        cfg=cfg, ctx=ctx, policy=policy, bundle=types.SimpleNamespace(tokenizer=None),
        engine=None, runner=None, reference=None, objective=None, optimizer=optimizer,
        scheduler=scheduler, source=FixedSource(data or {"pos": 7}), val_samples=[],
        logger=None, init_dir=None, video_meta=None,
    )  # fmt: skip
    tr.checkpointer = Checkpointer.from_config(cfg, ctx, policy, optimizer, states={"trainer": tr})
    return tr
