"""``python -m paravt.experiments collapse`` — does vanilla GRPO lose tool use, and does
PARA-GRPO keep it? (docs/DESIGN.md, "Experiments" and "The collapse experiment, protocol 3".)

    python -m paravt.experiments collapse [--seeds 3] [--first-seed 0] [--arms a,b,...]
        [--out runs/collapse] [--preset tiny_cpu] [--config configs/collapse.yaml ...]
        [--windows 2,3] [--unclosed-think 1.0] [--replay 0.25] [--eval-every 25]
        [--eval-k 2,4,8,16,32] [key=value ...]

The ablation (``paravt.experiments.ablation``) cannot show the paper's collapse: its cold start is too
good (format 1.000 after SFT, so anchoring is constant within a group) and its vanilla arm never
calls the tool (its SFT taught answering from a 32-frame overview). This experiment changes the
cold start, not the system:

1. **Cold start like the paper's**, two stages. Stage 1 (:func:`base_sft`, ``--base-steps``,
   default the preset's own recipe: 4000 steps for ``tiny_cpu``) is the embedded default's SFT,
   so the model reads colours from the frames as a pretrained VLM does (``model.path=...``
   skips it). Stage 2 (:func:`cold_start`, ``sft.*`` of ``configs/collapse.yaml``: 200 steps
   at lr 1e-3) trains from it on :func:`all_tool_records` (written to ``OUT/sft_data.jsonl``):
   on the same "spot" task every oracle trajectory calls ``crop_video`` whatever K — also when
   the overview already shows the square — on ``n`` equal windows of the whole video, ``n``
   drawn per (video, K) from ``--windows`` by a stable hash (2,3: κ = 2.5 calls per rollout),
   then answers from the summaries. ``--unclosed-think`` (the share of tool turns that never
   close ``<think>``; 1.0: all of them) is the fragile format: the tags that collapse under
   sampling. ``--replay`` (:func:`replay_records`) mixes in a share of stage 1's own direct
   answers, so that a clean answer without the tool survives the tool SFT, as a pretrained
   VLM's does. The embedded default's recipe is untouched.
2. **One SFT checkpoint** ``OUT/sft``; the step-0 numbers of every arm (κ, format, held-out
   accuracy per K) come from one evaluation of it, ``OUT/sft_eval`` (``paravt.train.run``
   with ``train.steps=0``, in the driver's process).
3. **Arms** (``paravt.experiments.arms.arm_overrides``): ``vanilla`` (fixed K = the largest
   budget, where the overview always shows the square: a call adds only risk; no anchoring),
   ``vanilla_ref`` (the reference implementation's vanilla: no pinned ``<think>``, its
   closure-blind format reward, answer fallbacks and R_tool), ``anchoring``, ``gating``,
   ``paragrpo``, ``paragrpo_no_rtool``; every arm × seed is one ``python -m paravt.train``
   run from ``OUT/sft`` into ``OUT/ARM/seedN`` (``paravt.experiments.arms.run_arms``, the
   one driver the ablation uses too). What this experiment reads is the training run's own:
   a held-out evaluation every ``--eval-every`` steps (``train.eval_every``: ``kind:
   "eval_step"`` rows of ``metrics.jsonl``, per-prompt rows in ``heldout.jsonl``) and, per
   step, the mean group advantage of rollouts that used the tool against those that did not
   in groups holding both (``adv/tool``, ``adv/no_tool``, ``adv/mixed_groups``:
   ``paravt.metrics.rollout_metrics``), the measured reason for a collapse or its absence.
4. ``OUT/collapse.json``, ``OUT/collapse.md`` (printed) and ``OUT/collapse.png``
   (:func:`summarise`): per arm κ and format compliance fτ at the start (step 1, the SFT
   policy's own rollouts) and the end (mean of the last 5 steps), held-out accuracy after RL
   per K, the tool-call rate at the end per K the arm trained at, and the diagnosis (steps
   with a mixed group, the mean advantage of tool and no-tool rollouts there), each
   ``{"mean", "std"}`` over seeds, the per-seed values and per-step curves.

A rerun into the same ``--out`` keeps the SFT checkpoint (its stamp matching), its evaluation
and every finished run (its ``metrics.jsonl`` holds ``eval_after``) whose ``stamp.json`` (the
resolved config, ``train.eval_every`` included; ``paravt.experiments.arms.kept_run``) matches
what the rerun would run, resumes (``--resume``) a run cut short that holds a checkpoint (a
preempted run writes one) and redoes the others from scratch.
``OUT/.lock`` refuses a second command into a folder a live one holds; SIGTERM / SIGINT /
SIGUSR1 to the command reach the arm run's process group (the run stops, then the command, exit
128 + the signal).

Honest limits: the crop windows are fixed per video duration (the tiny model cannot copy
numbers, see README), so crop placement does not depend on the overview; "held-out accuracy
per step" is measured every ``--eval-every`` steps, not at every step (each evaluation is a
rollout of all held-out prompts per K). Results (README, ``docs/collapse_notes.md``): protocol
1 (no replay, half the tool turns unclosed) lost no tool use in any arm, because a rollout
without a crop was a failed call, never a safer direct answer; protocol 2 (these defaults)
is the one the README reports.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from paravt.config import Config, ConfigError, load_config, preset_errors
from paravt.experiments.arms import (
    DriverInterrupted,
    FolderLock,
    arm_overrides,
    kept_run,
    load_args,
    parse_arms,
    reused_checkpoint,
    run_arms,
    run_driver,
    run_finished,
    run_stamp,
    save_panels,
    train_checkpoint,
    write_stamp,
)
from paravt.metrics import json_safe, mean_or_nan, read_metrics, sample_std

#: The arms of ``paravt.experiments.arms.ARMS`` (same names, same order), described for this
#: experiment.
ARMS: dict[str, str] = {
    "vanilla": "GRPO: fixed K (the largest), no anchoring",
    "vanilla_ref": "the reference's vanilla GRPO: fixed K, no pinned <think>, its rewards",
    "anchoring": "anchoring only (fixed K)",
    "gating": "gating only (no anchoring)",
    "paragrpo": "PARA-GRPO (anchoring + gating)",
    "paragrpo_no_rtool": "PARA-GRPO without R_tool",
}

#: The experiment's settings on top of the preset (``--config`` replaces it).
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "collapse.yaml"
#: Steps averaged for the "end" values (the issue's "mean last 5 steps").
END_STEPS = 5
#: Per-step keys kept in ``collapse.json``'s curves and drawn in ``collapse.png``.
CURVE_KEYS = (
    "tool_calls_per_rollout",
    "tool_call_rate",
    "format_compliance",
    "reward/fmt_base",
    "think_closure_rate",
    "parse_error_rate",
    "accuracy",
    "adv/tool",
    "adv/no_tool",
    "adv/mixed_groups",
)


# ------------------------------------------------------------------------ the cold start
def _windows_for(key: str, choices: Sequence[int]) -> int:
    """``choices[h % len]`` for a stable hash of ``key`` (``hash()`` is salted per process)."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return int(choices[h % len(choices)])


