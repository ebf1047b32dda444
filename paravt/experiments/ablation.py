"""``python -m paravt.experiments ablation`` — the PARA-GRPO ablation, every arm from one SFT.
(``python -m paravt.experiments collapse``: the collapse experiment,
``paravt/experiments/collapse.py``.)

    python -m paravt.experiments ablation [--seeds 3] [--arms a,b,...] [--out runs/ablation]
        [--preset tiny_cpu] [--config F.yaml ...] [--eval-k 4,32] [key=value ...]

1. One SFT cold start (``sft.*`` of the config) into ``OUT/sft``.
2. Every arm × seed is one ``python -m paravt.train`` run from that checkpoint (``model.path``,
   ``sft.steps=0``, ``train.seed``) into ``OUT/ARM/seedN`` (its log in ``train.log``), with the
   arm's overrides (``paravt.experiments.arms``) on top of the config (default ``--arms``:
   all but ``vanilla_ref``):

   - ``vanilla``: no anchoring, no gating (every prompt sees the largest budget);
   - ``vanilla_ref``: the reference implementation's vanilla (``paravt.experiments.arms``);
   - ``anchoring``: anchoring only (no gating);
   - ``gating``: gating only (no anchoring);
   - ``paragrpo``: both (the config as given);
   - ``paragrpo_no_rtool``: both, without the tool reward R_tool (``reward.tool_bonus=0``).

   Each run evaluates the held-out prompts at ``K:tools`` for each ``--eval-k``.
3. ``OUT/ablation.md`` (printed), ``OUT/ablation.json`` (per seed and aggregated) and
   ``OUT/ablation.png`` (per-step curves, mean over seeds): per arm, mean ± std over seeds of the
   training format reward (the base part, the same definition in every arm; the anchoring
   term differs by arm), `</think>` closure, tool calls per rollout, the tool-call rate per K
   (means over the training steps), and held-out accuracy after RL at each ``--eval-k``.

A rerun into the same ``--out`` skips the runs that finished (their ``metrics.jsonl`` holds the
after-RL evaluation) with the same resolved config (``stamp.json``,
``paravt.experiments.arms.kept_run``), resumes (``--resume``) the ones cut short that hold a
checkpoint (a preempted run writes one) and redoes the others from scratch
(``paravt.experiments.arms.run_arms``); a failed run stops the command with its log's tail. The
folder is locked while the command runs (``OUT/.lock``: a second command into it is refused),
and SIGTERM / SIGINT / SIGUSR1 to the command reach the arm run's process group: the run stops,
then the command (exit 128 + the signal).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from paravt.config import Config, ConfigError
from paravt.experiments.arms import (
    ARMS,
    FolderLock,
    arm_overrides,
    parse_arms,
    reused_checkpoint,
    run_arms,
    save_panels,
    sft_stamp,
    task_stamp,
    train_checkpoint,
)
from paravt.files import write_atomic
from paravt.metrics import json_safe, mean_or_nan, read_metrics, sample_std


def run_metrics(
    rows: Sequence[dict[str, Any]], budgets: Sequence[int], eval_k: Sequence[int]
) -> dict[str, float]:
    """One run's row of the table from its ``metrics.jsonl`` rows (NaN where it has no value,
    e.g. the tool-call rate at a K an ungated arm never draws)."""
    train = [r for r in rows if r.get("kind") == "train"]
    after = next((r for r in reversed(rows) if r.get("kind") == "eval_after"), {})

    def over_steps(key: str) -> float:
        return mean_or_nan([float(r[key]) for r in train if isinstance(r.get(key), (int, float))])

    out = {
        "format_reward": over_steps("reward/fmt_base"),
        "think_closure": over_steps("think_closure_rate"),
        "tool_calls_per_rollout": over_steps("tool_calls_per_rollout"),
        "tool_call_rate": over_steps("tool_call_rate"),
    }
    for k in budgets:
        out[f"tool_rate/K{k}"] = over_steps(f"tool_rate/K{k}")
    for k in eval_k:
        v = after.get(f"K{k}_tools/accuracy")
        out[f"accuracy/K{k}"] = float(v) if isinstance(v, (int, float)) else float("nan")
    return out


def aggregate(per_seed: Sequence[dict[str, float]]) -> dict[str, tuple[float, float]]:
    """``key -> (mean, std)`` over seeds, NaN values left out."""
    keys = list(per_seed[0]) if per_seed else []
    agg = {}
    for k in keys:
        xs = [r[k] for r in per_seed if r[k] == r[k]]
        agg[k] = (mean_or_nan(xs), sample_std(xs))
    return agg


def _cell(ms: tuple[float, float]) -> str:
    m, s = ms
    return "n/a" if m != m else f"{m:.3f} ± {s:.3f}"


def format_table(results: dict[str, dict[str, tuple[float, float]]], seeds: int) -> str:
    """The paper-style markdown table: one row per arm, mean ± std over ``seeds`` seeds."""
    keys = list(next(iter(results.values())))
    labels = {
        "format_reward": "format reward (base)",
        "think_closure": "</think> closure",
        "tool_calls_per_rollout": "tool calls / rollout",
        "tool_call_rate": "tool-call rate",
    }
    head = ["arm"] + [
        labels.get(k, k.replace("tool_rate/", "tool rate ").replace("accuracy/", "held-out acc "))
        for k in keys
    ]
    lines = [
        f"mean ± std over {seeds} seed(s); training metrics are means over the RL steps; "
        "held-out accuracy after RL, with tools",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for arm, agg in results.items():
        lines.append(f"| {arm} | " + " | ".join(_cell(agg[k]) for k in keys) + " |")
    return "\n".join(lines)


def plot_curves(runs: dict[str, list[list[dict[str, Any]]]], out_png: Path) -> Path:
    """Per-step curves (mean over an arm's seeds) of the format reward, `</think>` closure,
    tool-call rate and tool calls per rollout, one line per arm; ``runs`` maps an arm to the
    ``metrics.jsonl`` rows of each of its seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("reward/fmt_base", "format reward (base)"),
        ("think_closure_rate", "</think> closure"),
        ("tool_call_rate", "tool-call rate"),
        ("tool_calls_per_rollout", "tool calls / rollout"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3), squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels):
        for arm, seeds in runs.items():
            by_step: dict[int, list[float]] = {}
            for rows in seeds:
                for r in rows:
                    if r.get("kind") == "train" and isinstance(r.get(key), (int, float)):
                        by_step.setdefault(int(r["step"]), []).append(float(r[key]))
            if by_step:
                xs = sorted(by_step)
                ax.plot(xs, [mean_or_nan(by_step[x]) for x in xs], label=arm)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    return save_panels(fig, axes, out_png)


