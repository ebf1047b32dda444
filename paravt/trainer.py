"""The trainer's state: everything a training step touches, built once by
``paravt.train.build_trainer``, the step's phases (``Trainer.phase``) and the small state a
checkpoint keeps of it (``Trainer.state_dict`` / ``load_state_dict``: ``TrainerState``, the
one schema of ``trainer_state.pt``'s trainer keys).

Read by ``paravt.train`` (the step) and ``paravt.run`` (the run loop); saved and loaded by its
``paravt.checkpoint.Checkpointer`` (``states={"trainer": trainer}``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch

from paravt.agent.loop import AgentRunner
from paravt.algo.loss import PolicyObjective
from paravt.algo.reference import ReferencePolicy
from paravt.checkpoint import Checkpointer, rng_state, set_rng_state
from paravt.config import Config
from paravt.data.sampler import PromptSampler
from paravt.distributed import DistContext, all_gather_objects
from paravt.engines.engine import Engine
from paravt.metrics import MetricsLogger, ThumbnailStore
from paravt.models import ModelBundle
from paravt.preempt import Preemption
from paravt.rollout_source import RolloutSource
from paravt.types import Sample, VideoMeta

#: What a step started from: the rollout source's data position and this rank's RNG states
#: (``rng_state``), saved instead of the current ones for a step abandoned before its update.
StepStart = tuple[dict[str, Any], Any]


class TrainerState(TypedDict):
    """The trainer's part of a checkpoint's ``trainer_state.pt`` (``Trainer.state_dict``), the
    keys checkpoints of every paravt since the sharded format (2) hold, read back by
    ``Trainer.load_state_dict`` on ``--resume``. The checkpointer adds its layout's own keys
    ("format", "train_state", "optim_empty"; ``paravt.checkpoint.LAYOUT_KEYS``)."""

    step: int  # the step the checkpoint holds (the last completed one)
    scheduler: dict[str, Any]  # the learning-rate schedule's ``state_dict``
    # The rollout source's ``data_state(step)``: the sampler's position (async group
    # dispatch: the groups trained out of order too).
    data: dict[str, Any]
    rng: list[dict[str, Any]]  # every rank's RNG states (``rng_state``), by rank
    world_size: int  # the saving run's ranks (the RNG states are restored on as many)


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
    # Seconds of each phase of the step in progress (``time/<phase>``; reset by each step).
    times: dict[str, float] = field(default_factory=dict)
    # The step the trainer's state is at (the last completed one): what ``state_dict``
    # records (``checkpoint`` sets it; ``load_state_dict`` to the resumed step).
    step: int = 0
    # The run's checkpoints (built by ``build_trainer`` with ``states={"trainer": self}``;
    # None: a trainer that saves none).
    checkpointer: Checkpointer | None = None
    # The sampler position and RNG states of a step abandoned before its update, recorded by
    # ``checkpoint(begin=...)`` for the one save in progress instead of the current ones.
    _begin: StepStart | None = field(default=None, init=False, repr=False)

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

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self) -> TrainerState:
        """The small state to resume (``TrainerState``) at ``step``: the schedule, the rollout
        source's data position after it, every rank's RNG states (one gather: every rank
        calls it, inside ``Checkpointer.save``)."""
        if self._begin is not None:
            data, rng = self._begin
        else:
            data, rng = self.source.data_state(self.step), rng_state()
        return {
            "step": int(self.step),
            "scheduler": self.scheduler.state_dict(),
            "data": data,
            "rng": all_gather_objects(rng, self.ctx),
            "world_size": self.ctx.world_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """``--resume`` (every rank; ``Checkpointer.load``): ``state_dict``'s keys back, from a
        checkpoint's whole ``trainer_state.pt``: the schedule, the source's data position, this
        rank's RNG states when the saving run had as many ranks, and ``start_step``."""
        step = int(state["step"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.source.load_data_state(state["data"], step)
        rngs = state.get("rng", [])
        if len(rngs) == self.ctx.world_size:
            set_rng_state(rngs[self.ctx.rank])
        self.start_step = self.step = step

    def checkpoint(
        self,
        step: int,
        *,
        begin: StepStart | None = None,
        background: bool | None = None,
    ) -> bool:
        """Checkpoint the run at step ``step`` (every rank; ``Checkpointer.save``), its
        measured phases into ``times``. ``begin``: the sampler position and this rank's RNG
        states that the abandoned step ``step + 1`` started from, saved instead of the
        current ones (a preemption's save; the weights, optimizer and schedule are still step
        ``step``'s). False when the write failed under ``train.on_save_error=continue``."""
        assert self.checkpointer is not None, "a trainer without a checkpointer"
        self.step, self._begin = step, begin
        try:
            saved = self.checkpointer.save(step, background=background)
        finally:
            self._begin = None
        self.times.update(saved.times)
        return saved.ok

    def finish_checkpoint(self) -> tuple[int, bool] | None:
        """Commit the background checkpoint in flight (``Checkpointer.finish``; every rank),
        its write time into ``times``: ``(step, ok)``, or None when none was in flight."""
        if self.checkpointer is None:
            return None
        done = self.checkpointer.finish()
        if done is None:
            return None
        self.times.update(done.times)
        return done.step, done.ok

    @property
    def checkpoint_pending(self) -> bool:
        """Whether a background checkpoint is in flight (``Checkpointer.pending``)."""
        return self.checkpointer is not None and self.checkpointer.pending is not None

    def checkpoint_written(self) -> bool:
        """Whether this rank's part of the background checkpoint is written
        (``Checkpointer.written``): the step's ``save_written`` flag."""
        return self.checkpointer is not None and self.checkpointer.written()