def all_tool_records(
    data_dir: str | Path, cfg: Config, windows: Sequence[int], unclosed_think: float = 0.0
) -> list[dict]:
    """The collapse cold start's SFT records for the "spot" task in ``data_dir``: for every
    training row and every overview budget K of the run (``oracle_settings``), one trajectory
    that calls ``crop_video`` on ``n`` equal windows of the whole video (``n`` from
    ``windows``, per (row, K) by a stable hash), whether or not the overview shows the square;
    the sub-agents' summaries are the oracle's (only what the crop's frames show) and the
    answer repeats the summary that names the square (``paravt.data.synth._spot_sft``'s text).

    ``unclosed_think``: the share of records (by a stable hash) whose tool-call turn never
    closes its ``<think>`` (the calls follow the thought directly; they still parse and run):
    a second knob for a fragile format, one that breaks exactly the turns that call the tool,
    as the paper's 8B does (0: off; the short SFT is the first knob).

    Raises ``ConfigError`` for a task other than "spot" or a window count outside
    ``1..agent.max_parallel``."""
    from paravt.data.synth import (
        Event,
        VideoPlan,
        _crop_seen,
        _meta,
        _Seen,
        _span,
        _tool_record,
        oracle_settings,
    )
    from paravt.video import overview_timestamps

    if cfg.data.synth_task != "spot":
        raise ConfigError(
            f"data.synth_task={cfg.data.synth_task!r}: the collapse cold start is written for "
            "the 'spot' task (set data.synth_task=spot)"
        )
    if not 0.0 <= unclosed_think <= 1.0:
        raise ConfigError(f"--unclosed-think {unclosed_think} must be in [0, 1]")
    bad = [n for n in windows if not 1 <= n <= cfg.agent.max_parallel]
    if not windows or bad:
        raise ConfigError(
            f"--windows {list(windows)}: each count must be in 1..agent.max_parallel "
            f"({cfg.agent.max_parallel})"
        )
    d = Path(data_dir)
    manifest = json.loads((d / "manifest.json").read_text())
    fps = float(manifest["params"]["fps"])
    plans = {}
    for v in manifest["videos"]:
        plans[v["name"]] = VideoPlan(**{**v, "target": Event(**v["target"]), "distractors": []})
    st = oracle_settings(cfg)
    out: list[dict] = []
    for line in (d / "train.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        plan = plans[Path(row["video"]).stem]
        tgt = plan.target
        meta = _meta(plan, fps)
        for k in st.budgets:
            n = _windows_for(f"{row['id']}:{k}", windows)
            over = _Seen(plan, fps, overview_timestamps(meta, k), st.temporal_patch)
            plan_text = (
                f"The overview shows a {tgt.name}; I will check the whole video."
                if over.event(tgt)
                else "The overview shows no shape; I will look at the whole video."
            )
            edges = [round(plan.duration * j / n, 1) for j in range(n + 1)]
            wins = [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]
            summaries, seen = [], False
            for a, b in wins:
                span = _span(crop := _crop_seen(plan, meta, a, b, st), crop.event(tgt), b)
                seen = seen or span is not None
                summaries.append(
                    f"A {tgt.name} appears at {span[0]:.1f}-{span[1]:.1f} s."
                    if span
                    else "Nothing notable happens."
                )
            found = (
                f"A {tgt.name} appears."
                if seen
                else f"No crop shows the shape clearly; the likeliest is the {tgt.name}."
            )
            rec = _tool_record(row, k, plan_text, wins, summaries, found, row["answer"])
            if _windows_for(f"unclosed:{row['id']}:{k}", range(1000)) < unclosed_think * 1000:
                first = rec["turns"][0]
                first["content"] = first["content"].replace("\n</think>\n", "\n", 1)
            out.append(rec)
    return out


def replay_records(data_dir: str | Path, n_tool: int, share: float) -> list[dict]:
    """Stage 1's direct answers, replayed in stage 2 of the cold start: ``share`` of stage 2's
    records are the task's own oracle records (``sft.jsonl``, the embedded default's data) that
    answer from the overview in one unforced turn, picked by a stable hash (with repeats when
    more are asked for than exist).

    Why (``docs/collapse_notes.md``, protocol 2): a 200-step all-tool SFT erases the base
    model's direct answer (tool-call rate 1.00 at every K), so a rollout without a crop is a
    failed call, never a clean direct answer, and GRPO has nothing safer to drift to. The
    paper's SFT starts from a pretrained VLM that keeps answering from frames underneath;
    replaying a share of stage 1's direct answers keeps that habit here. Every replayed record
    is a direct answer; every other record of stage 2 calls the tool."""
    if not 0.0 <= share < 1.0:
        raise ConfigError(f"--replay {share} must be in [0, 1)")
    n = round(n_tool * share / (1.0 - share))
    if n == 0:
        return []
    direct = []
    for line in (Path(data_dir) / "sft.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        turns = rec["turns"]
        if len(turns) == 1 and not turns[0].get("forced") and "<answer>" in turns[0]["content"]:
            direct.append(rec)
    if not direct:
        raise ConfigError(f"--replay {share}: {data_dir}/sft.jsonl has no direct-answer records")
    ranked = sorted(
        direct,
        key=lambda r: hashlib.sha256(f"{r['sample_id']}:{r['num_frames']}".encode()).digest(),
    )
    return [ranked[i % len(ranked)] for i in range(n)]


def _write_sft_data(
    cfg: Config,
    data_dir: str,
    path: Path,
    windows: Sequence[int],
    unclosed_think: float,
    replay: float = 0.0,
) -> Path:
    recs = all_tool_records(data_dir, cfg, windows, unclosed_think)
    recs += replay_records(data_dir, len(recs), replay)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in recs))
    tmp.replace(path)
    return path


