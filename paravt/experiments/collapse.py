"""``python -m paravt.experiments collapse`` — does vanilla GRPO lose tool use, and does
PARA-GRPO keep it? (docs/DESIGN.md, "The collapse experiment, protocol 3".)

    python -m paravt.experiments collapse [--seeds 3] [--first-seed 0] [--arms a,b,...]
        [--out runs/collapse] [--preset tiny_cpu] [--config configs/collapse.yaml ...]
        [--windows 2,3] [--unclosed-think 0.75] [--replay 0.25] [--eval-every 25]
        [--eval-k 4,32] [key=value ...]

Protocol 3 (``docs/collapse/protocol3/PREREGISTRATION.md``; protocols 1 and 2 in
``docs/collapse/`` and ``docs/collapse_notes.md``):

1. **A task whose need for the tool the overview cannot show** (``data.synth_task=spot_late``,
   ``configs/collapse.yaml``): a 4-6 s square and, in half the videos, a brief later one; the
   question asks for the last. At vanilla's K = 32 the overview misses the brief square about
   half the time and then looks like a one-square video. Every row records, per K, whether
   its overview misses the square asked about (``need_K{K}``), and the held-out evaluation's
   per-prompt rows carry it.
2. **Per seed, its own task instance and cold start** (:func:`seed_config`; ``OUT/data/seedN``,
   ``OUT/cold/seedN``; both SFT stages single-threaded, so thread counts do not change them).
   Stage 1 (:func:`base_sft`, ``--base-steps``, default the preset's own 4000-step recipe;
   ``model.path=...`` skips it) learns the task from its oracle records with the ``<think>``
   tags removed: a format prior of its own. Stage 2 (:func:`cold_start`, ``sft.*`` of
   ``configs/collapse.yaml``) lays the tags over it: every trajectory calls ``crop_video`` on
   ``n`` equal windows of the whole video whatever K (``--windows``), a share
   ``--unclosed-think`` u of the tool turns never closes ``<think>`` (below 1, so closed tool
   turns stay in the support), and ``--replay`` mixes in direct answers. The records of both
   stages are the data layer's (``paravt.data.cold_start``: ``base_records``,
   ``all_tool_records``, ``replay_records``). One evaluation of each cold start
   (``OUT/cold/seedN/sft_eval``, ``paravt.train.run`` with ``train.steps=0``) gives the start
   values.
3. **Arms** (``paravt.experiments.arms.arm_overrides``): ``vanilla`` (fixed K = the largest
   budget; no anchoring), ``vanilla_ref`` (the reference implementation's vanilla: no pinned
   ``<think>``, its closure-blind format reward, answer fallbacks and R_tool), ``anchoring``,
   ``gating``, ``paragrpo``, ``paragrpo_no_rtool``; every arm × seed is one ``python -m
   paravt.train`` run from its seed's cold start into ``OUT/ARM/seedN``
   (``paravt.experiments.arms.run_arms``, the one driver the ablation uses too). What this
   experiment reads is the training run's own: a held-out evaluation every ``--eval-every``
   steps (``train.eval_every``: ``eval_step`` rows, per-prompt rows in ``heldout.jsonl``) and
   per step the mean group advantage of rollouts with and without a crop in groups holding
   both (``adv/tool``, ``adv/no_tool``, ``adv/mixed_groups``).
4. ``OUT/collapse.json``, ``OUT/collapse.md`` (printed) and ``OUT/collapse.png``
   (:func:`summarise`): per arm κ and fτ at the start (step 1) and the end (mean of the last
   5 steps) at the arm's own K, held-out accuracy per K, the diagnosis, and **every arm at the
   same K** (:func:`same_k`, each K of ``--eval-k``): tool-call rate on prompts that need the
   tool and on those that do not, accuracy on each, fτ and tool-turn ``</think>`` closure, with
   the cold starts' values before RL; then the pre-registered bars (:func:`bars`), each
   ``{"mean", "std"}`` over seeds, with per-seed values and per-step curves.

A rerun into the same ``--out`` keeps each seed's data, cold start (its stamp matching), its
evaluation and every finished run (``eval_after`` in ``metrics.jsonl``) whose ``stamp.json``
matches what the rerun would run, resumes (``--resume``) a run cut short that holds a
checkpoint and redoes the others. ``OUT/.lock`` refuses a second command into a folder a live
one holds; SIGTERM / SIGINT / SIGUSR1 to the command reach the arm run's process group (the
run stops, then the command, exit 128 + the signal).

Honest limits: the crop windows are fixed per video duration (the tiny model cannot copy
numbers, see README), so crop placement does not depend on the overview; held-out values are
measured every ``--eval-every`` steps, not at every step.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from paravt.assets import prepare_assets
from paravt.config import Config, ConfigError, ConfigHelpParser, load_config, preset_errors
from paravt.data.cold_start import all_tool_records, base_records, check_task, replay_records
from paravt.data.sft_records import write_sft_records
from paravt.distributed import DistContext
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
    sft_stamp,
    task_stamp,
    train_checkpoint,
    write_stamp,
)
from paravt.files import write_atomic
from paravt.metrics import json_safe, mean_or_nan, read_metrics, sample_std
from paravt.train import run

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
def seed_config(cfg: Config, out: Path, seed: int) -> Config:
    """``cfg`` for seed ``seed``: its own task instance (``data.synth_seed`` = the seed, in
    ``OUT/data/seedN``: videos, training rows and held-out prompts of its own) and
    ``train.seed`` (the SFT's data order and the RL run's sampling)."""
    data = replace(cfg.data, synth_seed=seed, synth_dir=str(out / "data" / f"seed{seed}"))
    return replace(cfg, data=data, train=replace(cfg.train, seed=seed))


def seed_overrides(out: Path, seed: int) -> list[str]:
    """:func:`seed_config` as ``key=value`` overrides (the arm runs')."""
    return [
        f"data.synth_seed={seed}",
        f"data.synth_dir={out / 'data' / f'seed{seed}'}",
        f"train.seed={seed}",
    ]


class _OneThread:
    """Torch on one intra-op thread inside the block: the cold start's SFT gives the same
    weights whatever the machine's (or the caller's) thread count, on one kind of CPU."""

    def __enter__(self) -> None:
        import torch

        self.n = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        import torch

        torch.set_num_threads(self.n)


def _no_think(cfg: Config) -> Config:
    return replace(cfg, agent=replace(cfg.agent, think_prefix=""))


def base_sft(cfg: Config, cold: Path, base: Config) -> str:
    """Stage 1 of a seed's cold start (``cold`` = ``OUT/cold/seedN``; ``cfg``: the seed's,
    :func:`seed_config`): the model that already reads the task, as a pretrained VLM does
    before a tool-use SFT (the paper's SFT starts from Qwen3-VL, which answers from frames
    without tools). ``cfg.model.path`` set: that checkpoint is the base (nothing trained).
    Otherwise ``cold/base_sft``: the embedded default's own SFT recipe (``base.sft``: 4000
    cosine steps for ``tiny_cpu``) from the random tiny model on
    ``paravt.data.cold_start.base_records`` (the task's oracle rows without ``<think>``,
    ``agent.think_prefix`` empty); made once, reused by a rerun. Single-threaded (:class:`_OneThread`)."""

    if cfg.model.path:
        return cfg.model.path
    dst, stamp = cold / "base_sft", cold / "base_sft_params.json"
    made = {
        "sft": sft_stamp(base.sft),
        "seed": cfg.train.seed,
        "think": "untagged",
        **task_stamp(cfg),
    }
    if reused_checkpoint(dst, "collapse", stamp, made):
        return str(dst)
    if base.sft.steps < 1:
        raise ConfigError(
            "--base-steps must be >= 1 (or give model.path=CHECKPOINT as the base model)"
        )
    dirs = prepare_assets(cfg, DistContext())

    data = cold / "base_data.jsonl"
    write_sft_records(data, base_records(dirs[0]))
    scfg = _no_think(replace(cfg, sft=replace(base.sft, data=str(data))))
    what = f"base SFT {base.sft.steps} steps (the default's recipe, no <think>)"
    with _OneThread():
        train_checkpoint(scfg, dst, "collapse", what, dirs=dirs, stamp=stamp, made=made)
    return str(dst)


def cold_start(
    cfg: Config,
    cold: Path,
    windows: Sequence[int],
    unclosed_think: float = 0.0,
    base: Config | None = None,
    replay: float = 0.0,
) -> Path:
    """A seed's SFT checkpoint ``cold/sft`` (``cfg``: the seed's, :func:`seed_config`): stage
    1 (:func:`base_sft`; ``base`` None: train from ``cfg.model.path`` or the random tiny model
    directly), then stage 2, ``cfg.sft`` on ``paravt.data.cold_start.all_tool_records`` and
    ``paravt.data.cold_start.replay_records``, with ``<think>`` pinned as the agent pins it
    (``agent.think_prefix``: learnt with it empty, the model's own ``<think>`` and newline
    tokenise unlike the pinned prefix and the pinned arms' rollouts came out garbled: held-out
    accuracy 0.19-0.25 at K = 32, parse errors 0.5-0.7, seed 0). Made once, single-threaded
    (:class:`_OneThread`); a rerun reuses it, and refuses one made with other settings
    (``cold/sft_params.json``)."""

    start = base_sft(cfg, cold, base) if base is not None else cfg.model.path
    dst, stamp = cold / "sft", cold / "sft_params.json"
    made = {
        "windows": list(windows),
        "unclosed_think": unclosed_think,
        **({"replay": replay} if replay else {}),
        "sft": sft_stamp(cfg.sft),
        "seed": cfg.train.seed,
        "think_prefix": cfg.agent.think_prefix,
        **task_stamp(cfg),
        "model_path": start,
    }
    if reused_checkpoint(dst, "collapse", stamp, made):
        return dst
    if cfg.sft.steps < 1:
        raise ConfigError("sft.steps must be >= 1: every arm starts from the collapse cold start")
    scfg = replace(cfg, model=replace(cfg.model, path=start))
    dirs = prepare_assets(scfg, DistContext())
    recs = all_tool_records(dirs[0], cfg, windows, unclosed_think)
    recs += replay_records(dirs[0], len(recs), replay)

    data = cold / "sft_data.jsonl"
    write_sft_records(data, recs)
    scfg = replace(scfg, sft=replace(cfg.sft, data=str(data)))
    what = f"all-tool SFT {cfg.sft.steps} steps on {data} from {start or 'random init'}"
    with _OneThread():
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


#: The same-K metrics (:func:`same_k`), each per K of ``--same-k`` and seed.
SAME_K_KEYS = (
    "tool_rate_need",
    "tool_rate_no_need",
    "acc_need",
    "acc_no_need",
    "format",
    "tool_turn_closure",
    "share_need",
)


def same_k(held: Sequence[dict[str, Any]], ks: Sequence[int]) -> dict[str, dict[str, float]]:
    """Every arm measured at the same K, prompt by prompt: from the per-prompt rows of a run's
    last held-out evaluation (``heldout.jsonl`` rows of kind ``eval_after``; the cold start's
    evaluation is one too), for each K of ``ks`` (its ``K{K}_tools`` condition): the tool-call
    rate on the prompts whose K-frame overview misses the square asked about (``need_K{K}``,
    recorded by the generator: ``paravt.data.synth.need_flags``) and on the others, accuracy
    on each, format compliance fτ and the ``</think>`` closure of tool-calling turns over all
    of them, and the share of prompts that need the tool. Each is a mean over prompts of the
    prompt's mean over its samples (NaN: no such prompt, or no tool turn)."""
    last = [r for r in held if r.get("kind") == "eval_after"]
    step = max((r["step"] for r in last), default=None)
    out: dict[str, dict[str, float]] = {}
    for k in ks:
        rows = [
            r
            for r in last
            if r["step"] == step and r.get("condition") == f"K{k}_tools" and int(r["K"]) == k
        ]
        need = [r for r in rows if (r.get("extra") or {}).get(f"need_K{k}") is True]
        free = [r for r in rows if (r.get("extra") or {}).get(f"need_K{k}") is False]

        def m(rs: Sequence[dict[str, Any]], key: str) -> float:
            return mean_or_nan([x for x in (_num(r, key) for r in rs) if x == x])

        out[str(k)] = {
            "tool_rate_need": m(need, "tool_call_rate"),
            "tool_rate_no_need": m(free, "tool_call_rate"),
            "acc_need": m(need, "accuracy"),
            "acc_no_need": m(free, "accuracy"),
            "format": m(rows, "format_compliance"),
            "tool_turn_closure": m(rows, "tool_turn_closure"),
            "share_need": len(need) / len(rows) if rows else float("nan"),
            "prompts": float(len(rows)),
        }
    return out


def _same_k_ms(vals: Sequence[dict[str, dict[str, float]]], ks: Sequence[int]) -> dict:
    """:func:`same_k` of several seeds as ``K -> key -> {"mean", "std"}``."""
    return {str(k): {key: _ms([v[str(k)][key] for v in vals]) for key in SAME_K_KEYS} for k in ks}


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
    sft_eval: dict[int, dict[str, Any]],
    held: dict[str, dict[int, list[dict[str, Any]]]] | None = None,
    sft_held: dict[int, list[dict[str, Any]]] | None = None,
    same_ks: Sequence[int] = (),
) -> dict[str, Any]:
    """``collapse.json``: per arm ``kappa_start``, ``kappa_end``, ``format_start``,
    ``format_end``, ``tool_rate_end``, ``mixed_steps``, ``adv_tool_mixed``,
    ``adv_no_tool_mixed`` as ``{"mean", "std"}`` over seeds; ``tool_rate_end_k``,
    ``acc_end_k`` and ``tool_rate_heldout_k`` (K -> ``{"mean", "std"}``; a seed whose value
    is NaN is left out of that K's mean); ``same_k`` (K of ``same_ks`` -> :func:`same_k`'s
    keys -> ``{"mean", "std"}``, from ``held``: arm -> seed -> ``heldout.jsonl`` rows);
    ``seeds`` (per seed: its number and values) and ``curves`` (the held-out ``eval/K*`` ones
    start at step 0 with the cold starts'). Also ``sft`` (the cold starts' held-out
    evaluations, ``sft_eval``: seed -> its ``eval_after`` row; per K the mean over seeds, and
    ``sft_std``), ``same_k_start`` (the cold starts' :func:`same_k`, from ``sft_held``) and
    ``bars`` (:func:`bars`). See :func:`seed_values`."""
    held = held or {}
    sft_held = sft_held or {}
    arms: dict[str, Any] = {}
    for arm, by_seed in runs.items():
        vals = {s: seed_values(rows, eval_k) for s, rows in by_seed.items()}
        for s, v in vals.items():
            v["same_k"] = same_k(held.get(arm, {}).get(s, []), same_ks)
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
        entry["same_k"] = _same_k_ms([v["same_k"] for v in vals.values()], same_ks)
        entry["seeds"] = [{"seed": s, **v} for s, v in vals.items()]
        entry["curves"] = curves(list(by_seed.values()), CURVE_KEYS)
        for k in eval_k:  # step 0 of the held-out curves: the cold starts' evaluations
            xs = [_num(sft_eval.get(s, {}), f"K{k}_tools/accuracy") for s in by_seed]
            if (start := _ms(xs))["mean"] == start["mean"]:
                c = entry["curves"].setdefault(f"eval/K{k}", {"step": [], "mean": [], "std": []})
                c["step"].insert(0, 0)
                c["mean"].insert(0, start["mean"])
                c["std"].insert(0, start["std"])
        arms[arm] = entry
    sft: dict[str, dict[str, float]] = {}
    sft_std: dict[str, dict[str, float]] = {}
    for k in eval_k:
        p = f"K{k}_tools/"
        keys = {
            "kappa": "tool_calls_per_rollout",
            "tool_rate": "tool_call_rate",
            "format": "format_compliance",
            "parse_errors": "parse_error_rate",
            "accuracy": "accuracy",
        }
        ms = {
            name: _ms([_num(r, p + key) for r in sft_eval.values()]) for name, key in keys.items()
        }
        sft[str(k)] = {name: v["mean"] for name, v in ms.items()}
        sft_std[str(k)] = {name: v["std"] for name, v in ms.items()}
    start_vals = {s: same_k(rows, same_ks) for s, rows in sft_held.items()}
    res = {
        "arms": arms,
        "sft": sft,
        "sft_std": sft_std,
        "same_k_start": _same_k_ms(list(start_vals.values()), same_ks),
        "same_k_start_seeds": [{"seed": s, "same_k": v} for s, v in start_vals.items()],
        "eval_k": list(eval_k),
        "same_ks": list(same_ks),
        "end_steps": END_STEPS,
    }
    res["bars"] = bars(res)
    return res


