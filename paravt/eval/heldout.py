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
from paravt.distributed import all_gather_objects, shard_list
from paravt.eval.conditions import eval_conditions
from paravt.log import get_logger
from paravt.metrics import TABLE_ROWS, clustered_mean_ci95, rollout_metrics, trajectory_record
from paravt.rewards import score_groups

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
    for name, _, tools in eval_conditions(cfg):
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
    tr: Any, seed: int, per_prompt: list[dict[str, Any]] | None = None, label: str = "held-out"
) -> dict[str, float]:
    """Roll out the validation prompts under each ``train.eval_conditions`` entry
    (``eval_samples`` each, rollout temperature, one fixed seed for every condition) and score
    them: the before/after numbers of the final table. ``tr``: the run's
    ``paravt.trainer.Trainer`` (its config, distributed context, policy, agent runner and
    ``val_samples``).

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
    cfg = tr.cfg
    t0, n_conds = time.perf_counter(), len(eval_conditions(cfg))
    if not tr.val_samples:
        return {}
    n = len(tr.val_samples) - len(tr.val_samples) % tr.ctx.world_size
    mine = shard_list(tr.val_samples[:n], tr.ctx)
    tr.policy.eval()
    out: dict[str, float] = {}
    for i, (name, k, tools) in enumerate(eval_conditions(cfg)):
        runner = tr.runner
        if not tools:  # the answer is forced in the first turn: no tool round
            no_tools = replace(cfg, agent=replace(cfg.agent, max_turns=0))
            runner = AgentRunner(runner.engine, runner.bundle, no_tools, planner=runner.planner)
        groups = runner.rollout(
            mine, [k] * len(mine), group_size=cfg.train.eval_samples, seed=stable_seed("eval", seed)
        )
        score_groups(groups, cfg.reward)
        dt, t0 = time.perf_counter() - t0, time.perf_counter()
        log.info(f"[eval] {label}: condition {i + 1}/{n_conds} {name} done ({dt:.0f} s)")
        recs, rows = [], []
        for g in groups:
            mine_g = []
            for t in g.trajectories:
                r = trajectory_record(t, g.num_frames)
                r["prompt"] = g.sample.id
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
        recs = [r for part in all_gather_objects(recs, tr.ctx) for r in part]
        if per_prompt is not None:
            per_prompt += [r for part in all_gather_objects(rows, tr.ctx) for r in part]
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
    return out
