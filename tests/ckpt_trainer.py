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


def linear_trainer(
    out: Any,
    *,
    shape: tuple[int, int],
    rows: int,
    keep_last: int,
    seed: int = 0,
    warmup: int = 0,
    async_save: bool = False,
    data: dict[str, Any] | None = None,
) -> tuple[Trainer, Any]:
    """``small_trainer`` of one process around a ``Linear(*shape)`` with AdamW (lr 1e-2) and a
    warm-up schedule over ``warmup`` steps (0: constant), checkpointing into ``out``; and its
    ``step()`` (a forward of ``rows`` random rows, backward, optimizer and schedule steps), taken
    once so that the optimizer has state."""
    torch.manual_seed(seed)
    lin = torch.nn.Linear(*shape)
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
    )

    def step() -> None:
        lin(torch.randn(rows, shape[0])).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()

    step()
    train = types.SimpleNamespace(
        out_dir=str(out), keep_last=keep_last, on_save_error="fail", async_save=async_save,
        master_dtype="float32",
    )  # fmt: skip
    cfg = types.SimpleNamespace(train=train, model=types.SimpleNamespace(dtype="float32"))
    return small_trainer(cfg, DistContext(), lin, opt, sched, data), step