def _task_stamp(cfg: Config) -> dict[str, Any]:
    """What shapes both stages' SFT records, for their stamps: the task, and the oracle's
    budgets, crops and window cap (``paravt.data.synth.oracle_settings``)."""
    return {
        "data": dataclasses.asdict(cfg.data),
        "video": dataclasses.asdict(cfg.video),
        "max_parallel": cfg.agent.max_parallel,
    }


def base_sft(cfg: Config, out: Path, base: Config) -> str:
    """Stage 1 of the cold start: the model that already reads the task, as a pretrained VLM
    does before a tool-use SFT (the paper's SFT starts from Qwen3-VL, which answers from frames
    without tools). ``cfg.model.path`` set: that checkpoint is the base (nothing trained).
    Otherwise ``OUT/base_sft``: the embedded default's own SFT recipe (``base.sft``, the
    preset's, e.g. 4000 cosine steps on the task's oracle rows, which call the tool only where
    the overview misses the square) from the random tiny model; made once, reused by a rerun.
    """
    if cfg.model.path:
        return cfg.model.path
    dst, stamp = out / "base_sft", out / "base_sft_params.json"
    made = {"sft": dataclasses.asdict(base.sft), **_task_stamp(cfg)}
    if reused_checkpoint(dst, "collapse", stamp, made):
        return str(dst)
    if base.sft.steps < 1:
        raise ConfigError(
            "--base-steps must be >= 1 (or give model.path=CHECKPOINT as the base model)"
        )
    what = f"base SFT {base.sft.steps} steps (the default's recipe)"
    train_checkpoint(replace(cfg, sft=base.sft), dst, "collapse", what, stamp=stamp, made=made)
    return str(dst)


