"""A training step's numbers: accumulated on each rank while the step runs, reduced over the
ranks once at its end (one packed all-reduce of every sum, one gather of the trajectory records
and skipped-prompt errors), turned into the step's ``metrics.jsonl`` row.

Used by ``paravt.train.train_step`` (step 7: ``reduce``, then ``Reduced.result``, which
returns the step's row and errors as a ``StepResult``). Before this record a step ran eight collectives
for its metrics alone (each sum its own all-reduce); the collectives that decide something
(the non-finite guard, the rank balance, the loss denominators, the micro-batch counts) are not
metrics and stay where they decide.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from paravt.distributed import DistContext, all_gather_objects, all_reduce_sum
from paravt.metrics import rollout_metrics, trajectory_record
from paravt.models.prefix import shared_rows
from paravt.types import Group, PackedBatch, RolloutBatch, SequenceUnit

#: The update's per-token statistics (``MinibatchResult.stats``), summed weighted by tokens.
UPDATE_STATS = ("clip_frac", "clip_frac_low", "clip_frac_high", "kl_mean", "ratio_mean")

#: The rollout counters summed over ranks into ``rollout/<name>`` (``RolloutStats`` fields).
ROLLOUT_COUNTS = ("context_forced_answers", "context_cut_answers", "context_ended", "crops")

#: Every sum a rank contributes, in the order of the one packed all-reduce.
SUMS = (
    "kl_pen", "kl_rows",  # the KL-in-reward penalty (algo.kl_mode=reward) over trained rows
    "loss_num", "den", "ent", "ent_n", *UPDATE_STATS, "n_tokens",  # the update
    "gen_tokens", "num_groups", "skipped_prompts", "skipped_context", "packed_tokens",
    "backbone_rows", "main_prompt", "main_suffix", "main_rows",  # the context mix
    *ROLLOUT_COUNTS, "sub_agents",
    # 1 on a rank whose part of the background checkpoint in flight is written
    # (``paravt.checkpoint.Checkpointer.written``): the sum equal to the world size is the
    # ranks' agreement that ``train_step`` commits it at this step's end, in this all-reduce.
    "save_written",
)  # fmt: skip

#: The update's metrics, absent from a step that trained on nothing.
UPDATE_KEYS = (
    "loss", "kl", "clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean", "entropy",
    "grad_norm",
)  # fmt: skip


@dataclass
class StepStats:
    """One rank's numbers of one step (``add`` while it runs; ``reduce`` once at its end)."""

    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SUMS, 0.0))
    grad_norms: list[float] = field(default_factory=list)  # every rank's (global already)
    records: list[dict[str, Any]] = field(default_factory=list)  # ``trajectory_record`` rows
    errors: list[str] = field(default_factory=list)  # the skipped prompts' errors
    extra: dict[str, float] = field(default_factory=dict)  # global already (balance/*)

    def add(self, **values: float) -> None:
        for k, v in values.items():
            self.sums[k] += v

    def add_update(self, result: Any, den: float, grad_norm: float) -> None:
        """One finite optimizer step: its ``MinibatchResult``, this rank's loss denominator and
        the (global) clipped gradient norm."""
        self.grad_norms.append(grad_norm)
        n_tok = result.stats["n_tokens"]
        self.add(
            loss_num=result.loss_num, den=den, ent=result.entropy_sum, ent_n=result.entropy_count
        )
        for k in UPDATE_STATS:
            self.sums[k] += result.stats[k] * n_tok
        self.sums["n_tokens"] += n_tok

    def add_rollout(
        self,
        batch: RolloutBatch,
        units: Sequence[SequenceUnit],
        batches: Sequence[PackedBatch],
        advantage: dict[str, float],
    ) -> None:
        """What the step trained on: the rollouts (records with each main rollout's group
        advantage, skipped prompts, counters), the units this rank trained and their packed
        batches (tokens, backbone rows, the main rows' prompt / suffix mix)."""
        groups: list[Group] = batch.groups
        self.records = [
            trajectory_record(t, g.num_frames, advantage.get(t.uid))
            for g in groups
            for t in g.trajectories
        ]
        self.errors = list(batch.errors)
        self.add(
            gen_tokens=float(sum(sum(t.loss_mask) for u in units for t in u.sequences)),
            num_groups=float(len(groups)),
            skipped_prompts=float(len(batch.errors)),
            packed_tokens=float(sum(int(b.input_ids.numel()) for b in batches)),
            backbone_rows=float(sum(shared_rows(b, range(len(b.uids))) for b in batches)),
            main_prompt=float(sum(u.main.prompt_len for u in units)),
            main_suffix=float(sum(len(u.main.tokens) - u.main.prompt_len for u in units)),
            main_rows=float(len(units)),
            sub_agents=float(sum(len(g.sub_trajectories) for g in groups)),
            **{k: float(getattr(batch.stats, k)) for k in ROLLOUT_COUNTS},
        )

    def reduce(self, ctx: DistContext) -> Reduced:
        """Every rank's numbers: one all-reduce of the sums, one gather of the records and
        errors (every rank calls it)."""
        vec = all_reduce_sum(torch.tensor([self.sums[k] for k in SUMS], dtype=torch.float64), ctx)
        parts = all_gather_objects((self.records, self.errors), ctx)
        return Reduced(
            dict(zip(SUMS, (float(x) for x in vec))),
            [r for recs, _ in parts for r in recs],
            [e for _, errs in parts for e in errs],
        )


