"""Does the main agent carry a sub-agent's colour into its answer? A teacher-forced probe.

    python -m paravt.eval.copy_probe --model DIR --data TASK_DIR [--k 4]
        [--split val|train] [--limit N] [--json FILE] [key=value ...]

For every row of the "spot" task ``TASK_DIR`` whose K-frame overview misses the square
(``need_K{K}``), the oracle's tool round is laid out exactly as SFT lays it out (the same
``crop_video`` calls, the sub-agents' oracle summaries, ``paravt.data.synth.whole_video_crops``)
and the checkpoint ``--model`` is scored, teacher-forced, on the main agent's last turn
(``A <colour> square appears.`` then ``<answer>L</answer>``):

- ``copy``: of the 4 colours, the one whose words the model gives the highest log-probability
  in that thought is the colour the summary names;
- ``letter``: after the right thought, the most likely of the 4 option letters is its letter;
- ``swap_follow`` / ``swap_truth``: the summaries are rewritten to name another colour (the
  next of ``SPOT_COLOURS``); the thought's most likely colour is the summary's (the answer
  follows what the tool returned) / the square's true colour (it follows something else: a
  colour remembered for this video, say, on training rows);
- split by the crop window (1-based) of the first summary that names the square (how far the
  colour stands from the answer) and by the true colour;
- ``pred_colours``: what the model picked, to see a prior (one colour it falls back to).

What the agent does at sampling time (greedy, with its own calls) is
``python -m paravt.experiments tool-path``; this probe holds the calls and summaries fixed
and asks only about the copy, so that a failure can be placed: in the copy (``copy``), in the
letter (``letter``), or in what the model learnt instead of the copy (``swap_truth``).
Used by the issue-44 analysis (docs/copy_probe.md) and tests/test_copy_probe.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from paravt.agent.encoder import encode_oracle_trajectory
from paravt.algo.logprobs import sequence_logprobs
from paravt.checkpoint import run_config
from paravt.config import Config, ConfigError, load_config
from paravt.data.readers import load_samples
from paravt.data.sft_records import SFTRecord
from paravt.data.synth import (
    SPOT_COLOURS,
    SPOT_PLAN_TEXT,
    VideoPlan,
    oracle_settings,
    plan_meta,
    read_plans,
    spot_letter,
    swap_colour,
    tool_record,
    whole_video_crops,
)
from paravt.log import get_logger
from paravt.metrics import read_metrics
from paravt.models import load_model
from paravt.video import DecodePlanner

log = get_logger(__name__)


@dataclass
class ProbeCounts:
    """Counts of one probe over rows (see the module docstring)."""

    n: int = 0
    copy: int = 0
    letter: int = 0
    swap_follow: int = 0
    swap_truth: int = 0
    by_window: dict[int, list[int]] = field(default_factory=dict)  # window -> [n, copy]
    by_colour: dict[str, list[int]] = field(default_factory=dict)  # colour -> [n, copy]
    pred_colours: Counter = field(default_factory=Counter)

    def rates(self) -> dict[str, float]:
        n = max(self.n, 1)
        return {k: getattr(self, k) / n for k in ("copy", "letter", "swap_follow", "swap_truth")}

    def as_dict(self) -> dict[str, Any]:
        return {
            "n": self.n,
            **{k: getattr(self, k) for k in ("copy", "letter", "swap_follow", "swap_truth")},
            "rates": self.rates(),
            "by_window": {str(k): v for k, v in sorted(self.by_window.items())},
            "by_colour": dict(sorted(self.by_colour.items())),
            "pred_colours": dict(self.pred_colours.most_common()),
        }


def _region_scores(
    bundle: Any, cfg: Config, sample: Any, records: list[SFTRecord], planner: Any
) -> list[float]:
    """For records that differ in one stretch of their last turn: the summed teacher-forced
    log-probability of each record's own stretch (the tokens between the records' common
    prefix and common suffix)."""

    trajs = [encode_oracle_trajectory(bundle, cfg, sample, r.to_dict(), planner) for r in records]
    toks = [t.tokens for t in trajs]
    p = 0
    while all(len(t) > p for t in toks) and len({t[p] for t in toks}) == 1:
        p += 1
    s = 0
    while all(len(t) - s > p for t in toks) and len({t[len(t) - 1 - s] for t in toks}) == 1:
        s += 1
    out = []
    for t in trajs:
        mask = torch.zeros(len(t.tokens))
        mask[p : len(t.tokens) - s] = 1
        with torch.no_grad():
            lp, _ = sequence_logprobs(
                bundle.model, t.tokens, t.extras["mm_token_type_ids"], t.visuals, target_mask=mask
            )
        out.append(float(lp.sum()))
    return out


def _round(
    row: dict, k: int, windows: list, found: str, truth: str,
    summaries: list[str], thought: str, letter: str,
) -> SFTRecord:  # fmt: skip
    """The oracle's tool round of ``row`` at ``k`` with ``summaries``, its final thought
    ``found`` naming ``thought`` instead of ``truth``, and the answer ``letter``."""
    found_as = swap_colour(found, truth, thought)
    return tool_record(row, k, SPOT_PLAN_TEXT, windows, summaries, found_as, letter)


def _most_likely(
    bundle: Any, cfg: Config, sample: Any, planner: Any, options: Sequence[str], records: list
) -> str:
    """The option whose record (``records[i]`` for ``options[i]``) the model scores highest
    (:func:`_region_scores`)."""
    scores = _region_scores(bundle, cfg, sample, records, planner)
    return options[max(range(len(options)), key=scores.__getitem__)]


def probe_rows(
    bundle: Any,
    cfg: Config,
    data_dir: str | Path,
    *,
    k: int = 4,
    split: str = "val",
    limit: int = 0,
) -> ProbeCounts:
    """The probe of the module docstring over ``split``'s rows of ``data_dir`` that need the
    tool at ``k`` (at most ``limit``; 0: all), with the loaded model ``bundle`` and the run
    config ``cfg`` (its crop sampling and ``agent.max_parallel`` lay out the tool round)."""

    d = Path(data_dir)
    fps, plans = read_plans(d)
    rows = [r for r in read_metrics(d / f"{split}.jsonl") if r.get(f"need_K{k}")]
    if not rows:
        raise ConfigError(f"{d}/{split}.jsonl has no row with need_K{k} (a 'spot' task folder?)")
    rows = rows[:limit] if limit > 0 else rows
    samples = {s.id: s for s in load_samples(d, split=split)}
    planner = DecodePlanner.from_config(cfg.video)
    st = oracle_settings(cfg)
    counts = ProbeCounts()
    bundle.model.eval()
    for row in rows:
        plan: VideoPlan = plans[Path(row["video"]).stem]
        sample = samples[row["id"]]
        windows, summaries, found = whole_video_crops(
            plan, plan_meta(plan, fps), max(1, st.max_parallel), st
        )
        truth = plan.target.colour
        hits = [j for j, s in enumerate(summaries) if f" {truth} " in s]
        if not hits:
            continue  # the crops miss the square: nothing to copy

        record = partial(_round, row, k, windows, found, truth)
        letter = spot_letter(truth)
        pred = _most_likely(bundle, cfg, sample, planner, SPOT_COLOURS,
                            [record(summaries, c, letter) for c in SPOT_COLOURS])  # fmt: skip
        ok = pred == truth
        counts.n += 1
        counts.copy += ok
        counts.pred_colours[pred] += 1
        w = counts.by_window.setdefault(hits[0] + 1, [0, 0])
        w[0], w[1] = w[0] + 1, w[1] + ok
        c = counts.by_colour.setdefault(truth, [0, 0])
        c[0], c[1] = c[0] + 1, c[1] + ok
        got = _most_likely(bundle, cfg, sample, planner, "ABCD",
                           [record(summaries, truth, x) for x in "ABCD"])  # fmt: skip
        counts.letter += got == letter
        other = SPOT_COLOURS[(SPOT_COLOURS.index(truth) + 1) % 4]
        swapped = [swap_colour(x, truth, other) for x in summaries]
        spred = _most_likely(bundle, cfg, sample, planner, SPOT_COLOURS,
                             [record(swapped, c, letter) for c in SPOT_COLOURS])  # fmt: skip
        counts.swap_follow += spred == other
        counts.swap_truth += spred == truth
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m paravt.eval.copy_probe``: 0 printed, 2 bad input."""

    p = argparse.ArgumentParser(
        prog="python -m paravt.eval.copy_probe", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", required=True, help="checkpoint folder (an SFT or RL checkpoint)")
    p.add_argument("--data", required=True, help="the synthetic 'spot' task folder")
    p.add_argument("--k", type=int, default=4, help="overview budget K")
    p.add_argument("--split", default="val", choices=("val", "train"))
    p.add_argument("--limit", type=int, default=0, help="at most N rows (0: all)")
    p.add_argument("--json", default="", help="also write the counts here")
    p.add_argument("overrides", nargs="*", help="dotted key=value for the run config")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        # The run's own settings (crop sampling, max_parallel): a run's checkpoint, or the
        # SFT folder <run>/sft beside the run's config.yaml.
        own = run_config(args.model) or Path(args.model).resolve().parent / "config.yaml"
        files = [str(own)] if own.is_file() else []
        cfg = load_config("tiny_cpu", files, args.overrides)
        bundle = load_model(args.model, dtype="float32", device="cpu")
        c = probe_rows(bundle, cfg, args.data, k=args.k, split=args.split, limit=args.limit)
    except (ConfigError, KeyError, ValueError, OSError) as e:
        log.error(f"error: {e}")
        return 2
    out = {"model": args.model, "data": args.data, "k": args.k, "split": args.split}
    out.update(c.as_dict())
    print(json.dumps(out, indent=1))  # the command's result (stdout)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