def cold_start(
    cfg: Config,
    out: Path,
    windows: Sequence[int],
    unclosed_think: float = 0.0,
    base: Config | None = None,
    replay: float = 0.0,
) -> Path:
    """The shared SFT checkpoint ``out/sft``: stage 1 (:func:`base_sft`; ``base`` None: train
    from ``cfg.model.path`` or the random tiny model directly), then stage 2, ``cfg.sft`` on
    :func:`all_tool_records` (made once; a rerun reuses it, and refuses one made with other
    settings: ``out/sft_params.json``)."""
    from paravt.assets import prepare_assets
    from paravt.distributed import DistContext

    start = base_sft(cfg, out, base) if base is not None else cfg.model.path
    dst, stamp = out / "sft", out / "sft_params.json"
    made = {
        "windows": list(windows),
        "unclosed_think": unclosed_think,
        **({"replay": replay} if replay else {}),
        "sft": dataclasses.asdict(cfg.sft),
        **_task_stamp(cfg),
        "model_path": start,
    }
    if reused_checkpoint(dst, "collapse", stamp, made):
        return dst
    if cfg.sft.steps < 1:
        raise ConfigError("sft.steps must be >= 1: every arm starts from the collapse cold start")
    scfg = replace(cfg, model=replace(cfg.model, path=start))
    dirs = prepare_assets(scfg, DistContext())
    data = _write_sft_data(cfg, dirs[0], out / "sft_data.jsonl", windows, unclosed_think, replay)
    scfg = replace(scfg, sft=replace(cfg.sft, data=str(data)))
    what = f"all-tool SFT {cfg.sft.steps} steps on {data} from {start or 'random init'}"
    return train_checkpoint(scfg, dst, "collapse", what, dirs=dirs, stamp=stamp, made=made)


# ----------------------------------------------------------------------------- summary
def _ms(xs: Sequence[float]) -> dict[str, float]:
    xs = [x for x in xs if x == x]
    return {"mean": mean_or_nan(xs), "std": sample_std(xs)}


def _num(r: dict[str, Any], key: str) -> float:
    v = r.get(key)
    return float(v) if isinstance(v, (int, float)) else float("nan")


def seed_values(rows: Sequence[dict[str, Any]], eval_k: Sequence[int]) -> dict[str, Any]:
    """One run's summary from its ``metrics.jsonl`` rows: κ and format compliance at step 1
    and over the last ``END_STEPS`` steps; the tool-call rate over those steps, overall and
    per overview budget K the run trained at (NaN for a K none of those steps drew); held-out
    accuracy and tool-call rate after RL per K of ``eval_k`` (every arm at the same K); and
    the diagnosis: the number of steps with a mixed group and the mean over those steps of
    each step's mean advantage of tool and of no-tool rollouts (a sign that changes during
    the run cancels in it: read the per-step curves)."""
    train = sorted((r for r in rows if r.get("kind") == "train"), key=lambda r: r["step"])
    after = next((r for r in reversed(rows) if r.get("kind") == "eval_after"), {})
    last = train[-END_STEPS:]

    def end(key: str) -> float:
        return mean_or_nan([x for x in (_num(r, key) for r in last) if x == x])

    first = train[0] if train else {}
    budgets = sorted(
        {int(k[len("tool_rate/K") :]) for r in train for k in r if k.startswith("tool_rate/K")}
    )
    mixed = [r for r in train if _num(r, "adv/mixed_groups") > 0]
    return {
        "kappa_start": _num(first, "tool_calls_per_rollout"),
        "kappa_end": end("tool_calls_per_rollout"),
        "format_start": _num(first, "format_compliance"),
        "format_end": end("format_compliance"),
        "tool_rate_end": end("tool_call_rate"),
        # per overview budget K the arm trained at (a K missing from the last steps: NaN)
        "tool_rate_end_k": {str(k): end(f"tool_rate/K{k}") for k in budgets},
        "acc_end_k": {str(k): _num(after, f"K{k}_tools/accuracy") for k in eval_k},
        "tool_rate_heldout_k": {str(k): _num(after, f"K{k}_tools/tool_call_rate") for k in eval_k},
        # the diagnosis: steps with a group holding rollouts with and without a crop, and the
        # mean over those steps of each side's mean advantage (tool < 0 < no-tool pushes
        # away from the tool)
        "mixed_steps": float(len(mixed)),
        "adv_tool_mixed": mean_or_nan([_num(r, "adv/tool") for r in mixed]),
        "adv_no_tool_mixed": mean_or_nan([_num(r, "adv/no_tool") for r in mixed]),
    }


