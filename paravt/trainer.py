"""The trainer's state: everything a training step touches, built once by
``paravt.train.build_trainer``, and the step's phases (``Trainer.phase``).

Read by ``paravt.train`` (the step and the run loop), ``paravt.checkpoint.save_trainer`` and
``paravt.eval.heldout.evaluate``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from paravt.agent.loop import AgentRunner
from paravt.algo.loss import PolicyObjective
from paravt.algo.reference import ReferencePolicy
from paravt.checkpoint import AsyncSave
from paravt.config import Config
from paravt.data.sampler import PromptSampler
from paravt.distributed import DistContext
from paravt.engines.engine import Engine
from paravt.metrics import MetricsLogger, ThumbnailStore
from paravt.models import ModelBundle
from paravt.preempt import Preemption
from paravt.rollout_source import RolloutSource
from paravt.types import Sample, VideoMeta


@dataclass
class Trainer:
    """Everything a step touches (built once by ``paravt.train.build_trainer``)."""

    cfg: Config
    ctx: DistContext
    policy: torch.nn.Module
    bundle: ModelBundle  # the policy's (tokenizer, vision spec)
    engine: Engine | None  # None: an asynchronous trainer rank without an evaluation engine
    runner: AgentRunner | None  # the agent loop over ``engine`` (None with it): evaluations
    reference: ReferencePolicy | None  # None: no KL term (algo.kl_coef = 0)
    objective: PolicyObjective
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    # Where the step's rollouts come from: this rank (``LocalRollout``) or the asynchronous
    # rollout workers (``paravt.workers.RolloutPipeline``); chosen once by ``build_trainer``.
    # It holds the run's prompt sampler (``sampler``).
    source: RolloutSource
    val_samples: list[Sample]
    logger: MetricsLogger
    init_dir: str
    # video path -> VideoMeta (the runner's probe cache, or a probe), for the viewer's records
    video_meta: Callable[[str], VideoMeta]
    start_step: int = 0
    thumbs: ThumbnailStore | None = None  # the viewer's overview thumbnails (rank 0)
    preempt: Preemption | None = None  # the run's signal handling (None: no mid-step check)
    # The last step's skipped prompts' errors (every rank's): what the empty-step alarm and
    # error quote when it trained on nothing (paravt.alarms.EmptySteps).
    step_errors: list[str] = field(default_factory=list)
    # Seconds of each phase of the step in progress (``time/<phase>``; reset by each step).
    times: dict[str, float] = field(default_factory=dict)
    # train.async_save: the checkpoint being written in the background
    # (``paravt.checkpoint.AsyncSave``), committed by ``finish_trainer_save``; None: none.
    pending_save: AsyncSave | None = None

    @property
    def sampler(self) -> PromptSampler:
        """The run's prompt order, held by the rollout source (which draws each step's
        prompts from it); assigning one here hands it to the source."""
        return self.source.sampler

    @sampler.setter
    def sampler(self, sampler: PromptSampler) -> None:
        self.source.sampler = sampler

    @contextmanager
    def phase(self, step: int, name: str) -> Iterator[None]:
        """One phase of step ``step``: the run's preemption handler is told where the step is
        (its ``[preempt]`` line names it) and the phase's seconds land in ``times`` as
        ``time/<name>``."""
        if self.preempt is not None:
            self.preempt.enter(step, name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[f"time/{name}"] = time.perf_counter() - t0