#: The pre-registered bars (docs/collapse/protocol3/PREREGISTRATION.md), at this K.
BAR_K = 32


def bars(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The pre-registered bars of protocol 3 (``docs/collapse/protocol3/PREREGISTRATION.md``),
    judged on ``res`` (:func:`summarise`) at K = ``BAR_K``, every arm at the same K, held out:

    (a) vanilla's tool-call rate on prompts that need the tool ≤ 0.5× the cold start's, and
    its accuracy on them not above the cold start's; PARA-GRPO's rate ≥ 0.5× the cold
    start's; the PARA-GRPO − vanilla gaps in that rate and in that accuracy each larger than
    twice the larger of the two arms' seed std;
    (b) anchoring's fτ above vanilla's, and PARA-GRPO's tool-turn ``</think>`` closure above
    gating's, each by more than twice the larger std;
    (c1, protocol 4, ``docs/collapse/protocol4/PREREGISTRATION.md``) the precondition that the
    question is asked on a world where the tools pay: the cold start's accuracy on the
    prompts that need the tool at least 0.5 (protocol 3's cold starts: 0.08-0.31).

    Each bar: ``{"id", "bar", "lhs", "rhs", "met"}`` (``met`` None when an arm or value it
    needs is missing). Means over seeds; the cold start's is the mean of the seeds' own."""
    k = str(BAR_K)
    arms = res["arms"]
    start = res.get("same_k_start", {}).get(k, {})

    def v(arm: str, key: str) -> tuple[float, float]:
        if arm not in arms or k not in arms[arm].get("same_k", {}):
            return float("nan"), float("nan")
        x = arms[arm]["same_k"][k][key]
        return x["mean"], x["std"]

    def s0(key: str) -> float:
        return start.get(key, {}).get("mean", float("nan"))

    def bar(id_: str, text: str, lhs: float, rhs: float, op: str) -> dict[str, Any]:
        ok = None if lhs != lhs or rhs != rhs else {"<=": lhs <= rhs, ">=": lhs >= rhs,
                                                     ">": lhs > rhs}[op]  # fmt: skip
        return {"id": id_, "bar": text, "lhs": lhs, "rhs": rhs, "met": ok}

    def gap(a: str, b: str, key: str) -> tuple[float, float]:
        (ma, sa), (mb, sb) = v(a, key), v(b, key)
        return ma - mb, 2 * max(sa, sb)

    van_rate, par_rate = v("vanilla", "tool_rate_need")[0], v("paragrpo", "tool_rate_need")[0]
    return [
        bar("a1", "vanilla's tool rate on needing prompts <= 0.5x the cold start's",
            van_rate, 0.5 * s0("tool_rate_need"), "<="),
        bar("a2", "vanilla's accuracy on needing prompts not above the cold start's",
            v("vanilla", "acc_need")[0], s0("acc_need"), "<="),
        bar("a3", "PARA-GRPO's tool rate on needing prompts >= 0.5x the cold start's",
            par_rate, 0.5 * s0("tool_rate_need"), ">="),
        bar("a4", "PARA-GRPO - vanilla tool rate on needing prompts > 2x the larger std",
            *gap("paragrpo", "vanilla", "tool_rate_need"), ">"),
        bar("a5", "PARA-GRPO - vanilla accuracy on needing prompts > 2x the larger std",
            *gap("paragrpo", "vanilla", "acc_need"), ">"),
        bar("b1", "anchoring - vanilla format compliance > 2x the larger std",
            *gap("anchoring", "vanilla", "format"), ">"),
        bar("b2", "PARA-GRPO - gating tool-turn </think> closure > 2x the larger std",
            *gap("paragrpo", "gating", "tool_turn_closure"), ">"),
        bar("c1", "the cold start's accuracy on needing prompts >= 0.5 (its tools pay)",
            s0("acc_need"), 0.5, ">="),
    ]  # fmt: skip


def _cell(ms: dict[str, float]) -> str:
    m, s = ms["mean"], ms["std"]
    return "n/a" if m != m else f"{m:.2f} ± {s:.2f}"


def format_markdown(res: dict[str, Any]) -> str:
    """``collapse.md``: the cold start's held-out numbers, then one row per arm."""
    ks = res["eval_k"]
    lines = [
        "# Collapse experiment",
        "",
        "Cold starts (one per seed; mean over seeds), held-out, with tools, T = rollout "
        "temperature:",
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
    names = {
        "tool_rate_need": "tool rate, needs tool",
        "tool_rate_no_need": "tool rate, does not",
        "acc_need": "accuracy, needs tool",
        "acc_no_need": "accuracy, does not",
        "format": "fτ",
        "tool_turn_closure": "tool-turn closure",
        "share_need": "share needing",
    }
    for k in res.get("same_ks", []):
        lines += [
            "",
            f"Every arm at the same K = {k}, held out, split prompt by prompt by whether the "
            f"K = {k} overview misses the square asked about (cold start: before RL):",
            "",
            "| arm | " + " | ".join(names[key] for key in SAME_K_KEYS) + " |",
            "|" + "---|" * (1 + len(SAME_K_KEYS)),
        ]
        rows = [("cold start", res["same_k_start"].get(str(k), {}))]
        rows += [(arm, a["same_k"].get(str(k), {})) for arm, a in res["arms"].items()]
        for arm, vals in rows:
            cells = [vals.get(key, {"mean": float("nan"), "std": 0.0}) for key in SAME_K_KEYS]
            lines.append(f"| {arm} | " + " | ".join(_cell(c) for c in cells) + " |")
    if res.get("bars"):
        lines += [
            "",
            f"Pre-registered bars (docs/collapse/protocol3/ and protocol4/PREREGISTRATION.md), "
            f"K = {BAR_K}:",
            "",
            "| bar | | left | right | met |",
            "|---|---|---|---|---|",
        ]
        for b in res["bars"]:
            met = {True: "**met**", False: "not met", None: "n/a"}[b["met"]]
            lines.append(f"| {b['id']} | {b['bar']} | {b['lhs']:.3f} | {b['rhs']:.3f} | {met} |")
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
    check_task(cfg)
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
    conds = "[" + ",".join(f"{k}:tools" for k in eval_k) + "]"
    shared = [
        "sft.steps=0",
        f"train.eval_conditions={conds}",
        f"train.eval_every={eval_every}",
        "train.eval_before=false",  # every arm's start: its cold start's one evaluation
        "train.progress=false",
        "train.summary_plot=false",  # collapse.png is the figure
        "train.save_every=0",  # the last step's checkpoint, and a preempted run's
        "train.keep_last=1",
    ]
    colds: dict[int, Path] = {}
    sft_eval: dict[int, dict[str, Any]] = {}
    sft_held: dict[int, list[dict[str, Any]]] = {}
    for seed in seeds:  # each seed's own task instance and cold start
        cold = out / "cold" / f"seed{seed}"
        cold.mkdir(parents=True, exist_ok=True)
        colds[seed] = cold_start(
            seed_config(cfg, out, seed), cold, windows, unclosed_think, base, replay
        )
        ev_dir = cold / "sft_eval"
        eval_cfg = load_args(
            base_args,
            [*shared, f"model.path={colds[seed]}", *seed_overrides(out, seed), "train.steps=0",
             f"train.out_dir={ev_dir}"],
        )  # fmt: skip
        stamp = run_stamp(eval_cfg)
        keep, why = kept_run(ev_dir, stamp)
        if not (keep and _evaluated_at(ev_dir, eval_k)):  # in this process: one model load
            if run_finished(ev_dir):
                print(f"[collapse] seed {seed}: cold start's evaluation {why}: redone", flush=True)
            shutil.rmtree(ev_dir, ignore_errors=True)
            ev_dir.mkdir(parents=True)
            write_stamp(ev_dir, stamp)
            _evaluate_cold_start(eval_cfg)
        rows = read_metrics(ev_dir / "metrics.jsonl")
        sft_eval[seed] = next(r for r in rows if r.get("kind") == "eval_after")
        sft_held[seed] = read_metrics(ev_dir / "heldout.jsonl")
        print(
            f"[collapse] seed {seed}: cold start evaluated "
            f"({(time.perf_counter() - t0) / 60:.1f} min)",
            flush=True,
        )
    run_arms(
        out,
        [(a, s) for a in arms for s in seeds],
        lambda arm, seed: [
            *shared,
            f"model.path={colds[seed]}",
            *seed_overrides(out, seed),
            *arm_overrides(arm, cfg),
        ],  # fmt: skip
        base_args,
        "collapse",
        lock,
    )
    runs = {
        a: {s: read_metrics(out / a / f"seed{s}" / "metrics.jsonl") for s in seeds} for a in arms
    }
    held = {
        a: {s: read_metrics(out / a / f"seed{s}" / "heldout.jsonl") for s in seeds} for a in arms
    }
    res = summarise(runs, eval_k, sft_eval, held, sft_held, same_ks=eval_k)
    res["seeds"] = list(seeds)
    res["task"] = cfg.data.synth_task
    # q of the phase diagram (paravt.experiments.phase); None on the tasks without a decoy
    res["decoy_share"] = cfg.data.synth_decoy_share if cfg.data.synth_task == "spot_decoy" else None
    res["windows"] = list(windows)
    res["unclosed_think"] = unclosed_think
    res["replay"] = replay
    res["eval_every"] = eval_every
    res["minutes"] = (time.perf_counter() - t0) / 60
    table = format_markdown(res)
    write_atomic(out / "collapse.md", table + "\n")
    write_atomic(out / "collapse.json", json.dumps(json_safe(res), indent=1, allow_nan=False))
    plot(res, out / "collapse.png")
    return {"json": res, "table": table}


def _evaluate_cold_start(cfg: Config) -> None:
    """The cold start's held-out evaluation: ``paravt.train.run`` of ``cfg`` (``train.steps=0``:
    no step, one ``eval_after`` evaluation), in this process (one model load, no interpreter
    start). A SIGTERM/SIGUSR1 during it stops the run there (``paravt.preempt``) and then the
    driver (``DriverInterrupted``); a rerun redoes the evaluation."""

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
    p = ConfigHelpParser(
        prog="python -m paravt.experiments collapse", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--seeds", type=int, default=3, help="number of seeds")
    p.add_argument("--first-seed", type=int, default=0, help="seeds first..first+seeds-1")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    p.add_argument("--out", default="runs/collapse")
    p.add_argument(
        "--eval-k",
        default="4,32",
        help="held-out evaluation at these K (tools): accuracy, and the same-K values split by "
        "need",
    )
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
        default=0.75,
        help="share u of the cold start's tool turns that never close <think> (the fragile "
        "format; protocol 3 runs u in {0.75, 0.9}: below 1, so that a closed tool turn can be "
        "sampled and repaired)",
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
