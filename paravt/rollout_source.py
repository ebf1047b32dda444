"""Where a training step's rollouts come from: one protocol, two sources, one prompt plan.

``paravt.train.build_trainer`` picks the source once; ``train_step`` then reads the same for
both (``collect`` → the update → ``publish``), and the run loop checkpoints ``data_state``:

* :class:`LocalRollout` (``rollout.workers=0``, synchronous): this rank rolls out its share of
  the step's prompts with its own engine and ``AgentRunner``, and ``publish`` pushes the
  updated weights into that engine.
* ``paravt.workers.RolloutPipeline`` (``rollout.workers > 0``, asynchronous): the rollout
  workers sample ahead of the trainer within the staleness bound; ``collect`` waits for a
  step's finished groups and ``publish`` streams the weights to the workers. The trainer's own
  engine, if any, only evaluates (``evaluating``).

:func:`plan_prompts` is the one place a step's prompts, their frame budgets K and its sampling
seed are computed, for both sources.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from paravt.agent.loop import AgentRunner, stable_seed
from paravt.algo.gating import step_budgets
from paravt.config import Config
from paravt.data.sampler import PromptSampler
from paravt.distributed import DistContext, Precision, full_weights, is_sharded, shard_list
from paravt.engines.engine import Engine, unwrap_module
from paravt.preempt import Preemption
from paravt.types import RolloutBatch, Sample
from paravt.weight_sync import SumRecorder, verify_engine


@dataclass(frozen=True)
class StepPrompts:
    """A step's prompts, the frame budget K of each, and the step's sampling seed."""

    samples: list[Sample]
    budgets: list[int]
    seed: int


def plan_prompts(
    sampler: PromptSampler, cfg: Config, step: int, ctx: DistContext | None = None
) -> StepPrompts:
    """Draw step ``step``'s ``train.prompts_per_step`` prompts from ``sampler``, with their K
    (``algo.gating.step_budgets``: a stable hash of seed, epoch and sample id) and the step's
    seed (``stable_seed(train.seed, step)``). ``ctx``: keep this rank's share only
    (``LocalRollout``); the asynchronous pipeline plans the whole step on rank 0."""
    picked = sampler.next(cfg.train.prompts_per_step)
    if ctx is not None:
        picked = shard_list(picked, ctx)
    return StepPrompts(
        [s for s, _ in picked], step_budgets(picked, cfg), stable_seed(cfg.train.seed, step)
    )


def push_weights(engine: Engine, policy: torch.nn.Module, cfg: Config) -> None:
    """Push the updated policy into ``engine`` (the synchronous rollout engine after each
    update; an asynchronous trainer's evaluation engine before it evaluates).

    One process: the HF engine shares the policy module (nothing to copy); vLLM gets its state
    dict. FSDP2 (several ranks, or fp32 masters under bf16 compute on one): the full weights
    are streamed (``paravt.distributed.full_weights``: one entry all-gathered and cast to the
    compute dtype at a time, never a full state dict) into the rank's engine: vLLM's reload
    path, or the HF engine's replica, copied in place. The HF replica is then read back and
    checked against the streamed tensors' checksums, and vLLM's copy (one process or several)
    against their element sums (``paravt.weight_sync.verify_engine``: a ``WeightSyncError``
    naming the first tensor or parameter that differs; vLLM's reload also raises for any
    parameter it did not reach)."""
    elem_dtype = getattr(engine, "weight_dtype", None)  # vLLM: its copy read back by sums
    if is_sharded(policy):
        stream = SumRecorder(full_weights(policy, Precision.from_config(cfg).compute), elem_dtype)
    elif elem_dtype is not None:  # vLLM: the state dict's tensors, recorded as they pass
        stream = SumRecorder(unwrap_module(policy).state_dict().items(), elem_dtype)
    else:  # one process, the HF engine: it shares the policy module (nothing copied)
        engine.sync_weights(policy)
        return
    engine.sync_weights(stream)
    verify_engine(engine, stream.staged(version=-1))


class RolloutSource(Protocol):
    """A training step's rollouts: ``collect`` them, ``publish`` the weights they should be
    sampled with next, tell the checkpoint the sampler's position (``data_state``), ``close``
    at the end. ``evaluating``: around each held-out evaluation with the trainer's engine."""

    #: How an abandoned step is described in the ``[preempt]`` line ("abandoned step N ...").
    abandon_when: str
    #: The run's prompt order (``Trainer.sampler`` reads and replaces it here).
    sampler: PromptSampler

    def start(self, policy: torch.nn.Module, init_dir: str, start_step: int) -> None:
        """Before the first step (the async workers get the model folder and first weights)."""

    def collect(self, step: int, preempt: Preemption | None) -> RolloutBatch | None:
        """Step ``step``'s rollouts on this rank; None: a preemption signal arrived meanwhile
        and the step is abandoned."""

    def publish(self, policy: torch.nn.Module, version: int) -> None:
        """After step ``version``'s update: the new weights to whoever rolls out next."""

    def data_state(self, done: int) -> dict[str, Any]:
        """What the checkpoint of step ``done`` records of the prompts (the sampler's position
        after step ``done``'s; the async group dispatch adds the groups trained out of order)."""

    def load_data_state(self, state: dict[str, Any], start_step: int) -> None:
        """``--resume`` from the checkpoint of step ``start_step``: its ``data_state``."""

    def evaluating(self, policy: torch.nn.Module, step: int) -> AbstractContextManager[None]:
        """A context manager around an evaluation of the policy after step ``step``."""

    def push_metrics(self) -> dict[str, float] | None:
        """The weight push's metrics for the step's row (the asynchronous trainer rank 0's:
        ``async/push_s``, each worker's wait for weights); None: this rank pushes none."""

    def close(self) -> None:
        """The run is over (or stopped early): release what the source runs."""


class LocalRollout:
    """Synchronous: this rank rolls out its share of each step's prompts with ``runner`` (over
    ``engine``, which also evaluates); ``publish`` pushes the weights into ``engine``."""

    abandon_when = "after its rollout (finishing it would pass the grace)"

    def __init__(
        self,
        cfg: Config,
        ctx: DistContext,
        sampler: PromptSampler,
        runner: AgentRunner,
        engine: Engine,
    ) -> None:
        self.cfg, self.ctx, self.sampler, self.runner, self.engine = (
            cfg,
            ctx,
            sampler,
            runner,
            engine,
        )

    def start(self, policy: torch.nn.Module, init_dir: str, start_step: int) -> None:
        return None

    def collect(self, step: int, preempt: Preemption | None) -> RolloutBatch | None:
        plan = plan_prompts(self.sampler, self.cfg, step, self.ctx)
        done = self.runner.rollout(
            plan.samples, plan.budgets, group_size=self.cfg.rollout.group_size, seed=plan.seed
        )
        # GPU vLLM: free the device for the update (weights to host, KV cache dropped); the
        # weight push of ``publish`` wakes it. A no-op for the HF engine and on the CPU.
        self.engine.sleep()
        return RolloutBatch(done.groups, list(done.errors), done.stats)

    def publish(self, policy: torch.nn.Module, version: int) -> None:
        push_weights(self.engine, policy, self.cfg)

    def data_state(self, done: int) -> dict[str, Any]:
        return self.sampler.state()

    def load_data_state(self, state: dict[str, Any], start_step: int) -> None:
        self.sampler.load(state)

    @contextmanager
    def evaluating(self, policy: torch.nn.Module, step: int) -> Iterator[None]:
        yield  # the engine holds the policy's weights already (pushed after every update)

    def push_metrics(self) -> dict[str, float] | None:
        return None  # (the push into this rank's engine is the step's ``time/sync``)

    def close(self) -> None:
        return None
