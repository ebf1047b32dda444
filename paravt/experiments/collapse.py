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
4. ``OUT/collapse.json``, ``OUT/collapse.md`` (printed) and ``OUT/collapse.png``, written by
   ``paravt.experiments.report`` (``summarise`` into a ``CollapseResult``): per arm κ and fτ
   at the start (step 1) and the end (mean of the last 5 steps) at the arm's own K, held-out
   accuracy per K, the diagnosis, and **every arm at the same K** (``report.same_k``, each K
   of ``--eval-k``): tool-call rate on prompts that need the tool and on those that do not,
   accuracy on each, fτ and tool-turn ``</think>`` closure, with the cold starts' values
   before RL; then the pre-registered bars (``report.bars``), each ``{"mean", "std"}`` over
   seeds, with per-seed values and per-step curves.

A rerun into the same ``--out`` keeps each seed's data, cold start (its stamp matching), its
evaluation and every finished run (``eval_after`` in ``metrics.jsonl``) whose ``stamp.json``
matches what the rerun would run, resumes (``--resume``) a run cut short that holds a
checkpoint and redoes the others. ``OUT/.lock`` refuses a second command into a folder a live
one holds; SIGTERM / SIGINT / SIGUSR1 to the command reach the arm run's process group (the
run stops, then the command, exit 128 + the signal).

Honest limits: the crop windows are fixed per video duration (the tiny model cannot copy
numbers, see docs/collapse_notes.md), so crop placement does not depend on the overview; held-out values are
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
    sft_stamp,
    task_stamp,
    train_checkpoint,
    write_stamp,
)
from paravt.experiments.paired import markdown as paired_markdown
from paravt.experiments.paired import paired_report
from paravt.experiments.report import BAR_K, RunInfo, format_markdown, plot, summarise
from paravt.files import write_atomic
from paravt.log import get_logger
from paravt.metrics import json_safe, read_metrics
from paravt.train import run

log = get_logger(__name__)

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
    cold_only: bool = False,
) -> dict[str, Any]:
    """Run the experiment (module docstring); returns ``{"result", "table"}``. ``base_args``:
    the ``--preset``/``--config``/overrides that built ``cfg``; ``base``: the config whose
    ``sft`` trains the cold start's stage 1 (:func:`base_sft`; None: no stage 1);
    ``cold_only``: each seed's cold start and its evaluation, no arm run (``result`` None,
    ``table`` the cold starts' values and protocol 5's preconditions,
    ``paravt.experiments.paired``): how protocol 5 tunes a cold-start regime on seeds 0-2."""
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
            base, replay, lock, cold_only,
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
    cold_only: bool = False,
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
                log.info(f"[collapse] seed {seed}: cold start's evaluation {why}: redone")
            shutil.rmtree(ev_dir, ignore_errors=True)
            ev_dir.mkdir(parents=True)
            write_stamp(ev_dir, stamp)
            _evaluate_cold_start(eval_cfg)
        rows = read_metrics(ev_dir / "metrics.jsonl")
        sft_eval[seed] = next(r for r in rows if r.get("kind") == "eval_after")
        sft_held[seed] = read_metrics(ev_dir / "heldout.jsonl")
        log.info(
            f"[collapse] seed {seed}: cold start evaluated "
            f"({(time.perf_counter() - t0) / 60:.1f} min)"
        )
    if cold_only:
        k = BAR_K if BAR_K in eval_k else max(eval_k)
        rep = paired_report({"cold start": [out]}, k=k, cold_only=True)
        return {"result": None, "table": paired_markdown(rep)}
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
    res = summarise(runs, eval_k, sft_eval, held, sft_held, same_ks=eval_k, descriptions=ARMS)
    task = cfg.data.synth_task
    res.run = RunInfo(
        seeds=list(seeds),
        task=task,
        # q of the phase diagram (paravt.experiments.phase); None on the tasks without a decoy
        decoy_share=cfg.data.synth_decoy_share if task == "spot_decoy" else None,
        windows=list(windows),
        unclosed_think=unclosed_think,
        replay=replay,
        eval_every=eval_every,
        minutes=(time.perf_counter() - t0) / 60,
    )
    table = format_markdown(res)
    write_atomic(out / "collapse.md", table + "\n")
    data = json.dumps(json_safe(res.to_dict()), indent=1, allow_nan=False)
    write_atomic(out / "collapse.json", data)
    plot(res, out / "collapse.png")
    return {"result": res, "table": table}


def _evaluate_cold_start(cfg: Config) -> None:
    """The cold start's held-out evaluation: ``paravt.train.run`` of ``cfg`` (``train.steps=0``:
    no step, one ``eval_after`` evaluation), in this process (one model load, no interpreter
    start). A SIGTERM/SIGUSR1 during it stops the run there (``paravt.preempt``) and then the
    driver (``DriverInterrupted``); a rerun redoes the evaluation."""

    res = run(cfg)
    if res.stopped is not None:
        sig = signal.Signals[res.stopped.signal]
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
    p.add_argument(
        "--cold-only",
        action="store_true",
        help="each seed's cold start and its evaluation only, no arm run (protocol 5's tuning "
        "of a cold-start regime; read them with python -m paravt.experiments paired)",
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
            cold_only=args.cold_only,
        )

    return run_driver("collapse", body, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
