"""Non-finite guard: no NaN/inf reward, advantage, loss or gradient reaches the optimizer.

One NaN reward makes its whole group's advantages NaN (the group mean is NaN), the loss NaN,
every gradient NaN, and one AdamW step then writes NaN into every parameter *and* into the
moments, so the run never recovers. ``train_step`` asks a ``NonFiniteGuard`` at four points:

* ``check_rewards`` / ``check_advantages`` right after they are computed (before any forward):
  a non-finite value on any rank skips the whole step's update on every rank;
* ``update_is_finite`` after each minibatch's backward + clipping, before
  ``optimizer.step()``: a non-finite loss (this rank's) or gradient norm (global) skips that
  optimizer step on every rank.

Ranks agree through one ``all_reduce_sum`` of the local flags (a no-op on one rank), so FSDP
ranks always take the same number of optimizer steps. A skipped update calls neither
``optimizer.step()`` nor ``scheduler.step()``: parameters, AdamW moments, the step counter
and the learning-rate schedule stay exactly as they were (the caller zeroes the gradients).
Every skip is counted (``skipped_updates``, ``nonfinite/<what>`` in ``metrics.jsonl``) and
printed once, on rank 0, with the sample ids of every rank involved.

Honest limit: a non-finite loss or gradient norm belongs to a whole minibatch (the gradient is
a sum over its sequences), so the line names all of the minibatch's samples, not the culprit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from paravt.distributed import DistContext, all_gather_objects, all_reduce_sum
from paravt.log import get_logger
from paravt.types import Group

log = get_logger(__name__)

# What is checked, in step order; each is a ``nonfinite/<what>`` metric.
CHECKS: tuple[str, ...] = ("reward", "advantage", "loss", "grad_norm")


class NonFiniteGuard:
    """The non-finite checks of one training step (build one per step)."""

    def __init__(self, ctx: DistContext, step: int) -> None:
        self.ctx = ctx
        self.step = step
        self.counts: dict[str, float] = dict.fromkeys(CHECKS, 0.0)
        self.skipped_updates = 0
        self.skip_step = False  # a reward/advantage was non-finite: no update this step
        self._sample_of: dict[str, str] = {}

    # -------------------------------------------------------------------- before any forward

    def check_rewards(self, groups: Sequence[Group]) -> bool:
        """False (and the step's update is skipped on every rank) when any rank has a
        non-finite main-trajectory reward. ``nonfinite/reward`` counts such trajectories."""
        bad = []
        for g in groups:
            self._sample_of.update((s.uid, s.sample_id) for s in g.sub_trajectories)
            for t in g.trajectories:
                self._sample_of[t.uid] = t.sample_id
                if not math.isfinite(t.reward):
                    bad.append(f"{t.sample_id} (uid {t.uid}, reward {t.reward})")
        return self._whole_step("reward", bad)

    def check_advantages(self, units: Sequence[Any]) -> bool:
        """Same for the group advantages of ``SequenceUnit``s (``paravt.algo.advantages``)."""
        bad = [
            f"{u.main.sample_id} (uid {u.main.uid}, advantage {u.advantage})"
            for u in units
            if not math.isfinite(u.advantage)
        ]
        return self._whole_step("advantage", bad)

    def planned_epochs(self, epochs: int, minibatches: int) -> int:
        """The PPO epochs to run: 0 when the step is skipped (counting its optimizer steps)."""
        if not self.skip_step:
            return epochs
        self.skipped_updates += epochs * minibatches
        return 0

    # ------------------------------------------------------------- before optimizer.step()

    def update_is_finite(self, loss: float, grad_norm: float, uids: Sequence[str]) -> bool:
        """True when every rank's minibatch loss and the (global) gradient norm are finite.

        On False the caller must not step the optimizer or the scheduler, and must zero the
        gradients. ``uids`` are this rank's minibatch sequences (named in the log line).
        """
        flags = torch.tensor(
            [not math.isfinite(loss), not math.isfinite(grad_norm)], dtype=torch.float64
        )
        bad_loss, bad_grad = (float(x) for x in all_reduce_sum(flags, self.ctx))
        if bad_loss == 0 and bad_grad == 0:
            return True
        self.skipped_updates += 1
        self.counts["loss"] += bad_loss  # ranks whose minibatch loss was non-finite
        self.counts["grad_norm"] += float(bad_grad > 0)
        what = []
        if not math.isfinite(loss):
            what.append(f"loss {loss}")
        if not math.isfinite(grad_norm):
            what.append(f"grad_norm {grad_norm}")
        mine = sorted({self._sample_of.get(u, u) for u in uids})
        line = f"{', '.join(what)} on minibatch samples {', '.join(mine)}" if what else ""
        parts = [p for p in all_gather_objects(line, self.ctx) if p]
        self._print(
            f"non-finite {'; '.join(parts)}; optimizer step skipped on every rank "
            "(gradients zeroed, optimizer and schedule not advanced)"
        )
        return False

    # ---------------------------------------------------------------------------- metrics

    def metrics(self) -> dict[str, float]:
        """``skipped_updates`` and ``nonfinite/<what>`` (always present, so every step's row
        has the same keys)."""
        out = {"skipped_updates": float(self.skipped_updates)}
        out.update({f"nonfinite/{k}": v for k, v in self.counts.items()})
        return out

    # ---------------------------------------------------------------------------- helpers

    def _whole_step(self, what: str, bad: list[str]) -> bool:
        n = float(all_reduce_sum(float(len(bad)), self.ctx)[0])
        self.counts[what] += n
        if n == 0:
            return True
        self.skip_step = True
        labels = [b for part in all_gather_objects(bad, self.ctx) for b in part]
        self._print(
            f"non-finite {what} in {int(n)} trajector{'y' if n == 1 else 'ies'}: sample "
            f"{'; '.join(labels)}; this step's update is skipped on every rank"
        )
        return False

    def _print(self, msg: str) -> None:
        if self.ctx.is_main:
            log.info(f"[guard] step {self.step}: {msg}")
