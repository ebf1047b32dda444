"""The training run's held-out evaluation: the before/after numbers of its final table.

``python -m paravt.train`` (also every ``train.eval_every`` steps: the collapse experiment's
held-out curves) rolls out the validation prompts with the
run's own agent runner and policy, under each ``train.eval_conditions`` entry, at the rollout
temperature; ``python -m paravt.eval`` is the standalone benchmark evaluation
(``paravt.eval.runner``).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch

from paravt.agent import AgentRunner
from paravt.agent.loop import stable_seed
from paravt.config import Config
from paravt.data.synth import summary_correct
from paravt.distributed import DistContext, all_gather_objects, shard_list
from paravt.eval.conditions import eval_conditions
from paravt.log import get_logger
from paravt.metrics import TABLE_ROWS, clustered_mean_ci95, rollout_metrics, trajectory_record
from paravt.rewards import score_groups
from paravt.types import Sample

log = get_logger(__name__)

#: Per-condition metrics of :func:`evaluate` (``{condition}/{key}``), besides the interval.
EVAL_CONDITION_KEYS = (
    "accuracy",
    "format_compliance",
    "parse_error_rate",
    "tool_calls_per_rollout",
    "tool_call_rate",
    "summary_accuracy",
)


def table_rows(cfg: Config) -> list[tuple[str, str]]:
    """The final table's rows: the first evaluation condition's (and the last step's)
    behaviour metrics, then accuracy with its 95% interval and the summary accuracy of each
    ``train.eval_conditions`` entry."""
    rows = list(TABLE_ROWS)
    for name, _, tools, _ in eval_conditions(cfg):
        rows.append((f"{name}/accuracy", f"accuracy {name}"))
        rows.append((f"{name}/accuracy_ci95", "  +/- (95% interval)"))
        if tools:
            rows.append((f"{name}/summary_accuracy", f"summary accuracy {name}"))
    return rows


def prompt_row(name: str, g: Any, recs: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``heldout.jsonl`` row: a held-out prompt's rollouts (``recs``, its group ``g``)
    under condition ``name``: its K, the share of its rollouts that executed a crop, its
    accuracy, format compliance, `</think>` closure (of its non-forced turns, and of those that
    call a tool: ``tool_turn_closure``; NaN: none) and calls per rollout, with the sample's scalar ``extra`` fields (what the generator recorded
    about it). Per prompt, so that a tool rate can be checked prompt by prompt."""
    closed = [c for r in recs for c in r["closed"]]
    closed_tool = [c for r in recs for c in r.get("closed_tool", ())]
    n = len(recs)
    extra = {k: v for k, v in g.sample.extra.items() if isinstance(v, (bool, int, float, str))}
    return {
        "condition": name,
        "prompt": g.sample.id,
        "K": int(g.num_frames),
        "samples": n,
        "accuracy": sum(r["breakdown"].get("acc", 0.0) for r in recs) / n,
        "tool_call_rate": sum(r["used_tool"] for r in recs) / n,
        "tool_calls_per_rollout": sum(r["n_calls"] for r in recs) / n,
        "format_compliance": sum(r["compliant"] for r in recs) / n,
        "think_closure_rate": sum(closed) / len(closed) if closed else float("nan"),
        "tool_turn_closure": (sum(closed_tool) / len(closed_tool) if closed_tool else float("nan")),
        **({"extra": extra} if extra else {}),
    }


@torch.no_grad()
def evaluate(
    cfg: Config,
    ctx: DistContext,
    policy: torch.nn.Module,
    runner: AgentRunner | None,
    samples: list[Sample],
    seed: int,
    per_prompt: list[dict[str, Any]] | None = None,
    label: str = "held-out",
) -> dict[str, float]:
    """Roll out the validation prompts ``samples`` under each ``train.eval_conditions`` entry
    (``eval_samples`` each, rollout temperature, one fixed seed for every condition) and score
    them: the before/after numbers of the final table (``paravt.run``'s ``_evaluate``: the
    run's config, distributed context, policy, agent runner and ``val_samples``). Every rank
    takes its share of ``samples``; ``runner`` (over an engine that holds ``policy``'s
    weights) rolls them out: None only where there is nothing to evaluate.

    Per condition ``{name}/accuracy`` with ``{name}/accuracy_ci95`` (the half-width of its 95%
    interval, rollouts of one prompt averaged first), format compliance, parse-error rate, tool
    calls per rollout and ``summary_accuracy`` — the share of executed crops whose sub-agent
    summary is right about the target (``paravt.data.synth.summary_correct``; synthetic task
    only). The first condition's metrics are also reported unprefixed (``rollout_metrics``).

    ``per_prompt``: a list that gets one :func:`prompt_row` per prompt and condition (every
    rank's; ``paravt.train`` writes them to ``heldout.jsonl``).

    ``label`` (``before RL``, ``step 20``, ``after RL``): the start of the console line each
    condition logs when its rollouts are done, e.g. ``[eval] before RL: condition 2/3
    K4_notools done (41 s)``; minutes pass between them on a CPU.
    """
    t0, n_conds = time.perf_counter(), len(eval_conditions(cfg))
    if not samples:
        return {}
    if runner is None:
        raise ValueError("a held-out evaluation needs an agent runner (an evaluation engine)")
    n = len(samples) - len(samples) % ctx.world_size
    mine = shard_list(samples[:n], ctx)
    policy.eval()
    out: dict[str, float] = {}
    base = runner
    for i, (name, k, tools, greedy) in enumerate(eval_conditions(cfg)):
        runner = base
        if not tools or greedy:  # no tool round (the answer forced at once), or greedy
            c = cfg
            if not tools:
                c = replace(c, agent=replace(c.agent, max_turns=0))
            if greedy:
                greedy_rollout = dict(temperature=0.0, sub_temperature=0.0, top_p=1.0)
                c = replace(c, rollout=replace(c.rollout, **greedy_rollout))
            runner = AgentRunner(runner.engine, runner.bundle, c, planner=runner.planner)
        group_size = 1 if greedy else cfg.train.eval_samples
        groups = runner.rollout(
            mine, [k] * len(mine), group_size=group_size, seed=stable_seed("eval", seed)
        ).groups
        score_groups(groups, cfg.reward)
        dt, t0 = time.perf_counter() - t0, time.perf_counter()
        log.info(f"[eval] {label}: condition {i + 1}/{n_conds} {name} done ({dt:.0f} s)")
        recs, rows = [], []
        for g in groups:
            mine_g = []
            need = need_of(g.sample.extra, g.num_frames)
            for t in g.trajectories:
                r = trajectory_record(t, g.num_frames)
                r["prompt"] = g.sample.id
                r["need"] = need
                checks = [
                    summary_correct(c.response, c.start, c.end, g.sample)
                    for turn in t.turns
                    for c in turn.calls
                    if c.status == "ok" and c.start is not None and c.end is not None
                ]
                r["summary_ok"] = [float(x) for x in checks if x is not None]
                mine_g.append(r)
            recs += mine_g
            if per_prompt is not None and mine_g:
                rows.append(prompt_row(name, g, mine_g))
        recs = [r for part in all_gather_objects(recs, ctx) for r in part]
        if per_prompt is not None:
            per_prompt += [r for part in all_gather_objects(rows, ctx) for r in part]
        m = rollout_metrics(recs)
        acc = [r["breakdown"].get("acc", 0.0) for r in recs]
        m["accuracy"], m["accuracy_ci95"] = clustered_mean_ci95(acc, [r["prompt"] for r in recs])
        oks = [x for r in recs for x in r["summary_ok"]]
        m["summary_accuracy"] = sum(oks) / len(oks) if oks else float("nan")
        m["prompts"] = float(len({r["prompt"] for r in recs}))
        if i == 0:
            out.update(m)
        for key in (*EVAL_CONDITION_KEYS, "accuracy_ci95", "prompts"):
            # NaN (logged as null): no rollout of this condition (every video read failed)
            out[f"{name}/{key}"] = m.get(key, float("nan"))
        out.update(need_split(name, recs))
    return out


def need_of(extra: dict[str, Any] | None, k: int) -> bool | None:
    """Whether a prompt's K-frame overview misses the square (``need_K{K}`` of its
    ``Sample.extra``, recorded by the synthetic spot tasks); None where nothing is recorded
    (one's own rows). The one reading of the flag for the split by need and the paired
    table."""
    flag = (extra or {}).get(f"need_K{k}")
    return flag if isinstance(flag, bool) else None


#: The per-need metrics of :func:`need_split` (``{condition}/{need|seen}/{key}``).
NEED_KEYS = (
    "accuracy",
    "tool_call_rate",
    "tool_calls_per_rollout",
    "format_compliance",
    "think_closure_rate",
    "prompts",
)


def need_split(name: str, recs: list[dict[str, Any]]) -> dict[str, float]:
    """Condition ``name``'s metrics split by need: ``{name}/need/{key}`` over the prompts whose
    K-frame overview misses the square (``need_K{K}``, recorded by the synthetic spot tasks:
    only a crop can answer them) and ``{name}/seen/{key}`` over the others, ``key`` in
    ``NEED_KEYS`` (``prompts``: how many). Empty for prompts that record no need."""
    out: dict[str, float] = {}
    if all(r.get("need") is None for r in recs):
        return out
    for part, flag in (("need", True), ("seen", False)):
        sub = [r for r in recs if r.get("need") is flag]
        m = rollout_metrics(sub)
        m["prompts"] = float(len({r["prompt"] for r in sub}))
        for key in NEED_KEYS:
            out[f"{name}/{part}/{key}"] = m.get(key, float("nan"))
    return out


#: The rows of :func:`before_after_table` per condition: (heldout.jsonl key, label).
PAIRED_KEYS = (
    ("tool_call_rate", "call rate"),
    ("tool_calls_per_rollout", "calls / rollout"),
    ("accuracy", "accuracy"),
)


def paired_difference(
    rows: list[dict[str, Any]], cond: str, key: str, need: bool | None
) -> tuple[float, float, float, float, int]:
    """``(before, after, after - before, half-width of its 95% interval, prompts)`` of
    ``heldout.jsonl`` metric ``key`` under condition ``cond`` over the prompts of one need
    (``need`` None: all): the rows of the run's ``eval_before`` and ``eval_after``, paired by
    prompt, the interval clustered by prompt (``clustered_mean_ci95`` of the per-prompt
    differences)."""
    by: dict[str, dict[str, float]] = {"eval_before": {}, "eval_after": {}}
    for r in rows:
        if r.get("condition") != cond or r.get("kind") not in by:
            continue
        if need is not None and need_of(r.get("extra"), r["K"]) is not need:
            continue
        v = r.get(key)
        if v is not None and v == v:  # NaN / null: nothing to pair
            by[r["kind"]][r["prompt"]] = float(v)
    b, a = by["eval_before"], by["eval_after"]
    both = sorted(set(b) & set(a))
    if not both:
        nan = float("nan")
        return nan, nan, nan, nan, 0
    diffs = [a[p] - b[p] for p in both]
    mean_d, half = clustered_mean_ci95(diffs, both)
    mb = sum(b[p] for p in both) / len(both)
    return mb, mb + mean_d, mean_d, half, len(both)


def before_after_table(
    rows: list[dict[str, Any]], conditions: list[Any], guess: float | None = None
) -> str:
    """The run's before/after-RL table from its ``heldout.jsonl`` rows: per tool condition
    (``eval_conditions``) the call rate, calls per rollout and accuracy on the prompts whose
    overview misses the square (``need``) and on the others (``seen``), format compliance and
    ``</think>`` closure on all; per no-tool condition the accuracy, beside ``guess`` (a
    uniform guess's accuracy). Each row: before, after, the difference and its 95% interval
    clustered by prompt, and the number of prompts. Printed by ``python -m paravt.train`` at
    the end of a run; the README's default table."""
    head = f"{'condition':<22}{'prompts':<16}{'metric':<17}{'before':>8}{'after':>8}  difference"
    lines = [head, "-" * (len(head) + 20)]

    def line(label: str, part: str, name: str, cond: str, key: str, need: bool | None) -> None:
        b, a, d, h, n = paired_difference(rows, cond, key, need)
        if n:
            what = f"{part} (n={n})"
            lines.append(f"{label:<22}{what:<16}{name:<17}{b:>8.3f}{a:>8.3f}  {d:+.3f} +/- {h:.3f}")

    for c in conditions:
        label = f"K={c.k} " + ("tools" if c.tools else "no tools")
        label += " greedy" if c.greedy else " sampled"
        # Prompts that record no need (not the spot task: one's own rows) are one part, "all".
        split = any(
            need_of(r.get("extra"), r["K"]) is not None
            for r in rows
            if r.get("condition") == c.name
        )
        parts = (("need", True), ("seen", False)) if split else (("all", None),)
        if not c.tools:
            for part, need in parts:
                line(label, part, "accuracy", c.name, "accuracy", need)
            if guess is not None:
                lines.append(
                    f"{'':<22}{'(any)':<16}{'uniform guess':<17}{guess:>8.3f}{guess:>8.3f}"
                )
            continue
        for part, need in parts:
            for key, name in PAIRED_KEYS:
                line(label, part, name, c.name, key, need)
        line(label, "all", "format", c.name, "format_compliance", None)
        line(label, "all", "</think> closure", c.name, "think_closure_rate", None)
    return "\n".join(lines)