def _sft(cfg: Config, out: Path) -> Path:
    """The shared SFT checkpoint ``out/sft`` (made once; a rerun with the same SFT settings,
    seed, task and starting model reuses it, one with others is refused: ``out/sft_params.json``,
    ``paravt.experiments.arms.reused_checkpoint``)."""
    dst, stamp = out / "sft", out / "sft_params.json"
    made = {
        "sft": sft_stamp(cfg.sft),
        "seed": cfg.train.seed,
        **task_stamp(cfg),
        "model_path": cfg.model.path,
    }
    if reused_checkpoint(dst, "ablation", stamp, made):
        return dst
    if cfg.sft.steps < 1:
        raise ConfigError("sft.steps must be >= 1: every arm starts from the shared SFT")
    what = f"SFT {cfg.sft.steps} steps"
    return train_checkpoint(cfg, dst, "ablation", what, stamp=stamp, made=made)


def ablation(
    cfg: Config,
    *,
    out: Path,
    arms: Sequence[str],
    seeds: int,
    eval_k: Sequence[int],
    base_args: Sequence[str],
) -> dict[str, Any]:
    """Run the ablation (see the module docstring); returns ``{"table", "results", "runs"}``.
    ``base_args`` are the ``paravt.train`` arguments (preset, configs, overrides) of ``cfg``."""
    parse_arms(",".join(arms), list(ARMS))  # none, or an unknown one: before anything runs
    with FolderLock(out, "ablation") as lock:
        return _ablation(cfg, out, arms, seeds, eval_k, base_args, lock)


def _ablation(
    cfg: Config,
    out: Path,
    arms: Sequence[str],
    seeds: int,
    eval_k: Sequence[int],
    base_args: Sequence[str],
    lock: FolderLock,
) -> dict[str, Any]:
    sft = _sft(cfg, out)
    conds = "[" + ",".join(f"{k}:tools" for k in eval_k) + "]"

    def args_of(arm: str, seed: int) -> list[str]:
        return [
            *arm_overrides(arm, cfg),
            f"model.path={sft}",
            "sft.steps=0",
            f"train.seed={seed}",
            f"train.eval_conditions={conds}",
            "train.progress=false",
            "train.summary_plot=false",  # ablation.png is the figure
            "train.eval_before=false",  # one start checkpoint: only after RL differs
            "train.save_every=0",  # the last step's checkpoint, and a preempted run's
            "train.keep_last=1",
        ]

    dirs = run_arms(out, [(a, s) for a in arms for s in range(seeds)], args_of, base_args,
                    "ablation", lock)  # fmt: skip
    runs = {a: [dirs[(a, s)] for s in range(seeds)] for a in arms}
    budgets = sorted(set(cfg.video.frame_budgets))
    rows = {a: [read_metrics(d / "metrics.jsonl") for d in runs[a]] for a in arms}  # read once
    per_seed = {a: [run_metrics(r, budgets, eval_k) for r in rows[a]] for a in arms}
    results = {a: aggregate(per_seed[a]) for a in arms}
    table = format_table(results, seeds)
    write_atomic(out / "ablation.md", table + "\n")
    write_atomic(
        out / "ablation.json",
        json.dumps(
            json_safe(
                {
                    "arms": {a: ARMS[a] for a in arms},
                    "seeds": seeds,
                    "per_seed": per_seed,
                    "mean_std": {a: {k: list(v) for k, v in r.items()} for a, r in results.items()},
                }
            ),
            indent=1,
            allow_nan=False,
        ),
    )
    plot_curves(rows, out / "ablation.png")
    return {"table": table, "results": results, "runs": runs}