@dataclass(frozen=True)
class StepResult:
    """What a step hands back (``Reduced.result``): its ``metrics.jsonl`` row and every rank's
    skipped prompts' errors (the empty-step alarm quotes them)."""

    metrics: dict[str, float]
    errors: list[str]


@dataclass
class Reduced:
    """A step's numbers over every rank (``StepStats.reduce``)."""

    sums: dict[str, float]
    records: list[dict[str, Any]]
    errors: list[str]

    def result(
        self,
        stats: StepStats,
        batch: RolloutBatch,
        *,
        seconds: float,
        lr: float,
        times: dict[str, float],
        released_bytes: float,
        guard: dict[str, float],
        push: dict[str, float] | None,
    ) -> StepResult:
        """The step's whole row and errors: ``metrics`` (``seconds``: the step's wall time,
        ``time/step``), then the phase times (``times``: ``Trainer.times``), the device cache
        this rank released (``released_bytes``), the rollout's parts (this rank's ``batch``; an
        asynchronous step's summed over its workers: overview decode + pixel pack, main-agent
        generation, crop decode + pack, sub-agents), the non-finite guard's metrics, an
        asynchronous step's ``async/*`` (rank 0: staleness, queue depth, idle times, and
        ``push``: the weight publisher's, each worker's wait for weights)."""
        m = self.metrics(stats, seconds, lr)
        m.update(times)
        m["time/step"] = seconds
        m["mem/cache_released_gib"] = released_bytes / 2**30  # this rank's (0 off CUDA)
        for k, name in (("overview_s", "overview"), ("main_gen_s", "main_gen"),
                        ("crop_s", "crops"), ("sub_gen_s", "sub_gen")):  # fmt: skip
            m[f"time/{name}"] = float(getattr(batch.stats, k))
        m.update(guard)
        if batch.metrics:  # asynchronous (rank 0)
            m.update(batch.metrics)
            m["async/trainer_idle_frac"] = m["time/rollout"] / max(m["time/step"], 1e-9)
        if push is not None:  # rank 0's weight push
            m.update(push)
        return StepResult(m, self.errors)

    def metrics(self, stats: StepStats, seconds: float, lr: float) -> dict[str, float]:
        """The step's row (without the phase times, the guard's and the async metrics): the
        rollouts' behaviour (``rollout_metrics``), the update's loss and statistics (absent
        when the step trained on nothing), tokens, context mix and rollout counters."""
        s = self.sums
        n_tok = max(s["n_tokens"], 1.0)
        m = rollout_metrics(self.records)
        m.update(stats.extra)
        m["kl_penalty"] = s["kl_pen"] / s["kl_rows"] if s["kl_rows"] > 0 else 0.0
        m.update(
            {
                "loss": s["loss_num"] / s["den"] if s["den"] > 0 else 0.0,
                "kl": s["kl_mean"] / n_tok,
                "clip_frac": s["clip_frac"] / n_tok,
                "clip_frac_low": s["clip_frac_low"] / n_tok,
                "clip_frac_high": s["clip_frac_high"] / n_tok,
                "ratio_mean": s["ratio_mean"] / n_tok,
                "entropy": s["ent"] / s["ent_n"] if s["ent_n"] > 0 else 0.0,
                "grad_norm": float(np.mean(stats.grad_norms)) if stats.grad_norms else 0.0,
                "lr": lr,
                "tokens_per_s": s["gen_tokens"] / max(seconds, 1e-9),
                "trained_tokens": s["gen_tokens"],
                "num_groups": s["num_groups"],
                "skipped_prompts": s["skipped_prompts"],
                # Of those, prompts whose question alone fills the context (not trained:
                # paravt.train.drop_unfit_prompts).
                "skipped_context": s["skipped_context"],
                # Every position of every trained sequence (prompts and visual placeholders
                # included): what one PPO epoch's forwards process, the T of an update's
                # 6 * params * T FLOPs.
                "packed_tokens": s["packed_tokens"],
                # What the forwards push through the backbone (algo.share_prefix: each group's
                # prompt once; paravt.models.prefix.shared_rows), and the main rows' context
                # mix: prompt (system text, overview, question) against what follows it.
                "backbone_rows": s["backbone_rows"],
                "tokens/main_prompt": s["main_prompt"] / max(s["main_rows"], 1.0),
                "tokens/main_suffix": s["main_suffix"] / max(s["main_rows"], 1.0),
            }
        )
        # Episodes the engine's context cut short (paravt.agent.loop: never a failed request),
        # and PARA-GRPO's own work: crops decoded and sub-agent trajectories.
        m.update({f"rollout/{k}": s[k] for k in (*ROLLOUT_COUNTS, "sub_agents")})
        if s["num_groups"] == 0:  # trained on nothing: no update statistic either
            for k in UPDATE_KEYS:
                m.pop(k)
        return m