def _by_step(
    seed_rows: Sequence[Sequence[dict[str, Any]]], kinds: tuple[str, ...], key: str
) -> dict[str, list]:
    """``{"step", "mean", "std"}`` of ``key`` over the seeds' rows of ``kinds`` (NaN left out;
    ``std``: the sample std over seeds, 0 with one value)."""
    by: dict[int, list[float]] = {}
    for rows in seed_rows:
        for r in rows:
            if r.get("kind") in kinds and (x := _num(r, key)) == x:
                by.setdefault(int(r["step"]), []).append(x)
    xs = sorted(by)
    return {
        "step": xs,
        "mean": [mean_or_nan(by[s]) for s in xs],
        "std": [sample_std(by[s]) for s in xs],
    }


def curves(seed_rows: Sequence[Sequence[dict[str, Any]]], keys: Sequence[str]) -> dict:
    """``key -> {"step": [...], "mean": [...], "std": [...]}`` over an arm's seeds (NaN values
    left out; ``std`` across seeds: the band of ``collapse.png``); also ``tool_rate/K*`` and
    held-out ``eval/K*`` (the ``eval_step``/``eval_after`` rows)."""
    found = {k for rows in seed_rows for r in rows if r.get("kind") == "train" for k in r}
    keys = [*keys, *sorted(k for k in found if k.startswith("tool_rate/K"))]
    out = {key: _by_step(seed_rows, ("train",), key) for key in keys}
    acc_keys = {
        k for rows in seed_rows for r in rows
        if r.get("kind") in ("eval_step", "eval_after") for k in r
        if k.endswith("_tools/accuracy")
    }  # fmt: skip
    for key in sorted(acc_keys):
        out["eval/" + key.split("_")[0]] = _by_step(seed_rows, ("eval_step", "eval_after"), key)
    return out


def summarise(
    runs: dict[str, dict[int, list[dict[str, Any]]]],
    eval_k: Sequence[int],
    sft_eval: dict[str, Any],
) -> dict[str, Any]:
    """``collapse.json``: per arm ``kappa_start``, ``kappa_end``, ``format_start``,
    ``format_end``, ``tool_rate_end``, ``mixed_steps``, ``adv_tool_mixed``,
    ``adv_no_tool_mixed`` as ``{"mean", "std"}`` over seeds; ``tool_rate_end_k``,
    ``acc_end_k`` and ``tool_rate_heldout_k`` (K -> ``{"mean", "std"}``; a seed whose value
    is NaN is left out of that K's mean); ``seeds`` (per seed: its number and values) and
    ``curves`` (the held-out ``eval/K*`` ones start at step 0 with the cold start's); plus
    ``sft`` (the cold start's held-out evaluation). See :func:`seed_values`."""
    arms: dict[str, Any] = {}
    for arm, by_seed in runs.items():
        vals = {s: seed_values(rows, eval_k) for s, rows in by_seed.items()}
        entry: dict[str, Any] = {"description": ARMS.get(arm, arm)}
        for key in (
            "kappa_start",
            "kappa_end",
            "format_start",
            "format_end",
            "tool_rate_end",
            "mixed_steps",
            "adv_tool_mixed",
            "adv_no_tool_mixed",
        ):
            entry[key] = _ms([v[key] for v in vals.values()])
        ks = sorted({k for v in vals.values() for k in v["tool_rate_end_k"]}, key=int)
        entry["tool_rate_end_k"] = {
            k: _ms([v["tool_rate_end_k"].get(k, float("nan")) for v in vals.values()]) for k in ks
        }
        for key in ("acc_end_k", "tool_rate_heldout_k"):
            entry[key] = {str(k): _ms([v[key][str(k)] for v in vals.values()]) for k in eval_k}
        entry["seeds"] = [{"seed": s, **v} for s, v in vals.items()]
        entry["curves"] = curves(list(by_seed.values()), CURVE_KEYS)
        for k in eval_k:  # step 0 of the held-out curves: the shared cold start's evaluation
            if (x := _num(sft_eval, f"K{k}_tools/accuracy")) == x:
                c = entry["curves"].setdefault(f"eval/K{k}", {"step": [], "mean": [], "std": []})
                c["step"].insert(0, 0)
                c["mean"].insert(0, x)
                c["std"].insert(0, 0.0)  # one checkpoint, one evaluation
        arms[arm] = entry
    sft = {}
    for k in eval_k:
        p = f"K{k}_tools/"
        sft[str(k)] = {
            "kappa": _num(sft_eval, p + "tool_calls_per_rollout"),
            "tool_rate": _num(sft_eval, p + "tool_call_rate"),
            "format": _num(sft_eval, p + "format_compliance"),
            "parse_errors": _num(sft_eval, p + "parse_error_rate"),
            "accuracy": _num(sft_eval, p + "accuracy"),
        }
    return {"arms": arms, "sft": sft, "eval_k": list(eval_k), "end_steps": END_STEPS}


