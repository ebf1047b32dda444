"""Where a spot-task answer comes from: the tool path of ``python -m paravt.eval`` results,
step by step (the collapse experiment's diagnosis of why a call does or does not pay).

    python -m paravt.experiments tool-path --data TASK_DIR RESULTS_DIR [RESULTS_DIR ...]

``TASK_DIR`` is the synthetic task (``val.jsonl`` with each row's true colour, ``target``, and
its ``need_K{K}`` flags); each ``RESULTS_DIR`` is a ``paravt.eval --benchmark synth`` folder
(``results.jsonl``: every sample's trace, with the crop windows and the sub-agents' summaries).
For each K and each side of the need split it counts, over the samples:

- ``called``: made at least one executed crop;
- ``covered``: of those, a crop window overlaps the square's time (else no summary can see it);
- ``summary_colour`` / ``summary_right``: a summary names a colour / the first one named is
  the square's;
- ``copied``: the answer's colour is the first summary colour (whatever that is), and
  ``copied_right``: that, when the summary was right;
- ``correct``.

Nothing is run here; it reads what the evaluation wrote.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from paravt.config import ConfigError
from paravt.data.synth import COLOUR_RGB
from paravt.files import write_atomic
from paravt.log import get_logger
from paravt.metrics import read_metrics

log = get_logger(__name__)

# Every colour the synthetic tasks draw (the sub-agents' summaries name them).
_COLOUR = re.compile(r"\b(" + "|".join(COLOUR_RGB) + r")\b", re.I)
COUNTS = (
    "n",
    "correct",
    "called",
    "covered",
    "summary_colour",
    "summary_right",
    "copied",
    "copied_right",
)


@dataclass
class PathCounts:
    """The counts of the module docstring over one side of the need split (``COUNTS``, in
    that order): what ``tool-path`` prints and writes (``--json``) and
    ``paravt.experiments.tools_pay`` reads."""

    n: int = 0
    correct: int = 0
    called: int = 0
    covered: int = 0
    summary_colour: int = 0
    summary_right: int = 0
    copied: int = 0
    copied_right: int = 0

    def to_dict(self) -> dict[str, int]:
        """``COUNTS`` -> count (the ``--json`` rows' columns)."""
        return asdict(self)


def _colours(text: str) -> list[str]:
    return [m.lower() for m in _COLOUR.findall(text or "")]


def _answer_colour(row: dict[str, Any], val: dict[str, Any]) -> str | None:
    letter = row.get("parsed") or ""
    opts = val.get("options") or []
    i = "ABCDEFGH".find(letter) if len(letter) == 1 else -1
    return opts[i].lower() if 0 <= i < len(opts) else None


def tool_path(
    results: Iterable[dict[str, Any]], val: dict[str, dict[str, Any]], k: int
) -> dict[str, PathCounts]:
    """The counts of the module docstring, per side (``need`` / ``no_need``) of ``need_K{k}``,
    for the evaluation rows ``results`` (one K) of the task rows ``val`` (by id)."""
    out = {side: PathCounts() for side in ("need", "no_need")}
    for r in results:
        v = val.get(r["id"])
        if v is None:
            raise ConfigError(f"result {r['id']!r} is not a row of the task's val.jsonl")
        c = out["need" if v.get(f"need_K{k}") else "no_need"]
        truth = str(v["target"]).split()[0].lower()
        c.n += 1
        c.correct += bool(r.get("correct"))
        calls = [x for t in r.get("trace") or [] for x in t.get("calls") or []]
        calls = [x for x in calls if x.get("status") == "ok"]
        if not calls:
            continue
        c.called += 1
        s, e = float(v["event_start"]), float(v["event_end"])
        c.covered += any(min(x["end"], e) > max(x["start"], s) for x in calls)
        named = [col for x in calls for col in _colours(x.get("response") or "")]
        if not named:
            continue
        c.summary_colour += 1
        c.summary_right += named[0] == truth
        copied = _answer_colour(r, v) == named[0]
        c.copied += copied
        c.copied_right += copied and named[0] == truth
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m paravt.experiments tool-path``: 0 printed, 2 bad input."""
    p = argparse.ArgumentParser(
        prog="python -m paravt.experiments tool-path", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--data", required=True, help="the synthetic task folder (val.jsonl)")
    p.add_argument("results", nargs="+", help="paravt.eval --benchmark synth result folders")
    p.add_argument("--json", default="", help="also write the counts here")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        vpath = Path(args.data) / "val.jsonl"
        if not vpath.is_file():
            raise ConfigError(f"--data {args.data}: no val.jsonl (give the synthetic task folder)")
        val = {r["id"]: r for r in read_metrics(vpath)}
        table = []
        for d in args.results:
            path = Path(d) / "results.jsonl"
            if not path.is_file():
                raise ConfigError(f"{d}: no results.jsonl (a paravt.eval output folder)")
            rows = read_metrics(path)
            ks = {int(r["frames"]) for r in rows}
            if len(ks) != 1:
                raise ConfigError(f"{d}: results at several K {sorted(ks)}; give one K per folder")
            (k,) = ks
            for side, c in tool_path(rows, val, k).items():
                table.append({"results": d, "K": k, "side": side, **c.to_dict()})
    except (ConfigError, KeyError, ValueError) as e:
        log.error(f"error: {e}")
        return 2
    # the command's result (stdout), whatever PARAVT_LOG_LEVEL says
    print("| results | K | need | " + " | ".join(COUNTS) + " |")
    print("|" + "---|" * (3 + len(COUNTS)))
    for t in table:
        print(
            f"| {t['results']} | {t['K']} | {t['side']} | "
            + " | ".join(str(t[c]) for c in COUNTS)
            + " |"
        )
    if args.json:
        write_atomic(args.json, json.dumps(table, indent=1) + "\n")
    return 0
