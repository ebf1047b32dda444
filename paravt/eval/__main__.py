"""``python -m paravt.eval`` — score a checkpoint on a long-video benchmark with the agent loop
it was trained with.

    python -m paravt.eval --benchmark NAME --data-root DIR [--model PATH] [--engine hf|vllm]
        [--limit N] [--out DIR] [--crop-mode subagent|frames] [--frames K] [--batch-size B]
        [--preset P] [--config F.yaml ...] [key=value ...]
    torchrun --nproc-per-node N -m paravt.eval ...      (samples split across ranks, merged)

NAME: videomme, videomme_sub, longvideobench, lvbench, mlvu, mmvu, charades_sta, synth, jsonl
(``paravt.eval.benchmarks`` documents each one's expected layout under ``--data-root``).
``synth`` without ``--data-root`` is the embedded synthetic task's validation split; ``jsonl``
is your own rows: ``--data-root DIR`` is a dataset folder as training reads it at
``data.path`` (``DIR/val.jsonl``, video paths relative to ``DIR``), read as ``synth`` reads
its folder.

Greedy by default (``rollout.temperature=0``, ``rollout.sub_temperature=0``,
``rollout.top_p=1``; a ``key=value`` override wins, and a ``top_p`` below 1 with greedy
decoding is refused as a contradiction), with the reference protocol's 3 tool rounds and at
most 5 parallel calls. ``--frames`` is checked against the model's context (and vLLM's
``max_model_len``) before anything loads.
``--model`` defaults to ``model.path``, else the newest checkpoint of ``train.out_dir`` (what
``make train`` wrote). A checkpoint of a paravt run is evaluated with that run's
``config.yaml`` (pixel budgets, prompts, token caps: what it trained with) unless ``--config``
is given (a stored config naming plug-in code, ``agent.tools`` / ``reward.extra_terms``
outside paravt, is refused unless ``--trust-plugins``: someone else's run is not code to run);
any other model with ``--preset`` (default ``tiny_cpu``: pass
``--preset qwen3vl_8b_paragrpo`` for Qwen3-VL-8B). Results go to ``--out`` (default
``runs/eval/<benchmark>``): ``results.jsonl``, ``summary.json`` and a markdown table; a rerun
into the same folder resumes (``paravt.eval.runner``) when every setting is the same, and is
refused, naming what differs, otherwise. Exit status: 0, 2 for a refused input, 1 when every
sample failed (nothing was evaluated).
"""

from __future__ import annotations

import argparse
import dataclasses
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from paravt.checkpoint import resolve_and_pin, run_config, weights_fingerprint
from paravt.config import (
    PRESETS,
    Config,
    ConfigError,
    ConfigHelpParser,
    load_config,
    stored_plugin_errors,
)
from paravt.files import FolderError, claim_folder
from paravt.log import get_logger

log = get_logger(__name__)

