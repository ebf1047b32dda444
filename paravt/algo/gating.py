"""PARA-GRPO frame-budget gating: a per-prompt overview budget K, stable across processes.

K ~ Uniform(budgets), drawn once per (seed, epoch, sample id) and shared by the G rollouts of
that prompt. The draw uses blake2b, not Python's ``hash()`` (salted per process, so the
reference implementation's K differed between workers and runs). With gating off every prompt
gets ``fixed``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any


def frame_budget(
    sample_id: str,
    *,
    seed: int,
    epoch: int,
    budgets: Sequence[int],
    gating: bool = True,
    fixed: int = 16,
) -> int:
    """The overview frame count K for one prompt (same inputs → same K, in any process)."""
    if not gating:
        return int(fixed)
    if not budgets:
        raise ValueError("frame_budget: budgets is empty; set video.frame_budgets, e.g. [4, 8, 16]")
    digest = hashlib.blake2b(f"{seed}:{epoch}:{sample_id}".encode(), digest_size=8).digest()
    return int(budgets[int.from_bytes(digest, "little") % len(budgets)])


def step_budgets(picked: Sequence[tuple[Any, int]], cfg: Any) -> list[int]:
    """K for each ``(sample, epoch)`` a step drew (``PromptSampler.next``) under ``cfg``'s
    ``video`` gating: the trainer's synchronous rollout and an asynchronous run's prompt
    assignment (``paravt.workers.pipeline``) both call it, through
    ``paravt.rollout_source.plan_prompts``."""
    v = cfg.video
    return [
        frame_budget(
            s.id,
            seed=cfg.train.seed,
            epoch=epoch,
            budgets=v.frame_budgets,
            gating=v.gating,
            fixed=v.fixed_frames,
        )
        for s, epoch in picked
    ]
