"""Do the tools pay? Greedy K-frame accuracy with and without tools on held-out "spot"
prompts, split by need, over finished training runs (seeds, settings).

    python -m paravt.experiments tools-pay RUN_DIR [RUN_DIR ...] [--k 4] [--model sft|final]
        [--json FILE]

For each training run folder (``python -m paravt.train``'s ``train.out_dir``: its
``config.yaml``, its cold start ``sft/`` and its checkpoints) it evaluates the model
(``--model final``: the newest checkpoint; ``sft``: the cold start) on the run's own held-out
split with ``python -m paravt.eval --benchmark synth --frames K`` (greedy, the evaluation's
default) twice: with tools, and with the answer forced at once (``agent.max_turns=0``). Each
evaluation is written under ``RUN_DIR/tools_pay/`` and resumed by a rerun. Then per run, on
the prompts whose K-frame overview misses the square (``need_K{K}``) and on the others:

- accuracy with tools, without, and their difference (what a call is worth);
- the call rate, and the copy rate: of the calls whose first summary named the right colour,
  the share whose answer carries that colour (``paravt.experiments.tool_path``);

and the mean and standard deviation of each over the runs (the README's default table). The
standard deviation is over runs (n - 1 in the denominator), 0 for one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from paravt.checkpoint import latest_checkpoint
from paravt.config import ConfigError, load_config
from paravt.experiments.tool_path import tool_path
from paravt.log import get_logger
from paravt.metrics import read_metrics

log = get_logger(__name__)

#: The per-run numbers, in the order of the printed table.
KEYS = (
    "n_need",
    "acc_tools_need",
    "acc_notools_need",
    "gain_need",
    "call_rate_need",
    "copy_rate_need",
    "acc_tools_all",
    "acc_notools_all",
    "gain_all",
)


def _model(run: Path, which: str) -> Path:

    if which == "sft":
        m = run / "sft"
        if not (m / "config.json").is_file():
            raise ConfigError(f"{run}: no cold start sft/ (a run with sft.steps > 0?)")
        return m
    ck = latest_checkpoint(run)
    if ck is None:
        raise ConfigError(f"{run}: no checkpoint (is the run finished?)")
    return ck


def _evaluate(run: Path, model: Path, k: int, tools: bool, out: Path) -> list[dict[str, Any]]:
    """``python -m paravt.eval`` of ``model`` with the run's config, into ``out``."""
    cmd = [
        sys.executable, "-m", "paravt.eval", "--benchmark", "synth", "--frames", str(k),
        "--model", str(model), "--config", str(run / "config.yaml"), "--out", str(out),
    ]  # fmt: skip
    if not tools:
        cmd.append("agent.max_turns=0")
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return read_metrics(out / "results.jsonl")


def run_numbers(
    tools_rows: list[dict[str, Any]],
    notools_rows: list[dict[str, Any]],
    val: dict[str, dict[str, Any]],
    k: int,
) -> dict[str, float]:
    """The per-run numbers of the module docstring from the two evaluations' rows and the task's
    val rows (by id)."""
    tp = tool_path(tools_rows, val, k)
    need = {r["id"] for r in tools_rows if val[r["id"]].get(f"need_K{k}")}

    def acc(rows: list[dict[str, Any]], ids: set[str] | None) -> float:
        sel = [r for r in rows if ids is None or r["id"] in ids]
        return sum(bool(r.get("correct")) for r in sel) / max(len(sel), 1)

    c = tp["need"]
    out = {
        "n_need": float(len(need)),
        "acc_tools_need": acc(tools_rows, need),
        "acc_notools_need": acc(notools_rows, need),
        "call_rate_need": c.called / max(c.n, 1),
        "copy_rate_need": c.copied_right / c.summary_right if c.summary_right else 0.0,
        "acc_tools_all": acc(tools_rows, None),
        "acc_notools_all": acc(notools_rows, None),
    }
    out["gain_need"] = out["acc_tools_need"] - out["acc_notools_need"]
    out["gain_all"] = out["acc_tools_all"] - out["acc_notools_all"]
    return out


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def tools_pay(runs: Sequence[str | Path], k: int = 4, which: str = "final") -> dict[str, Any]:
    """Evaluate each run (see the module docstring) and return ``{"runs": {run: numbers},
    "mean": {...}, "std": {...}}``."""
    per: dict[str, dict[str, float]] = {}
    for r in runs:
        run = Path(r)
        if not (run / "config.yaml").is_file():
            raise ConfigError(f"{run}: no config.yaml (give python -m paravt.train run folders)")
        cfg = load_config("tiny_cpu", [str(run / "config.yaml")])
        data = Path(cfg.data.synth_dir)
        if cfg.data.path or not (data / "val.jsonl").is_file():
            raise ConfigError(f"{run}: trained on no synthetic task folder with a val.jsonl")
        val = {v["id"]: v for v in read_metrics(data / "val.jsonl")}
        model = _model(run, which)
        base = run / "tools_pay" / f"{which}_K{k}"
        with_tools = _evaluate(run, model, k, True, base / "tools")
        without = _evaluate(run, model, k, False, base / "notools")
        per[str(run)] = run_numbers(with_tools, without, val, k)
        # progress on stderr: stdout is the Markdown result
        print(f"[tools-pay] {run}: " + json.dumps(per[str(run)]), file=sys.stderr, flush=True)
    stats = {key: mean_std([p[key] for p in per.values()]) for key in KEYS}
    return {
        "k": k,
        "model": which,
        "runs": per,
        "mean": {key: m for key, (m, _) in stats.items()},
        "std": {key: s for key, (_, s) in stats.items()},
    }


def markdown(res: dict[str, Any]) -> str:
    """The result as a Markdown table: one row per run, then mean +- std."""
    lines = ["| run | " + " | ".join(KEYS) + " |", "|---" * (len(KEYS) + 1) + "|"]
    for run, p in res["runs"].items():
        lines.append(f"| {run} | " + " | ".join(f"{p[key]:.3f}" for key in KEYS) + " |")
    m, s = res["mean"], res["std"]
    lines.append(
        "| mean +- std | " + " | ".join(f"{m[key]:.3f} +- {s[key]:.3f}" for key in KEYS) + " |"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m paravt.experiments tools-pay``: 0 printed, 1 an evaluation failed, 2 bad
    input."""
    p = argparse.ArgumentParser(
        prog="python -m paravt.experiments tools-pay", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("runs", nargs="+", help="python -m paravt.train run folders")
    p.add_argument("--k", type=int, default=4, help="overview budget K")
    p.add_argument("--model", default="final", choices=("final", "sft"))
    p.add_argument("--json", default="", help="also write the result here")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        res = tools_pay(args.runs, args.k, args.model)
    except ConfigError as e:
        log.error(f"error: {e}")
        return 2
    except RuntimeError as e:
        log.error(f"error: {e}")
        return 1
    print(markdown(res))  # the command's result (stdout)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0