# Greedy, and the reference protocol's locked agent knobs (3 tool rounds, at most 5 parallel
# calls per turn), unless the user overrides them (their key=value items come after these).
EVAL_DEFAULTS = (
    "rollout.temperature=0",
    "rollout.sub_temperature=0",
    "rollout.top_p=1",  # a checkpoint's config.yaml may carry its training nucleus
    "agent.max_turns=3",
    "agent.max_parallel=5",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    # lazy: the refusals answer before transformers and the model load
    from paravt.engines import ENGINES
    from paravt.eval.benchmarks import BENCHMARK_SPECS

    ap = ConfigHelpParser(prog="python -m paravt.eval", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--benchmark",
        required=True,
        choices=tuple(BENCHMARK_SPECS),
        help="jsonl: your own rows, --data-root DIR holding val.jsonl (the layout of "
        "data.path: id, video relative to DIR, question, answer, question_type, options); "
        "synth: the synthetic task (its validation split when --data-root is not given)",
    )
    ap.add_argument(
        "--data-root",
        default="",
        help="the benchmark as distributed (paravt.eval.benchmarks documents each layout); "
        "for jsonl, your dataset folder",
    )
    ap.add_argument("--model", default="", help="HF model dir or paravt checkpoint dir")
    ap.add_argument("--engine", choices=tuple(ENGINES), default=None, help="rollout.engine")
    ap.add_argument("--limit", type=int, default=None, help="first N samples only")
    ap.add_argument("--out", default="", help="results folder (default runs/eval/<benchmark>)")
    ap.add_argument("--crop-mode", choices=("subagent", "frames"), default=None)
    ap.add_argument("--frames", type=int, default=64, help="overview frames K (default 64)")
    ap.add_argument("--batch-size", type=int, default=8, help="samples per rollout call")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--preset", default="tiny_cpu", choices=sorted(PRESETS))
    ap.add_argument("--config", action="append", default=[], help="YAML file (repeatable)")
    ap.add_argument(
        "--trust-plugins",
        action="store_true",
        help="import the plug-ins (agent.tools, reward.extra_terms) that the checkpoint's "
        "stored config.yaml names; without it such a run is refused (its code never runs)",
    )
    ap.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    # Intermixed: `k=v --limit 3 k2=v2` (overrides on both sides of a flag), as train takes.
    return ap.parse_intermixed_args(argv)


def sampling_errors(cfg: Config) -> list[str]:
    """``rollout.top_p`` < 1 where decoding is greedy: no effect at all when both roles are
    greedy. (An engine that refuses greedy requests with top_p < 1 when either is, vLLM, is
    refused by the config's validation: ``RolloutConfig.validate``.)"""
    r = cfg.rollout
    if r.top_p >= 1:
        return []
    if r.temperature == 0 and r.sub_temperature == 0:
        return [
            f"rollout.top_p={r.top_p:g} has no effect: decoding is greedy (rollout.temperature=0 "
            "and rollout.sub_temperature=0, the eval default); set rollout.top_p=1, or sample "
            "with rollout.temperature>0 (and rollout.sub_temperature>0)"
        ]
    # An engine that refuses greedy requests with top_p < 1 (vLLM) is the config's own check
    # (paravt.config.RolloutConfig.validate), for training too.
    return []


def frames_errors(cfg: Config, frames: int, model_path: str) -> list[str]:
    """``--frames`` against the model's context: the training check
    (:func:`paravt.agent.context.context_budget_errors`, the engine's ``max_model_len``
    included) with K = ``frames``, run before anything loads."""
    # lazy: the refusals answer before transformers and the model load
    from paravt.agent.context import context_budget_errors

    if not (Path(model_path) / "config.json").is_file():
        return []
    at_k = dataclasses.replace(
        cfg, video=dataclasses.replace(cfg.video, gating=False, fixed_frames=frames)
    )
    return [
        f"--frames {frames} does not fit the context of {model_path}: {e} (for an evaluation: "
        "lower --frames)"
        for e in context_budget_errors(at_k, Path(model_path))
    ]


def main(argv: list[str] | None = None) -> int:
    # The checkpoint evaluated is pinned for the whole run (a live run's pruning skips it).
    with ExitStack() as pins:
        return _main(argv, pins)


def _main(argv: list[str] | None, pins: ExitStack) -> int:
    a = parse_args(argv)
    overrides = list(EVAL_DEFAULTS)
    if a.engine:
        overrides.append(f"rollout.engine={a.engine}")
    if a.crop_mode:
        overrides.append(f"agent.crop_mode={a.crop_mode}")
    overrides += list(a.overrides)
    try:
        cfg = load_config(a.preset, a.config, overrides)
        model_path = resolve_and_pin(cfg, a.model, pins)
        trained_with = None if a.config else run_config(model_path)
        if trained_with is not None:  # evaluate with the settings the checkpoint trained with
            ours, cfg = cfg, load_config(a.preset, [str(trained_with)], overrides)
            errs = stored_plugin_errors(ours, cfg, Path(trained_with), a.trust_plugins, "eval")
            if errs:
                raise ConfigError(errs[0])
        if a.frames < 1:
            raise ConfigError(f"--frames {a.frames} must be >= 1")
        if a.batch_size < 1:
            raise ConfigError(f"--batch-size {a.batch_size} must be >= 1")
        if a.limit is not None and a.limit < 1:
            raise ConfigError(f"--limit {a.limit} must be >= 1")
        # lazy: the refusals answer before transformers and the model load
        from paravt.eval.benchmarks import BENCHMARK_SPECS

        data_root = a.data_root
        if not data_root:
            if not BENCHMARK_SPECS[a.benchmark].embedded:
                raise ConfigError(f"--data-root is required for --benchmark {a.benchmark}")
            # lazy: the refusals answer before transformers and the model load
            from paravt.data import resolve_data

            data_root = str(resolve_data(cfg))
        if not Path(data_root).is_dir():
            raise ConfigError(f"--data-root {data_root!r} is not a directory")
        errs = sampling_errors(cfg) + frames_errors(cfg, a.frames, model_path)
        if errs:
            raise ConfigError("\n  - ".join(["invalid evaluation:", *errs]))
    except ConfigError as e:
        log.error(f"error: {e}")
        return 2

    # lazy: the refusals answer before transformers and the model load
    from paravt.eval.benchmarks import BenchmarkFormatError, load_benchmark
    from paravt.eval.runner import EvalSettings, eval_config

    try:
        samples = load_benchmark(a.benchmark, data_root, limit=a.limit)
    except (BenchmarkFormatError, FileNotFoundError) as e:
        log.error(f"error: {e}")
        return 2
    if not samples:
        log.error(f"error: no samples in {data_root} for {a.benchmark}")
        return 1
    r = cfg.rollout
    settings = EvalSettings(
        benchmark=a.benchmark,
        data_root=str(Path(data_root).resolve()),
        model=str(Path(model_path).resolve()),
        engine=r.engine,
        frames=a.frames,
        crop_mode=cfg.agent.crop_mode,
        temperature=r.temperature,
        top_p=r.top_p,
        sub_temperature=r.sub_temperature,
        max_turns=cfg.agent.max_turns,
        max_parallel=cfg.agent.max_parallel,
        max_new_tokens=r.max_new_tokens,
        sub_max_new_tokens=r.sub_max_new_tokens,
        max_tool_response_tokens=cfg.agent.max_tool_response_tokens,
        overview_max_pixels=cfg.video.overview_max_pixels,
        crop_max_pixels=cfg.video.crop_max_pixels,
        crop_max_frames=cfg.video.crop_max_frames,
        crop_fps=cfg.video.crop_fps,
        seed=a.seed,
        preset=a.preset,
        weights=weights_fingerprint(model_path),
        config=eval_config(cfg),
    )
    out = a.out or f"runs/eval/{a.benchmark}"
    # The folder is this evaluation's for its life (rank 0 holds the claim): a second one into
    # it, started at the same moment, is refused instead of interleaving its rows.
    try:
        claim = claim_folder(out, "a paravt.eval evaluation", "pass another --out")
    except FolderError as e:
        log.error(f"error: {e}")
        return 2
    try:
        return _evaluate(a, cfg, samples, settings, out, model_path, trained_with)
    except KeyboardInterrupt:  # Ctrl-C: every finished row is in results.jsonl already
        log.error(
            f"interrupted: the rows finished so far are in {out}/results.jsonl; rerun the same "
            "command to continue from them"
        )
        return 130
    finally:
        if claim is not None:
            claim.release()


def _evaluate(
    a: argparse.Namespace,
    cfg: Config,
    samples: list,
    settings: Any,
    out: str,
    model_path: str,
    trained_with: Any,
) -> int:
    """Load the model and run the evaluation of :func:`main` into ``out`` (held)."""
    # lazy: the refusals answer before transformers and the model load
    from paravt.agent import AgentRunner
    from paravt.distributed import cleanup, init_distributed
    from paravt.engines import make_engine
    from paravt.eval.runner import EvalError, failed_run, run_eval, settings_refusal
    from paravt.files import NotRegularFile
    from paravt.metrics import DiskFullError
    from paravt.models import load_model_from_config

    # Refuse a mismatched resume before the model loads (run_eval checks again, on rank 0,
    # and writes run.json); every rank reads the same files, so all refuse together.
    refused = settings_refusal(Path(out), settings)
    if refused:
        log.error(f"error: {refused}")
        return 2
    ctx = init_distributed(cfg.model.device)
    if ctx.is_main:
        v = cfg.video
        log.info(
            f"[eval] {a.benchmark}: {len(samples)} samples, model {model_path}, config "
            f"{trained_with or ('preset ' + a.preset)} (overview <= {v.overview_max_pixels} px "
            f"per frame, K={a.frames}, crops <= {v.crop_max_frames} frames of "
            f"<= {v.crop_max_pixels} px, crop mode {cfg.agent.crop_mode})"
        )
    bundle = load_model_from_config(model_path, cfg.model, device=str(ctx.device))
    engine = make_engine(cfg, bundle)
    runner = AgentRunner(engine, bundle, cfg)
    try:
        summary = run_eval(
            samples,
            runner,
            out,
            settings,
            batch_size=a.batch_size,
            seed=a.seed,
            ctx=ctx,
            show_progress=not a.no_progress,
        )
    except EvalError as e:
        log.error(f"error: {e}")
        return 2
    except (NotRegularFile, DiskFullError) as e:  # a link or a FIFO planted; a full disk
        log.error(f"error: {e}")
        return 1
    finally:
        cleanup(ctx, engine.close)
    if ctx.is_main:
        log.info(f"[eval] results in {out}/ (results.jsonl, summary.json)")
    if summary["n"] and summary["n_errors"] == summary["n"]:  # the same on every rank
        if ctx.is_main:
            why = failed_run(Path(out), samples) or f"every sample failed (see {out}/results.jsonl)"
            log.error(f"error: {why}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
