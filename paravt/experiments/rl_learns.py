"""Does RL beat its own cold start? Before/after RL on held-out "spot" prompts, split by need,
over finished training runs (seeds).

    python -m paravt.experiments rl-learns RUN_DIR [RUN_DIR ...] [--json FILE]

Each run folder is a ``python -m paravt.train`` run whose ``train.eval_conditions`` hold tool
conditions (``K:tools``, ``K:tools:greedy``): its ``metrics.jsonl`` already carries the
``eval_before`` (the cold start) and ``eval_after`` (the last RL step) rows, split by need
(``paravt.eval.heldout.need_split``: ``need`` = the K-frame overview misses the square, only a
crop can answer; ``seen`` = it shows it). Nothing is re-evaluated. Per run and condition:

- on the needing prompts: call rate, calls per rollout, accuracy, format and ``</think>``
  closure before and after, and the differences;
- the same on the other prompts;
- the bars of :func:`bars` (issue 60's), each passed or failed.

Then the mean and sample standard deviation of each over the runs (n = the number of runs,
i.e. seeds; a run is one seed's videos, cold start and RL). The README's default table and
``docs/default_run.md`` come from this command.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paravt.config import ConfigError
from paravt.experiments.tools_pay import mean_std
from paravt.log import get_logger
from paravt.metrics import read_metrics

log = get_logger(__name__)

#: The per-part metrics read (``{condition}/{need|seen}/{key}``), as ``NEED_KEYS`` writes them.
PART_KEYS = ("tool_call_rate", "tool_calls_per_rollout", "accuracy", "format_compliance")
PART_KEYS += ("think_closure_rate", "prompts")


@dataclass(frozen=True)
class Bars:
    """What "RL beats its cold start" means, per run and condition (issue 60): on the prompts
    that need the tool the call rate rises by ``need_call_gain`` and the accuracy by
    ``need_acc_gain``; on the others the call rate after RL is at most ``seen_call_max`` and
    the accuracy falls by at most ``seen_acc_drop`` (so "always call" fails)."""

    need_call_gain: float = 0.3
    need_acc_gain: float = 0.2
    seen_call_max: float = 0.15
    seen_acc_drop: float = 0.05


def bars(
    before: dict[str, float], after: dict[str, float], cond: str, b: Bars = Bars()
) -> dict[str, tuple[float, bool]]:
    """``{bar: (value, passed)}`` for condition ``cond`` (e.g. ``K4_tools``) from a run's
    ``eval_before`` and ``eval_after`` rows. A part without prompts (no needing prompt at this
    K) is left out: its bars cannot be judged."""

    def get(row: dict[str, float], part: str, key: str) -> float:
        v = row.get(f"{cond}/{part}/{key}")
        return float("nan") if v is None else float(v)

    out: dict[str, tuple[float, bool]] = {}
    if get(after, "need", "prompts") > 0:
        d_call = get(after, "need", "tool_call_rate") - get(before, "need", "tool_call_rate")
        d_acc = get(after, "need", "accuracy") - get(before, "need", "accuracy")
        out["need_call_gain"] = (d_call, d_call >= b.need_call_gain)
        out["need_acc_gain"] = (d_acc, d_acc >= b.need_acc_gain)
    if get(after, "seen", "prompts") > 0:
        call = get(after, "seen", "tool_call_rate")
        d_acc = get(after, "seen", "accuracy") - get(before, "seen", "accuracy")
        out["seen_call_after"] = (call, call <= b.seen_call_max)
        out["seen_acc_change"] = (d_acc, d_acc >= -b.seen_acc_drop)
    return out


def _eval_row(rows: list[dict[str, Any]], kind: str, run: Path) -> dict[str, float]:
    found = [r for r in rows if r.get("kind") == kind]
    if not found:
        raise ConfigError(
            f"{run}: metrics.jsonl has no {kind} row (a run with train.eval_prompts > 0 that "
            "finished, evaluated before RL: train.eval_before=true)"
        )
    return {k: v for k, v in found[-1].items() if isinstance(v, (int, float))}


def run_numbers(before: dict[str, float], after: dict[str, float], cond: str) -> dict[str, float]:
    """One run's numbers for condition ``cond``: ``{part}/{key}/{before|after|diff}`` for
    ``part`` in need, seen and ``key`` in ``PART_KEYS``, and ``bar/{name}`` 1.0 / 0.0."""
    out: dict[str, float] = {}
    for part in ("need", "seen"):
        for key in PART_KEYS:
            b, a = before.get(f"{cond}/{part}/{key}"), after.get(f"{cond}/{part}/{key}")
            if a is None or b is None:
                continue
            out[f"{part}/{key}/before"] = float(b)
            out[f"{part}/{key}/after"] = float(a)
            out[f"{part}/{key}/diff"] = float(a) - float(b)
    for name, (_, ok) in bars(before, after, cond).items():
        out[f"bar/{name}"] = float(ok)
    return out


def conditions_of(row: dict[str, float]) -> list[str]:
    """The tool conditions of an evaluation row that are split by need, in logged order."""
    seen: list[str] = []
    for k in row:
        head, _, rest = k.partition("/")
        if rest.startswith("need/") and "_tools" in head and head not in seen:
            seen.append(head)
    return seen


def rl_learns(runs: Sequence[str | Path]) -> dict[str, Any]:
    """Read each run (module docstring); ``{"conditions": {cond: {"runs": {run: numbers},
    "mean": {...}, "std": {...}, "passed": all bars of every run}}}``."""
    per: dict[str, dict[str, dict[str, float]]] = {}
    for r in runs:
        run = Path(r)
        if not (run / "metrics.jsonl").is_file():
            raise ConfigError(f"{run}: no metrics.jsonl (give python -m paravt.train run folders)")
        rows = read_metrics(run / "metrics.jsonl")
        before, after = _eval_row(rows, "eval_before", run), _eval_row(rows, "eval_after", run)
        conds = conditions_of(after)
        if not conds:
            raise ConfigError(
                f"{run}: its evaluation has no tool condition split by need (a spot task run "
                "with train.eval_conditions holding 'K:tools')"
            )
        for c in conds:
            per.setdefault(c, {})[str(run)] = run_numbers(before, after, c)
    out: dict[str, Any] = {}
    for c, by_run in per.items():
        keys = sorted({k for p in by_run.values() for k in p})
        stats = {k: mean_std([p[k] for p in by_run.values() if k in p]) for k in keys}
        out[c] = {
            "runs": by_run,
            "mean": {k: m for k, (m, _) in stats.items()},
            "std": {k: s for k, (_, s) in stats.items()},
            "passed": all(v == 1.0 for p in by_run.values() for k, v in p.items() if "bar/" in k),
        }
    return {"conditions": out, "n_runs": len(runs)}


#: The table's columns: (numbers key, header).
COLUMNS = (
    ("need/tool_call_rate", "need: call rate"),
    ("need/accuracy", "need: accuracy"),
    ("seen/tool_call_rate", "seen: call rate"),
    ("seen/accuracy", "seen: accuracy"),
)


def markdown(res: dict[str, Any]) -> str:
    """Per condition, one row per run (before -> after, the difference) and mean +- std."""
    lines: list[str] = []
    for c, r in res["conditions"].items():
        lines += [f"**{c}** (bars {'passed' if r['passed'] else 'FAILED'})", ""]
        lines.append("| run | " + " | ".join(h for _, h in COLUMNS) + " | bars |")
        lines.append("|---" * (len(COLUMNS) + 2) + "|")
        for run, p in r["runs"].items():
            cells = [
                f"{p[k + '/before']:.3f} -> {p[k + '/after']:.3f} ({p[k + '/diff']:+.3f})"
                if k + "/before" in p
                else "-"
                for k, _ in COLUMNS
            ]
            failed = [k[4:] for k, v in p.items() if k.startswith("bar/") and v != 1.0]
            lines.append(f"| {run} | " + " | ".join(cells) + f" | {','.join(failed) or 'ok'} |")
        m, s = r["mean"], r["std"]
        cells = [
            f"{m[k + '/before']:.3f} -> {m[k + '/after']:.3f} "
            f"({m[k + '/diff']:+.3f} +- {s[k + '/diff']:.3f})"
            if k + "/before" in m
            else "-"
            for k, _ in COLUMNS
        ]
        lines += ["| mean +- std | " + " | ".join(cells) + " | |", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m paravt.experiments rl-learns``: 0 every bar passed, 1 a bar failed, 2 bad
    input."""
    p = argparse.ArgumentParser(
        prog="python -m paravt.experiments rl-learns", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("runs", nargs="+", help="python -m paravt.train run folders (one per seed)")
    p.add_argument("--json", default="", help="also write the result here")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        res = rl_learns(args.runs)
    except ConfigError as e:
        log.error(f"error: {e}")
        return 2
    print(markdown(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0 if all(r["passed"] for r in res["conditions"].values()) else 1
