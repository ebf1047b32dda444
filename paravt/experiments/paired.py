"""Protocol 5 of the collapse experiment: cold-start regimes against the arms, paired by seed
(``docs/collapse/protocol5/PREREGISTRATION.md``, issue 62).

    python -m paravt.experiments paired REGIME=DIR[,DIR...] [REGIME=...] [--k 32]
        [--json FILE] [--md FILE] [--cold-only]

Each ``DIR`` is a ``python -m paravt.experiments collapse`` folder (several per regime: one
seed each, run side by side), one regime per cold-start recipe (protocol 5: ``L=...`` and
``M=...``), run on the same seeds: the arms of a regime share each
seed's cold start, and the regimes share each seed's task instance and stage 1. Nothing is
re-evaluated: the numbers are the folders' own held-out rows, at one K (``--k``, 32):

- each seed's cold start (``OUT/cold/seedN/sft_eval``) and each finished arm run
  (``OUT/ARM/seedN``), by ``paravt.experiments.report.same_k``: call rate and accuracy on the
  prompts that need the tool at K and on the others, format compliance fτ, the tool-turn
  ``</think>`` closure; per arm run also the paper's own metric, the training κ (calls per
  rollout at the arm's own K) at the end (mean of the last 5 steps) over the start (step 1);
- the preconditions of :func:`preconditions` on the cold starts;
- **paired differences** (:func:`paired`): for two arms of one regime, or one arm in two
  regimes, the per-seed difference over the seeds both have, its mean and sample std, and
  whether it clears (mean > 2 × std, with at least 2 seeds): the arms share each seed's cold
  start, so the seeds' spread of the cold start no longer enters the comparison (protocol 4's
  bars compared each arm's own across-seed std, which it did);
- the bars of :func:`bars`, each judged so.

``--cold-only``: the cold starts and preconditions alone (the tuning seeds' check, before any
arm runs). Exit code 0 (a table printed), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from paravt.config import ConfigError
from paravt.experiments.arms import ARMS, run_finished
from paravt.experiments.report import same_k, seed_values
from paravt.log import get_logger
from paravt.metrics import json_safe, mean_or_nan, read_metrics, sample_std

log = get_logger(__name__)

NAN = float("nan")

#: The held-out values read per cold start and arm run (``report.SameK``'s fields).
KEYS = ("tool_rate_need", "acc_need", "tool_rate_no_need", "acc_no_need", "format")
KEYS += ("tool_turn_closure", "share_need")

#: The arms protocol 5 runs, in the tables' order.
P5_ARMS = ("vanilla", "gating", "paragrpo")


def regime_values(outs: Sequence[Path], k: int) -> dict[str, Any]:
    """One regime's folders read (several: one seed each, run side by side):
    ``{"cold": {seed: values}, "arms": {arm: {seed: values}}}`` (values: :data:`KEYS` at K =
    ``k`` and, for arm runs, ``kappa_start``, ``kappa_end`` and their ratio ``kappa_ratio``).
    Seeds with an evaluated cold start; finished arm runs only; a seed in two folders
    refused."""
    cold: dict[int, dict[str, float]] = {}
    arms: dict[str, dict[int, dict[str, float]]] = {}
    for out in outs:
        c, a = _folder_values(Path(out), k)
        if twice := set(c) & set(cold):
            raise ConfigError(f"{out}: seed {min(twice)} is in another folder of its regime too")
        cold |= c
        for arm, v in a.items():
            arms.setdefault(arm, {}).update(v)
    return {"cold": cold, "arms": arms}


def _folder_values(out: Path, k: int) -> tuple[dict[int, dict[str, float]], dict[str, Any]]:
    if not (out / "cold").is_dir():
        raise ConfigError(f"{out}: no cold/ folder (give python -m paravt.experiments collapse "
                          "output folders)")  # fmt: skip
    cold: dict[int, dict[str, float]] = {}
    for d in sorted((out / "cold").glob("seed*")):
        held = d / "sft_eval" / "heldout.jsonl"
        if d.name[4:].isdigit() and held.is_file():
            sk = same_k(read_metrics(held), [k])[str(k)]
            if sk.prompts:
                cold[int(d.name[4:])] = {key: getattr(sk, key) for key in KEYS}
    if not cold:
        raise ConfigError(f"{out}: no evaluated cold start at K = {k} (cold/seedN/sft_eval)")
    arms: dict[str, dict[int, dict[str, float]]] = {}
    for arm in ARMS:
        for seed in cold:
            run = out / arm / f"seed{seed}"
            if not run_finished(run):
                continue
            sk = same_k(read_metrics(run / "heldout.jsonl"), [k])[str(k)]
            sv = seed_values(read_metrics(run / "metrics.jsonl"), [k])
            ratio = sv.kappa_end / sv.kappa_start if sv.kappa_start else NAN
            arms.setdefault(arm, {})[seed] = {
                **{key: getattr(sk, key) for key in KEYS},
                "kappa_start": sv.kappa_start,
                "kappa_end": sv.kappa_end,
                "kappa_ratio": ratio,
            }
    return cold, arms


@dataclass(frozen=True)
class Paired:
    """A paired comparison: ``per_seed`` = a − b for each seed both have (NaN values left
    out), their mean and sample std (0 for one seed), and ``clears``: mean > 2 × std with at
    least two seeds (None: fewer than two)."""

    per_seed: dict[int, float]
    mean: float
    std: float
    clears: bool | None


def paired(a: dict[int, float], b: dict[int, float]) -> Paired:
    """a − b paired by seed (:class:`Paired`)."""
    d = {s: a[s] - b[s] for s in sorted(set(a) & set(b)) if a[s] == a[s] and b[s] == b[s]}
    xs = list(d.values())
    m, s = mean_or_nan(xs), sample_std(xs)
    return Paired(d, m, s, None if len(xs) < 2 else bool(m > 2 * s))


def _col(vals: dict[int, dict[str, float]], key: str) -> dict[int, float]:
    return {s: v[key] for s, v in vals.items()}


def _mean(vals: dict[int, dict[str, float]], key: str) -> float:
    return mean_or_nan([x for x in _col(vals, key).values() if x == x])


#: The preconditions' thresholds (the pre-registration's P1-P4).
L_CLOSURE_MAX = 0.15
M_CLOSURE = (0.2, 0.5)
CALL_MIN = 0.3
RIGHT_MIN = 0.7
READ_MIN = 0.8


def preconditions(regimes: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """P1-P4 on the cold starts (means over the regime's seeds, at the folders' K):

    - P1 (regime ``L``): tool-turn ``</think>`` closure ≤ :data:`L_CLOSURE_MAX`;
    - P2 (regime ``M``): tool-turn closure within :data:`M_CLOSURE`;
    - P3 (each regime): call rate on the needing prompts ≥ :data:`CALL_MIN` (tool use to lose);
    - P4 (each regime): a call is usually right: accuracy on the needing prompts ≥
      :data:`RIGHT_MIN` × the call rate on them (the overview alone answers them wrong);
    - P5 (each regime): the cold start reads the overview: accuracy on the prompts that do
      not need the tool ≥ :data:`READ_MIN` (reported per seed too: a stage 1 that did not
      learn to read the colour is a draw, as protocol 4's seed 601 was).

    Each ``{"id", "regime", "text", "value", "needed", "met"}`` (met None: a value missing)."""
    out: list[dict[str, Any]] = []

    def add(id_: str, regime: str, text: str, value: float, needed: str, ok: bool) -> None:
        out.append({"id": id_, "regime": regime, "text": text, "value": value,
                    "needed": needed, "met": None if value != value else ok})  # fmt: skip

    for name, r in regimes.items():
        cold = r["cold"]
        closure = _mean(cold, "tool_turn_closure")
        if name == "L":
            add("P1", name, "tool-turn closure", closure, f"<= {L_CLOSURE_MAX}",
                closure <= L_CLOSURE_MAX)  # fmt: skip
        if name == "M":
            lo, hi = M_CLOSURE
            add("P2", name, "tool-turn closure", closure, f"in [{lo}, {hi}]", lo <= closure <= hi)
        rate, acc = _mean(cold, "tool_rate_need"), _mean(cold, "acc_need")
        add("P3", name, "call rate, needing prompts", rate, f">= {CALL_MIN}", rate >= CALL_MIN)
        add("P4", name, "accuracy, needing prompts (vs the call rate)", acc,
            f">= {RIGHT_MIN} x {rate:.3f}", acc >= RIGHT_MIN * rate)  # fmt: skip
        read = _mean(cold, "acc_no_need")
        per = ", ".join(f"{s}: {v['acc_no_need']:.2f}" for s, v in sorted(cold.items()))
        add("P5", name, f"accuracy, prompts not needing the tool (per seed {per})", read,
            f">= {READ_MIN}", read >= READ_MIN)  # fmt: skip
    return out


def bars(regimes: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The pre-registered questions, each a paired difference that clears or not
    (:func:`paired`), on the needing prompts at the folders' K unless said:

    - Q1 (does the cold start's closure support decide?): each arm's call rate, regime M − L;
    - Q2 (does PARA-GRPO keep what vanilla loses?): PARA-GRPO − vanilla, call rate and
      accuracy, per regime;
    - Q3 (the anchor or gating?): PARA-GRPO − gating and gating − vanilla, call rate and
      accuracy, per regime;
    - Q4 (format where calls survive): PARA-GRPO − vanilla and PARA-GRPO − gating in fτ and
      tool-turn closure, per regime, judged only where both arms' mean call rate on the
      needing prompts is ≥ 0.2 (else ``clears`` None, ``why`` says so).

    Each ``{"id", "what", "regime", "a", "b", "key", "per_seed", "mean", "std", "clears"}``."""
    out: list[dict[str, Any]] = []

    def add(id_: str, regime: str, a: dict, b: dict, key: str, what: str, **kw: Any) -> None:
        p = paired(_col(a, key), _col(b, key))
        row = {"id": id_, "what": what, "regime": regime, "key": key, **asdict(p), **kw}
        out.append(row)

    if "L" in regimes and "M" in regimes:
        for arm in P5_ARMS:
            a, b = regimes["M"]["arms"].get(arm, {}), regimes["L"]["arms"].get(arm, {})
            add("Q1", "M-L", a, b, "tool_rate_need", f"{arm}: M - L")
    for name, r in regimes.items():
        arms = r["arms"]
        van, gat, par = (arms.get(a, {}) for a in ("vanilla", "gating", "paragrpo"))
        for key in ("tool_rate_need", "acc_need"):
            add("Q2", name, par, van, key, "PARA-GRPO - vanilla")
        for key in ("tool_rate_need", "acc_need"):
            add("Q3", name, par, gat, key, "PARA-GRPO - gating")
            add("Q3", name, gat, van, key, "gating - vanilla")
        for other, label in ((van, "vanilla"), (gat, "gating")):
            survive = min(_mean(par, "tool_rate_need"), _mean(other, "tool_rate_need"))
            for key in ("format", "tool_turn_closure"):
                add("Q4", name, par, other, key, f"PARA-GRPO - {label}")
                if not survive >= 0.2:
                    out[-1]["clears"] = None
                    out[-1]["why"] = f"calls did not survive (min call rate {survive:.2f})"
    return out


def paired_report(
    dirs: dict[str, Sequence[Path]], k: int = 32, cold_only: bool = False
) -> dict[str, Any]:
    """Read every regime's folder and judge (module docstring): ``{"k", "regimes": {name:
    {"dir", "seeds", "cold", "arms", "collapsed"}}, "preconditions", "bars"}``; ``collapsed``:
    per arm, whether its mean call rate on the needing prompts after RL is ≤ 0.5 × the cold
    start's (protocol 3's a1, per regime)."""
    regimes = {n: regime_values(d, k) for n, d in dirs.items()}
    if cold_only:
        for r in regimes.values():
            r["arms"] = {}
    res: dict[str, Any] = {"k": k, "regimes": {}}
    for n, r in regimes.items():
        start = _mean(r["cold"], "tool_rate_need")
        collapsed = {a: _mean(v, "tool_rate_need") <= 0.5 * start for a, v in r["arms"].items()}
        res["regimes"][n] = {"dirs": [str(d) for d in dirs[n]], "seeds": sorted(r["cold"]), **r,
                             "collapsed": collapsed}  # fmt: skip
    res["preconditions"] = preconditions(regimes)
    res["bars"] = [] if cold_only else bars(regimes)
    return res


def _f(x: Any) -> str:
    return "n/a" if not isinstance(x, (int, float)) or x != x else f"{x:.3f}"


def _ms(vals: dict[int, dict[str, float]], key: str) -> str:
    xs = [v[key] for v in vals.values() if v[key] == v[key]]
    return "n/a" if not xs else f"{mean_or_nan(xs):.2f} ± {sample_std(xs):.2f}"


def markdown(res: dict[str, Any]) -> str:
    """The tables: per regime the cold start and each arm (mean ± std over seeds, and per
    seed), the preconditions, and the paired bars."""
    k = res["k"]
    cols = (("tool_rate_need", "call rate, need"), ("acc_need", "accuracy, need"),
            ("tool_rate_no_need", "call rate, no need"), ("acc_no_need", "accuracy, no need"),
            ("format", "fτ"), ("tool_turn_closure", "tool-turn closure"))  # fmt: skip
    lines = [f"# Collapse, protocol 5: paired by seed (held out, K = {k})", ""]
    for n, r in res["regimes"].items():
        where = ", ".join(r["dirs"])
        lines += [f"## Regime {n} ({where}; seeds {', '.join(map(str, r['seeds']))})", ""]
        head = "| | " + " | ".join(h for _, h in cols) + " | κ end/start (training) | collapsed |"
        lines += [head, "|---" * (len(cols) + 3) + "|"]
        rows = [("cold start", r["cold"])] + [(a, r["arms"][a]) for a in ARMS if a in r["arms"]]
        for name, vals in rows:
            kap = _ms(vals, "kappa_ratio") if name != "cold start" else ""
            col = "" if name == "cold start" else ("yes" if r["collapsed"][name] else "no")
            lines.append(f"| {name} | " + " | ".join(_ms(vals, c) for c, _ in cols)
                         + f" | {kap} | {col} |")  # fmt: skip
        lines += ["", "Per seed (call rate / accuracy on the needing prompts; tool-turn closure):",
                  "", "| | " + " | ".join(f"seed {s}" for s in r["seeds"]) + " |",
                  "|---" * (len(r["seeds"]) + 1) + "|"]  # fmt: skip
        for name, vals in rows:
            cells = []
            for s in r["seeds"]:
                v = vals.get(s)
                cells.append("-" if v is None else f"{_f(v['tool_rate_need'])} / "
                             f"{_f(v['acc_need'])}; {_f(v['tool_turn_closure'])}")  # fmt: skip
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Preconditions (the cold starts, mean over seeds)", "",
              "| | regime | value | needed | met |", "|---|---|---|---|---|"]  # fmt: skip
    for p in res["preconditions"]:
        met = {True: "**met**", False: "not met", None: "n/a"}[p["met"]]
        lines.append(f"| {p['id']} {p['text']} | {p['regime']} | {_f(p['value'])} | "
                     f"{p['needed']} | {met} |")  # fmt: skip
    if res["bars"]:
        lines += ["", "## Bars (paired by seed: mean > 2 × std of the per-seed differences)", "",
                  "| | comparison | regime | on | per seed | mean | std | clears |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for b in res["bars"]:
            per = ", ".join(f"{s}: {v:+.3f}" for s, v in b["per_seed"].items()) or "-"
            ok = {True: "**yes**", False: "no", None: "n/a"}[b["clears"]]
            if b.get("why"):
                ok += f" ({b['why']})"
            lines.append(f"| {b['id']} | {b['what']} | {b['regime']} | {b['key']} | {per} | "
                         f"{_f(b['mean'])} | {_f(b['std'])} | {ok} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _regime_arg(raw: str) -> tuple[str, list[Path]]:
    name, sep, d = raw.partition("=")
    dirs = [Path(x) for x in d.split(",") if x]
    if not sep or not name or not dirs:
        raise ConfigError(f"{raw!r}: give REGIME=DIR[,DIR...], e.g. L=runs/p5/L")
    return name, dirs


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m paravt.experiments paired``: 0 (the table printed), 2 bad input."""
    p = argparse.ArgumentParser(
        prog="python -m paravt.experiments paired", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("regimes", nargs="+", help="REGIME=DIR: collapse folders, one per regime")
    p.add_argument("--k", type=int, default=32, help="the overview budget judged (held out)")
    p.add_argument("--cold-only", action="store_true", help="cold starts and preconditions")
    p.add_argument("--json", default="", help="also write the result here")
    p.add_argument("--md", default="", help="also write the table here")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        dirs = dict(_regime_arg(r) for r in args.regimes)
        if len(dirs) != len(args.regimes):
            raise ConfigError("a regime is named twice")
        res = paired_report(dirs, args.k, args.cold_only)
    except ConfigError as e:
        log.error(f"error: {e}")
        return 2
    md = markdown(res)
    print(md, end="")
    if args.json:
        Path(args.json).write_text(json.dumps(json_safe(res), indent=1) + "\n")
    if args.md:
        Path(args.md).write_text(md)
    return 0
