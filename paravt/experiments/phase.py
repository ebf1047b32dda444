"""The collapse experiment's phase diagram over (u, q) (issue 38, item 7): what protocol 3
reports when the same-K collapse does not appear.

    python -m paravt.experiments phase DIR [DIR ...] [--out runs/phase]

Each ``DIR`` is one finished ``python -m paravt.experiments collapse`` folder: one cell, its
cold start trained with a share u of unclosed tool turns (``--unclosed-think``) on a task with a
share q of decoyed videos (``data.synth_decoy_share``; the overview at K = 32 shows a wrong
colour there). Nothing is trained here: every number is read from the cell's ``collapse.json``
(which reads the arm runs' own ``metrics.jsonl`` / ``heldout.jsonl``). Per cell:

- **the sign of the tool-vs-no-tool advantage at K = 32**: in the arms that train at K = 32
  only (``vanilla``, ``vanilla_ref``), the mean over the steps with a group holding rollouts
  with and without a crop of A(tool) - A(no tool) (``adv/tool``, ``adv/no_tool``): negative,
  GRPO pushes away from calling at K = 32;
- **every arm's final same-K tool rate** (and accuracy), at each evaluated K, on the prompts
  whose overview hides the need (``need_K{K}``) and on the others, next to the cold start's.

Writes ``OUT/phase.json`` and ``OUT/phase.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from paravt.config import ConfigError
from paravt.data.synth import SPOT_DECOY_SHARE
from paravt.experiments.report import CollapseResult, MeanStd
from paravt.files import write_atomic
from paravt.log import get_logger
from paravt.metrics import json_safe

log = get_logger(__name__)

#: The arms whose every step trains at K = 32 (gating off): their mixed groups give the sign.
UNGATED = ("vanilla", "vanilla_ref")
#: Same-K values shown per arm and cold start.
KEYS = ("tool_rate_need", "tool_rate_no_need", "acc_need", "acc_no_need")
NAN = float("nan")


def _mean(ms: MeanStd | None) -> float:
    """The mean of ``ms`` (NaN when missing)."""
    return NAN if ms is None else ms.mean


def advantage_sign(adv_tool: float, adv_no_tool: float, mixed_steps: float) -> str:
    """``+`` when tool rollouts out-score no-tool ones in mixed groups, ``-`` when they lose,
    ``0`` on a tie, ``n/a`` without a mixed step (nothing to compare: no rollout called, or
    every one did)."""
    if not mixed_steps or adv_tool != adv_tool or adv_no_tool != adv_no_tool:
        return "n/a"
    d = adv_tool - adv_no_tool
    return "+" if d > 0 else "-" if d < 0 else "0"


def _manifest_q(cell_dir: Path, task: str | None, seeds: Sequence[int] | None) -> float | None:
    """q of a ``collapse.json`` written before it recorded one (its ``task`` and ``seeds``):
    from the task's own manifest (``DIR/data/seedN/manifest.json``; one written before
    ``data.synth_decoy_share`` existed had the fixed ``SPOT_DECOY_SHARE``)."""
    if task != "spot_decoy":
        return None
    qs = set()
    for seed in seeds or []:
        path = cell_dir / "data" / f"seed{seed}" / "manifest.json"
        if path.is_file():
            qs.add(json.loads(path.read_text())["params"].get("decoy_share", SPOT_DECOY_SHARE))
    if len(qs) != 1:
        raise ConfigError(
            f"{cell_dir}: collapse.json records no q (data.synth_decoy_share) and its tasks' "
            f"manifests give {sorted(qs) or 'none'}; rerun the collapse into it"
        )
    return float(qs.pop())


def read_cell(path: Path, name: str = "") -> CollapseResult:
    """A cell's ``collapse.json`` (``path``), typed; ``ConfigError`` unless it is protocol 3's
    (``arms`` and ``same_k_start`` present)."""
    res = json.loads(path.read_text())
    if "arms" not in res or "same_k_start" not in res:
        raise ConfigError(
            f"{name or 'cell'}: not a collapse.json of protocol 3 (no 'arms' / 'same_k_start'); "
            "rerun python -m paravt.experiments collapse into it"
        )
    return CollapseResult.from_dict(res)


def cell(res: CollapseResult, name: str = "") -> dict[str, Any]:
    """One cell of the diagram from a ``collapse.json`` read back (:func:`read_cell`; see the
    module docstring); ``name``: its folder."""
    ks = [str(k) for k in res.same_ks or res.eval_k]
    adv = {}
    for arm in UNGATED:
        a = res.arms.get(arm)
        if a is None:
            continue
        t, n, m = a.adv_tool_mixed.mean, a.adv_no_tool_mixed.mean, a.mixed_steps.mean
        adv[arm] = {
            "adv_tool": t,
            "adv_no_tool": n,
            "diff": t - n,
            "mixed_steps": m,
            "sign": advantage_sign(t, n, m),
        }

    def values(by_k: dict[str, Any], k: str, keys: Sequence[str]) -> dict[str, float]:
        v = by_k.get(k)
        return {key: _mean(None if v is None else getattr(v, key)) for key in keys}

    start = {k: values(res.same_k_start, k, KEYS) for k in ks}
    arms = {arm: {k: values(a.same_k, k, KEYS) for k in ks} for arm, a in res.arms.items()}
    share = {k: values(res.same_k_start, k, ("share_need",))["share_need"] for k in ks}
    run = res.run
    if run is not None and run.q_recorded:
        q = run.decoy_share
    else:  # written before collapse.json recorded q
        task, seeds = (run.task, run.seeds) if run is not None else (None, None)
        q = _manifest_q(Path(name), task, seeds) if name else None
    return {
        "name": name,
        "u": None if run is None else run.unclosed_think,
        "q": q,
        "task": None if run is None else run.task,
        "seeds": None if run is None else run.seeds,
        "ks": [int(k) for k in ks],
        "share_need": share,
        "adv_k32": adv,
        "cold_start": start,
        "arms": arms,
    }


def phase_diagram(dirs: Sequence[str | Path]) -> dict[str, Any]:
    """Every cell of ``dirs`` (collapse folders), sorted by (u, q)."""
    cells = []
    for d in dirs:
        path = Path(d) / "collapse.json"
        if not path.is_file():
            raise ConfigError(
                f"{d}: no collapse.json (run python -m paravt.experiments collapse --out {d} "
                "first, to its end)"
            )
        cells.append(cell(read_cell(path, str(d)), str(d)))
    cells.sort(key=lambda c: (c["u"] if c["u"] is not None else -1, c["q"] or 0.0, c["name"]))
    return {"cells": cells}


def _f(x: float) -> str:
    return "n/a" if x != x else f"{x:.2f}"


def format_markdown(ph: dict[str, Any]) -> str:
    """``phase.md``: per cell the K = 32 advantage sign, then per K every arm's same-K tool
    rate (needs tool / does not) and accuracy on the prompts that need it."""
    cells = ph["cells"]
    lines = ["# Collapse phase diagram over (u, q)", ""]
    lines += [
        "Tool-vs-no-tool advantage at K = 32 (arms that train at K = 32 only; mean over the "
        "steps with a mixed group of A(tool) - A(no tool), its sign, and the number of such "
        "steps):",
        "",
        "| u | q | seeds | " + " | ".join(f"{a}: A(tool) - A(no tool)" for a in UNGATED) + " |",
        "|" + "---|" * (3 + len(UNGATED)),
    ]
    for c in cells:
        row = [str(c["u"]), str(c["q"]), ",".join(map(str, c["seeds"] or []))]
        for arm in UNGATED:
            a = c["adv_k32"].get(arm)
            row.append(
                "not run"
                if a is None
                else f"{a['sign']} ({_f(a['diff'])}, {a['mixed_steps']:.0f} steps)"
            )
        lines.append("| " + " | ".join(row) + " |")
    ks = sorted({k for c in cells for k in c["ks"]}, reverse=True)
    arms = list(dict.fromkeys(a for c in cells for a in c["arms"]))
    for k in ks:
        lines += [
            "",
            f"Same K = {k}, held out, after RL (cold start: before RL). Each entry: tool rate on "
            "the prompts that need the tool / on the others; accuracy on those that need it:",
            "",
            "| u | q | share need | cold start | " + " | ".join(arms) + " |",
            "|" + "---|" * (4 + len(arms)),
        ]
        for c in cells:
            if k not in c["ks"]:
                continue

            def entry(v: dict[str, float] | None) -> str:
                if v is None:
                    return "not run"
                return (
                    f"{_f(v['tool_rate_need'])} / {_f(v['tool_rate_no_need'])}; {_f(v['acc_need'])}"
                )

            row = [str(c["u"]), str(c["q"]), _f(c["share_need"][str(k)])]
            row.append(entry(c["cold_start"][str(k)]))
            row += [entry(c["arms"].get(a, {}).get(str(k))) for a in arms]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m paravt.experiments phase DIR ...``: 0 written, 2 bad input."""
    p = argparse.ArgumentParser(
        prog="python -m paravt.experiments phase", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("dirs", nargs="+", help="finished collapse folders, one per (u, q) cell")
    p.add_argument("--out", default="runs/phase", help="writes OUT/phase.{json,md}")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        ph = phase_diagram(args.dirs)
    except ConfigError as e:
        log.error(f"error: {e}")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = format_markdown(ph)
    write_atomic(out / "phase.json", json.dumps(json_safe(ph), indent=1, allow_nan=False) + "\n")
    write_atomic(out / "phase.md", md + "\n")
    print(md)  # the command's result (stdout)
    return 0
