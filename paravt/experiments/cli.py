"""The command line of ``python -m paravt.experiments``:

    python -m paravt.experiments ablation [--seeds 3] [--arms a,b,...] [--out runs/ablation]
        [--preset tiny_cpu] [--config F.yaml ...] [--eval-k 4,32] [key=value ...]
    python -m paravt.experiments collapse [...]    (flags: paravt/experiments/collapse.py)
    python -m paravt.experiments phase DIR [DIR ...] [--out runs/phase]   (collapse cells)
    python -m paravt.experiments tool-path --data TASK EVAL_DIR [...]   (where answers come from)
    python -m paravt.experiments tools-pay RUN_DIR [...] [--k 4]   (greedy, with vs without tools)
    python -m paravt.experiments rl-learns RUN_DIR [...]   (before vs after RL, by need, over seeds)
    python -m paravt.experiments paired L=DIR M=DIR [--k 32]   (collapse protocol 5, by seed)

``ablation``: ``paravt.experiments.ablation``; ``collapse``: ``paravt.experiments.collapse``;
both run their arms with ``paravt.experiments.arms.run_arms``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from paravt.config import ConfigError, ConfigHelpParser, load_config, preset_errors
from paravt.experiments import ablation as ablation_module
from paravt.experiments.ablation import ablation
from paravt.experiments.arms import ABLATION_ARMS, ARMS, parse_arms, run_driver
from paravt.experiments.collapse import main as collapse_main
from paravt.experiments.paired import main as paired_main
from paravt.experiments.phase import main as phase_main
from paravt.experiments.rl_learns import main as rl_learns_main
from paravt.experiments.tool_path import main as tool_path_main
from paravt.experiments.tools_pay import main as tools_pay_main


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m paravt.experiments ablation|collapse ...``: the subcommand's exit code (0
    done, 1 a failed arm run, 2 bad arguments, 128 + N after a forwarded signal N)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["collapse"]:  # its own flags: paravt/experiments/collapse.py
        return collapse_main(argv[1:])
    if argv[:1] == ["phase"]:  # paravt/experiments/phase.py
        return phase_main(argv[1:])
    if argv[:1] == ["tool-path"]:  # paravt/experiments/tool_path.py
        return tool_path_main(argv[1:])
    if argv[:1] == ["tools-pay"]:  # paravt/experiments/tools_pay.py
        return tools_pay_main(argv[1:])
    if argv[:1] == ["rl-learns"]:  # paravt/experiments/rl_learns.py
        return rl_learns_main(argv[1:])
    if argv[:1] == ["paired"]:  # paravt/experiments/paired.py
        return paired_main(argv[1:])
    raw = argparse.RawDescriptionHelpFormatter
    p = ConfigHelpParser(prog="python -m paravt.experiments", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser(
        "collapse",
        help="does vanilla GRPO lose tool use? (see python -m paravt.experiments collapse -h)",
        add_help=False,
    )
    sub.add_parser(
        "phase",
        help="the collapse phase diagram over (u, q) from finished collapse folders (see "
        "python -m paravt.experiments phase -h)",
        add_help=False,
    )
    sub.add_parser(
        "tool-path",
        help="where a spot answer comes from in paravt.eval results (see python -m "
        "paravt.experiments tool-path -h)",
        add_help=False,
    )
    sub.add_parser(
        "tools-pay",
        help="greedy accuracy with and without tools by need, over finished runs (see "
        "python -m paravt.experiments tools-pay -h)",
        add_help=False,
    )
    sub.add_parser(
        "rl-learns",
        help="before vs after RL by need over finished runs, judged by issue 60's bars (see "
        "python -m paravt.experiments rl-learns -h)",
        add_help=False,
    )
    sub.add_parser(
        "paired",
        help="collapse protocol 5: regimes x arms paired by seed, from finished collapse "
        "folders (see python -m paravt.experiments paired -h)",
        add_help=False,
    )
    a = sub.add_parser(
        "ablation",
        help="every arm x seed from one SFT checkpoint",
        description=ablation_module.__doc__,
        formatter_class=raw,
    )
    a.add_argument("--seeds", type=int, default=3)
    a.add_argument(
        "--arms", default=",".join(ABLATION_ARMS), help=f"comma list of {', '.join(ARMS)}"
    )
    a.add_argument("--out", default="runs/ablation")
    a.add_argument("--eval-k", default="4,32", help="held-out accuracy at these K (with tools)")
    a.add_argument("--preset", default="tiny_cpu")
    a.add_argument("--config", action="append", default=[], help="YAML file (repeatable)")
    a.add_argument("overrides", nargs="*", help="dotted key=value for every run")
    args = p.parse_args(argv)

    def body() -> dict:
        if args.seeds < 1:
            raise ConfigError(f"--seeds {args.seeds} must be >= 1")
        arms = parse_arms(args.arms, list(ARMS))  # before the config: cheap flags first
        try:
            eval_k = [int(k) for k in args.eval_k.split(",") if k.strip()]
        except ValueError:
            raise ConfigError(f"--eval-k {args.eval_k!r} is not a comma list of K") from None
        if not eval_k or min(eval_k) < 1:
            raise ConfigError(f"--eval-k {args.eval_k!r}: give K >= 1, e.g. 4,32")
        cfg = load_config(args.preset, args.config, args.overrides)
        if errs := preset_errors(args.preset, cfg):  # e.g. the 8B presets' model.path
            raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errs))
        base = ["--preset", args.preset]
        for c in args.config:
            base += ["--config", c]
        return ablation(
            cfg,
            out=Path(args.out),
            arms=arms,
            seeds=args.seeds,
            eval_k=eval_k,
            base_args=[*base, *args.overrides],
        )

    return run_driver("ablation", body, args.out)