def _cell(ms: dict[str, float]) -> str:
    m, s = ms["mean"], ms["std"]
    return "n/a" if m != m else f"{m:.2f} ± {s:.2f}"


def format_markdown(res: dict[str, Any]) -> str:
    """``collapse.md``: the cold start's held-out numbers, then one row per arm."""
    ks = res["eval_k"]
    lines = [
        "# Collapse experiment",
        "",
        "Cold start (SFT checkpoint), held-out, with tools, T = rollout temperature:",
        "",
        "| K | κ (calls/rollout) | tool-call rate | format compliance | parse errors | accuracy |",
        "|---|---|---|---|---|---|",
    ]
    for k in ks:
        s = res["sft"][str(k)]
        lines.append(
            f"| {k} | {s['kappa']:.2f} | {s['tool_rate']:.2f} | {s['format']:.2f} | "
            f"{s['parse_errors']:.2f} | {s['accuracy']:.2f} |"
        )
    n = max((len(a["seeds"]) for a in res["arms"].values()), default=0)
    seeds = sorted({s["seed"] for a in res["arms"].values() for s in a["seeds"]})
    lines += [
        "",
        f"RL, mean ± std over {n} seed(s) {seeds}; start = step 1 (the SFT policy's rollouts), "
        f"end = mean of the last {res['end_steps']} steps; accuracy held-out after RL:",
        "",
        "| arm | κ start | κ end | fτ start | fτ end | tool rate end | "
        + " | ".join(f"acc K{k}" for k in ks)
        + " |",
        "|" + "---|" * (6 + len(ks)),
    ]
    for arm, a in res["arms"].items():
        cells = [a[k] for k in ("kappa_start", "kappa_end", "format_start", "format_end")]
        cells += [a["tool_rate_end"], *(a["acc_end_k"][str(k)] for k in ks)]
        lines.append(f"| {arm} | " + " | ".join(_cell(c) for c in cells) + " |")
    budgets = sorted({k for a in res["arms"].values() for k in a["tool_rate_end_k"]}, key=int)
    lines += [
        "",
        "Tool-call rate at the end per overview budget K the arm trained at, and why tool use "
        "moved: steps with a group holding rollouts with and without a crop (mixed), and the "
        "mean group advantage of each side at those steps:",
        "",
        "| arm | "
        + " | ".join(f"tool rate K{k} end" for k in budgets)
        + " | mixed steps | adv tool | adv no-tool |",
        "|" + "---|" * (4 + len(budgets)),
    ]
    none = {"mean": float("nan"), "std": 0.0}
    for arm, a in res["arms"].items():
        cells = [a["tool_rate_end_k"].get(k, none) for k in budgets]
        cells += [a["mixed_steps"], a["adv_tool_mixed"], a["adv_no_tool_mixed"]]
        lines.append(f"| {arm} | " + " | ".join(_cell(c) for c in cells) + " |")
    lines += [
        "",
        "Held-out tool-call rate after RL, every arm at the same K (the cold start's: the "
        "first table):",
        "",
        "| arm | " + " | ".join(f"K{k}" for k in ks) + " |",
        "|" + "---|" * (1 + len(ks)),
    ]
    for arm, a in res["arms"].items():
        cells = [a["tool_rate_heldout_k"][str(k)] for k in ks]
        lines.append(f"| {arm} | " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def plot(res: dict[str, Any], out_png: Path) -> Path:
    """Per-step curves, one line per arm (the mean over seeds) in a band of ± one std across
    seeds: κ, tool-call rate, format compliance, `</think>` closure, tool vs no-tool advantage
    (points: only steps with a mixed group have one), held-out accuracy at the smallest K."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k0 = min(res["eval_k"])
    panels = [
        ("tool_calls_per_rollout", "κ (tool calls / rollout)"),
        ("tool_call_rate", "tool-call rate"),
        ("format_compliance", "format compliance fτ"),
        ("think_closure_rate", "</think> closure"),
        ("adv/tool", "advantage of tool rollouts (mixed groups)"),
        (f"eval/K{k0}", f"held-out accuracy K={k0}"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels):
        for arm, a in res["arms"].items():
            c = a["curves"].get(key)
            if c and c["step"]:
                # Advantages exist only at steps with a mixed group: points, not a line.
                style = {"linestyle": "none", "marker": "o"} if key.startswith("adv/") else {}
                marker = "." if len(c["step"]) < 12 else ""
                (line,) = ax.plot(c["step"], c["mean"], label=arm, **{"marker": marker, **style})
                if not key.startswith("adv/"):
                    lo = [m - v for m, v in zip(c["mean"], c["std"])]
                    hi = [m + v for m, v in zip(c["mean"], c["std"])]
                    ax.fill_between(c["step"], lo, hi, color=line.get_color(), alpha=0.15, lw=0)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    return save_panels(fig, axes, out_png)


# ------------------------------------------------------------------------------ driver
def collapse(
    cfg: Config,
    *,
    out: Path,
    arms: Sequence[str],
    seeds: Sequence[int],
    eval_k: Sequence[int],
    eval_every: int,
    windows: Sequence[int],
    base_args: Sequence[str],
    unclosed_think: float = 0.0,
    base: Config | None = None,
    replay: float = 0.0,
) -> dict[str, Any]:
    """Run the experiment (module docstring); returns ``{"json", "table"}``. ``base_args``:
    the ``--preset``/``--config``/overrides that built ``cfg``; ``base``: the config whose
    ``sft`` trains the cold start's stage 1 (:func:`base_sft`; None: no stage 1)."""
    for a in parse_arms(",".join(arms), list(ARMS)):  # none, or an unknown one: refused
        arm_overrides(a, cfg)
    if cfg.data.synth_task != "spot":
        raise ConfigError(
            f"data.synth_task={cfg.data.synth_task!r}: the collapse cold start needs the 'spot' "
            "task"
        )
    if not 0.0 <= unclosed_think <= 1.0:
        raise ConfigError(f"--unclosed-think {unclosed_think} must be in [0, 1]")
    if not 0.0 <= replay < 1.0:
        raise ConfigError(f"--replay {replay} must be in [0, 1)")
    with FolderLock(out, "collapse") as lock:
        return _collapse(
            cfg, out, arms, seeds, eval_k, eval_every, windows, base_args, unclosed_think,
            base, replay, lock,
        )  # fmt: skip


def _collapse(
    cfg: Config,
    out: Path,
    arms: Sequence[str],
    seeds: Sequence[int],
    eval_k: Sequence[int],
    eval_every: int,
    windows: Sequence[int],
    base_args: Sequence[str],
    unclosed_think: float,
    base: Config | None,
    replay: float,
    lock: FolderLock,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    sft = cold_start(cfg, out, windows, unclosed_think, base, replay)
    conds = "[" + ",".join(f"{k}:tools" for k in eval_k) + "]"
    shared = [
        f"model.path={sft}",
        "sft.steps=0",
        f"train.eval_conditions={conds}",
        f"train.eval_every={eval_every}",
        "train.eval_before=false",  # every arm's start: the cold start's one evaluation
        "train.progress=false",
        "train.summary_plot=false",  # collapse.png is the figure
        "train.save_every=0",  # the last step's checkpoint, and a preempted run's
        "train.keep_last=1",
    ]
    sft_eval_dir = out / "sft_eval"
    eval_cfg = load_args(
        base_args,
        [*shared, "train.steps=0", "train.eval_before=false", f"train.out_dir={sft_eval_dir}"],
    )
    stamp = run_stamp(eval_cfg)
    keep, why = kept_run(sft_eval_dir, stamp)
    if not (keep and _evaluated_at(sft_eval_dir, eval_k)):  # in this process: one model load
        if run_finished(sft_eval_dir):
            print(f"[collapse] cold start's evaluation {why}: redone", flush=True)
        shutil.rmtree(sft_eval_dir, ignore_errors=True)
        sft_eval_dir.mkdir(parents=True)
        write_stamp(sft_eval_dir, stamp)
        _evaluate_cold_start(eval_cfg)
    sft_eval = next(
        r for r in read_metrics(sft_eval_dir / "metrics.jsonl") if r.get("kind") == "eval_after"
    )
    print(f"[collapse] cold start evaluated ({(time.perf_counter() - t0) / 60:.1f} min)")
    run_arms(
        out,
        [(a, s) for a in arms for s in seeds],
        lambda arm, seed: [*shared, *arm_overrides(arm, cfg), f"train.seed={seed}"],
        base_args,
        "collapse",
        lock,
    )
    runs = {
        a: {s: read_metrics(out / a / f"seed{s}" / "metrics.jsonl") for s in seeds} for a in arms
    }
    res = summarise(runs, eval_k, sft_eval)
    res["seeds"] = list(seeds)
    res["windows"] = list(windows)
    res["unclosed_think"] = unclosed_think
    res["replay"] = replay
    res["eval_every"] = eval_every
    table = format_markdown(res)
    (out / "collapse.md").write_text(table + "\n")
    (out / "collapse.json").write_text(json.dumps(json_safe(res), indent=1, allow_nan=False))
    plot(res, out / "collapse.png")
    return {"json": res, "table": table}


def _evaluate_cold_start(cfg: Config) -> None:
    """The cold start's held-out evaluation: ``paravt.train.run`` of ``cfg`` (``train.steps=0``:
    no step, one ``eval_after`` evaluation), in this process (one model load, no interpreter
    start). A SIGTERM/SIGUSR1 during it stops the run there (``paravt.preempt``) and then the
    driver (``DriverInterrupted``); a rerun redoes the evaluation."""
    from paravt.train import run

    res = run(cfg)
    if res.get("preempted"):
        sig = signal.Signals[res["preempted"]["signal"]]
        raise DriverInterrupted(sig, "the cold start's evaluation", 0)


def _evaluated_at(run_dir: Path, eval_k: Sequence[int]) -> bool:
    """Whether ``run_dir`` holds a finished evaluation with every K of ``eval_k`` (the cold
    start's evaluation is redone when ``--eval-k`` asks for a K it lacks)."""
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "eval_after"]
    return bool(rows) and all(f"K{k}_tools/accuracy" in rows[-1] for k in eval_k)


def _int_list(flag: str, raw: str) -> list[int]:
    try:
        xs = [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {raw!r} is not a comma list of integers") from None
    if not xs or min(xs) < 1:
        raise ConfigError(f"{flag} {raw!r}: give integers >= 1")
    return xs


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m paravt.experiments collapse ...`` (``paravt.experiments.cli.main``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        prog="python -m paravt.experiments collapse", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--seeds", type=int, default=3, help="number of seeds")
    p.add_argument("--first-seed", type=int, default=0, help="seeds first..first+seeds-1")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    p.add_argument("--out", default="runs/collapse")
    p.add_argument("--eval-k", default="2,4,8,16,32", help="held-out accuracy at these K (tools)")
    p.add_argument(
        "--eval-every",
        type=int,
        default=25,
        help="held-out evaluation every N steps (0: only after RL)",
    )
    p.add_argument("--windows", default="2,3", help="crop windows per SFT trajectory (choices)")
    p.add_argument(
        "--unclosed-think",
        type=float,
        default=1.0,
        help="share of the cold start's tool turns that never close <think> (the fragile "
        "format; chosen on seeds 0-1, docs/collapse_notes.md: at 0.5 and 0.75 GRPO repairs the "
        "tool turn and keeps calling, at 1.0 vanilla drops the tool)",
    )
    p.add_argument(
        "--replay",
        type=float,
        default=0.25,
        help="share of the cold start's stage-2 records that are stage 1's direct answers "
        "(replayed so that a clean answer without the tool survives the all-tool SFT)",
    )
    p.add_argument(
        "--base-steps",
        type=int,
        default=None,
        help="stage 1 of the cold start: SFT steps of the preset's own recipe before the "
        "all-tool SFT (default: the preset's sft.steps, 4000 for tiny_cpu; 0: no stage 1, the "
        "all-tool SFT starts from the random tiny model; ignored with model.path=...)",
    )
    p.add_argument("--preset", default="tiny_cpu")
    p.add_argument(
        "--config", action="append", default=None, help="YAML (default configs/collapse.yaml)"
    )
    p.add_argument("overrides", nargs="*", help="dotted key=value for every run")
    # Intermixed: key=value overrides may come before and after the flags (a rerun that
    # appends "--arms vanilla algo.lr=..." to the first command's line).
    args = p.parse_intermixed_args(argv)
    configs = args.config if args.config is not None else [str(DEFAULT_CONFIG)]

    def body() -> dict:
        if args.seeds < 1:
            raise ConfigError(f"--seeds {args.seeds} must be >= 1")
        if args.first_seed < 0:
            raise ConfigError(f"--first-seed {args.first_seed} must be >= 0")
        if args.eval_every < 0:
            raise ConfigError(f"--eval-every {args.eval_every} must be >= 0 (0 = only after RL)")
        arms = parse_arms(args.arms, list(ARMS))  # before the config: cheap flags first
        eval_k = _int_list("--eval-k", args.eval_k)
        windows = _int_list("--windows", args.windows)
        cfg = load_config(args.preset, configs, args.overrides)
        if errs := preset_errors(args.preset, cfg):  # e.g. the 8B presets' model.path
            raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errs))
        stage1 = load_config(args.preset, [], [])  # the embedded default's SFT recipe
        if args.base_steps is not None:
            if args.base_steps < 0:
                raise ConfigError(f"--base-steps {args.base_steps} must be >= 0")
            stage1 = replace(stage1, sft=replace(stage1.sft, steps=args.base_steps))
        base = ["--preset", args.preset]
        for c in configs:
            base += ["--config", c]
        return collapse(
            cfg,
            out=Path(args.out),
            arms=arms,
            seeds=list(range(args.first_seed, args.first_seed + args.seeds)),
            eval_k=eval_k,
            eval_every=args.eval_every,
            windows=windows,
            base_args=[*base, *args.overrides],
            unclosed_think=args.unclosed_think,
            replay=args.replay,
            base=stage1 if stage1.sft.steps > 0 else None,
        )

    return run_driver("collapse", body, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
