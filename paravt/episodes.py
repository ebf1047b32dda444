"""``python -m paravt.episodes`` — roll out a few prompts and print what the agents did.

    python -m paravt.episodes [--model PATH] [--preset P] [--config F.yaml ...] [key=value ...]
        --num-prompts N

The model is ``--model``, else ``model.path``, else the newest checkpoint of
``train.out_dir`` (what ``make train`` wrote; a checkpoint of a paravt run rolls out with that
run's ``config.yaml`` unless ``--config`` is given; one naming plug-in code outside paravt is
refused unless ``--trust-plugins``, as ``paravt.eval`` does). With none, it says the model is untrained
and how to train it, and rolls out the untrained tiny model.

With no data configured (the embedded default) it generates the synthetic long-video task
into ``data.synth_dir`` (and, without a model, the tiny offline Qwen3-VL into
``model.tiny_dir``) if absent, then runs ``N`` prompts × ``rollout.group_size`` episodes through the same
``AgentRunner`` and reward code the trainer uses, and prints each episode's turns, tool calls
(status, clamped window, the sub-agent's summary), crops and reward breakdown.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from paravt.agent import AgentRunner
from paravt.algo.gating import frame_budget
from paravt.checkpoint import resolve_model_path, run_config
from paravt.config import PRESETS, Config, ConfigError, load_config, stored_plugin_errors
from paravt.data import resolve_data
from paravt.data.readers import load_samples
from paravt.engines import make_engine
from paravt.engines.oracle import OracleMainEngine, load_oracle
from paravt.log import get_logger
from paravt.models import resolve_model
from paravt.rewards import score_groups

log = get_logger(__name__)

_WRAP = 100


def model_path(cfg: Config, given: str = "", out: Any = None) -> str:
    """``--model``, else ``model.path``, else the newest checkpoint of ``train.out_dir`` (the
    run ``make train`` writes; ``paravt.checkpoint.resolve_model_path``, as ``paravt.eval``). With none of
    them, says that the model is untrained and how to train it, and returns "" (the caller
    then rolls out the untrained tiny model). A given path that is not a directory raises
    ``ConfigError``."""

    if given or cfg.model.path:
        return resolve_model_path(cfg, given)
    try:
        return resolve_model_path(cfg, "")
    except ConfigError as e:
        print(f"note: {e}. Rolling out the untrained tiny model instead.", file=out or sys.stdout)
        return ""


def _short(text: str, limit: int = 600) -> str:
    text = text if len(text) <= limit else text[:limit] + f" …[{len(text) - limit} more chars]"
    return textwrap.indent(text.rstrip(), "      | ")


def print_groups(groups: list[Any], show: int, out: Any = None) -> None:
    """Human-readable dump of the first ``show`` episodes of each group (to ``out``, default
    the current ``sys.stdout``)."""
    out = out or sys.stdout
    p = lambda *a: print(*a, file=out)  # noqa: E731
    for g in groups:
        s = g.sample
        p("=" * _WRAP)
        p(f"prompt {g.group_id}: {s.id}  [{s.question_type}]  K={g.num_frames} overview frames")
        p(textwrap.indent(s.question.rstrip(), "  Q: "))
        p(f"  ground truth: {s.answer}")
        subs_by_parent: dict[str, list[Any]] = {}
        for st in g.sub_trajectories:
            subs_by_parent.setdefault(st.parent, []).append(st)
        for t in g.trajectories[:show]:
            p("-" * _WRAP)
            n_gen = sum(t.loss_mask)
            p(
                f"  episode {t.uid}: {len(t.tokens)} tokens ({n_gen} generated), {len(t.turns)} turn(s)"
            )
            for i, turn in enumerate(t.turns):
                tag = " (forced answer)" if turn.forced_answer else ""
                p(f"    turn {i}{tag}, finish={turn.finish_reason}:")
                p(_short(turn.prefix + turn.text))
                for k, c in enumerate(turn.calls):
                    if c.status == "ok":
                        p(f"    call {k}: {c.name} [{c.start:.1f}, {c.end:.1f}] s -> ok")
                        p(f"      summary: {c.response[:200]!r}")
                    else:
                        p(f"    call {k}: {c.status}: {c.error}")
            crops = subs_by_parent.get(t.uid, [])
            if crops:
                frames = ", ".join(str(x.num_frames) for x in crops)
                p(f"    crops: {len(crops)} sub-agent trajectories (frames: {frames})")
            b = t.reward_breakdown
            if b:
                keys = (
                    "total",
                    "acc",
                    "fmt",
                    "fmt_base",
                    "anchor",
                    "tool",
                    "n_ok",
                    "n_model_errors",
                )
                p("    reward: " + "  ".join(f"{k}={b[k]:.3f}" for k in keys if k in b))
            if t.errors:
                p(f"    errors: {len(t.errors)} (first: {t.errors[0]})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m paravt.episodes", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--preset", default="tiny_cpu", choices=sorted(PRESETS))
    ap.add_argument("--config", action="append", default=[], help="YAML file (repeatable)")
    ap.add_argument("--num-prompts", type=int, default=2, help="prompts to roll out")
    ap.add_argument("--group-size", type=int, default=0, help="G (default rollout.group_size)")
    ap.add_argument("--split", default="train", help="dataset split (train|val)")
    ap.add_argument("--seed", type=int, default=None, help="default train.seed")
    ap.add_argument("--show", type=int, default=2, help="episodes printed per prompt")
    ap.add_argument(
        "--main",
        choices=("model", "oracle"),
        default="model",
        help="main agents: the model, or the oracle turns of sft.jsonl (sub-agents stay the "
        "model; shows real crops and sub-agents with an untrained model)",
    )
    ap.add_argument(
        "--model",
        default="",
        help="HF model dir or paravt checkpoint dir (default: model.path, else the newest "
        "checkpoint of train.out_dir, else the untrained tiny model)",
    )
    ap.add_argument(
        "--trust-plugins",
        action="store_true",
        help="import the plug-ins (agent.tools, reward.extra_terms) that the checkpoint's "
        "stored config.yaml names; without it such a run is refused (its code never runs)",
    )
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.preset, args.config, args.overrides)
        path = model_path(cfg, args.model)
        trained_with = run_config(path) if path and not args.config else None
        if trained_with is not None:  # roll out with the settings the checkpoint trained with
            ours, cfg = cfg, load_config(args.preset, [str(trained_with)], args.overrides)
            trust = args.trust_plugins
            if errs := stored_plugin_errors(ours, cfg, trained_with, trust, "episodes"):
                raise ConfigError(errs[0])
    except ConfigError as e:
        log.error(f"error: {e}")
        return 2
    if args.num_prompts < 1:
        log.error("error: --num-prompts must be >= 1")
        return 2

    seed = cfg.train.seed if args.seed is None else args.seed
    G = args.group_size or cfg.rollout.group_size
    t0 = time.perf_counter()
    data = resolve_data(cfg)
    samples = load_samples(
        data, video_root=cfg.data.video_root, split=args.split, max_samples=args.num_prompts
    )
    if not samples:
        log.error(f"error: no usable samples in {data} (split {args.split})")
        return 1
    log.info(f"model: {path or 'untrained tiny model'}")
    bundle = resolve_model(cfg, path)
    engine = make_engine(cfg, bundle)
    if args.main == "oracle":
        records = load_oracle(Path(data))
        if not records:
            log.error(f"error: --main oracle needs {data}/sft.jsonl")
            return 2
        engine = OracleMainEngine(engine, bundle.tokenizer, records, cfg.agent.think_prefix)
    runner = AgentRunner(engine, bundle, cfg)
    budgets = [
        frame_budget(
            s.id,
            seed=seed,
            epoch=0,
            budgets=cfg.video.frame_budgets,
            gating=cfg.video.gating,
            fixed=cfg.video.fixed_frames,
        )
        for s in samples
    ]
    t_setup = time.perf_counter() - t0
    t1 = time.perf_counter()
    done = runner.rollout(samples, budgets, group_size=G, seed=seed)
    groups = done.groups
    score_groups(groups, cfg.reward)
    dt = time.perf_counter() - t1
    print_groups(groups, args.show)
    n_ep = sum(len(g.trajectories) for g in groups)
    log.info("=" * _WRAP)
    st = done.stats
    calls = {k: int(v) for k, v in st.calls.items() if v}
    log.info(
        f"{len(groups)} prompt(s) x G={G}: {n_ep} episodes in {dt:.2f} s "
        f"({n_ep / max(dt, 1e-9):.2f} episodes/s; setup {t_setup:.1f} s)"
    )
    log.info(
        f"engine calls: main {st.main_engine_calls}, sub {st.sub_engine_calls}; "
        f"planner runs {st.planner_runs}; crops {st.crops}; "
        f"forced answers {st.forced_answers}; tool calls {calls or 'none'}"
    )
    if groups:
        rewards = [t.reward for g in groups for t in g.trajectories]
        log.info(f"mean reward {sum(rewards) / len(rewards):.3f}")
    for err in done.errors:
        log.info(f"skipped: {err}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
