"""Collapse alarms: the failure modes PARA-GRPO exists to prevent, caught while a run trains.

Under vanilla GRPO the tool-call rate and ``</think>`` closure collapse within a few steps and
parse errors climb. :class:`CollapseDetector` watches one stream of step metrics (the rows of
``metrics.jsonl``) and raises an :class:`Alarm` when, over the last ``window`` steps:

* the tool-call rate (``tool_call_rate``, and each ``tool_rate/K{k}``) falls below
  ``tool_frac`` x its starting level;
* ``think_closure_rate`` falls below ``closure_frac`` x its starting level;
* ``parse_error_rate`` rises more than ``parse_rise`` above its starting level (absolute).

The starting level of a metric is the mean of its first ``window`` observations (a per-K rate
is observed only on steps that drew that K); the rolling value is the mean of its last
``window`` observations. A metric is judged from its ``window + 1``-th observation on.
An alarm is edge-triggered: it fires when its condition becomes
true and re-arms once the condition clears, so a collapse that persists is reported once.

Pure (no I/O, no torch): ``paravt.train`` feeds it each step's metrics, prints the alarms and
logs them to ``metrics.jsonl`` as ``kind: "alarm"`` rows, which ``paravt.view`` shows. On
``--resume`` the trainer replays the kept rows (:meth:`CollapseDetector.replay`) so that
starting levels and armed states are those of the uninterrupted run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

TOOL = "tool_call_rate"
CLOSURE = "think_closure_rate"
PARSE = "parse_error_rate"
PER_K_TOOL = "tool_rate/K"


@dataclass
class Alarm:
    """One collapse: ``metric``'s rolling mean ``value`` crossed ``threshold`` at ``step``."""

    step: int
    metric: str
    value: float  # mean of the last `window` observations
    baseline: float  # mean of the first `window` observations
    threshold: float
    message: str

    def row(self) -> dict[str, Any]:
        """The fields of its ``kind: "alarm"`` row in ``metrics.jsonl`` (``step`` is the row's)."""
        d = asdict(self)
        d.pop("step")
        return d


@dataclass
class _Series:
    direction: Literal["drop", "rise"]
    first: list[float] = field(default_factory=list)
    last: deque = field(default_factory=deque)
    n: int = 0
    active: bool = False


class CollapseDetector:
    """Rolling collapse detection over a stream of step metrics (see the module docstring).

    ``window``: steps in the starting level and in the rolling mean (>= 1);
    ``tool_frac`` / ``closure_frac``: alarm below this fraction of the starting level (0 = off);
    ``parse_rise``: alarm when the parse-error rate exceeds its start by this much (<= 0 is
    not allowed by the config; a value > 1 never fires).
    """

    def __init__(
        self, window: int, tool_frac: float, closure_frac: float, parse_rise: float
    ) -> None:
        if window < 1:
            raise ValueError(f"CollapseDetector: window={window} must be >= 1")
        self.window = window
        self.tool_frac = tool_frac
        self.closure_frac = closure_frac
        self.parse_rise = parse_rise
        self.series: dict[str, _Series] = {}

    @classmethod
    def from_config(cls, train_cfg: Any) -> CollapseDetector:
        """From ``train.alarm_*`` (``paravt.config.TrainConfig``)."""
        t = train_cfg
        return cls(t.alarm_window, t.alarm_tool_frac, t.alarm_closure_frac, t.alarm_parse_rise)

    def _watched(self, metrics: Mapping[str, Any]) -> Iterable[tuple[str, str]]:
        for key in metrics:
            if key == TOOL or key.startswith(PER_K_TOOL):
                if self.tool_frac > 0:
                    yield key, "drop"
            elif key == CLOSURE and self.closure_frac > 0:
                yield key, "drop"
            elif key == PARSE:
                yield key, "rise"

    def _threshold(self, key: str, baseline: float) -> float:
        if key == CLOSURE:
            return self.closure_frac * baseline
        if key == PARSE:
            return baseline + self.parse_rise
        return self.tool_frac * baseline

    def update(self, step: int, metrics: Mapping[str, Any]) -> list[Alarm]:
        """Feed one step's metrics; returns the alarms that fire at this step."""
        fired: list[Alarm] = []
        for key, direction in self._watched(metrics):
            v = metrics[key]
            if not isinstance(v, (int, float)):
                continue  # a NaN logged as null
            s = self.series.setdefault(key, _Series(direction, last=deque(maxlen=self.window)))
            s.n += 1
            if len(s.first) < self.window:
                s.first.append(float(v))
            s.last.append(float(v))
            if s.n <= self.window:
                continue  # still measuring the starting level
            base = sum(s.first) / len(s.first)
            cur = sum(s.last) / len(s.last)
            thr = self._threshold(key, base)
            bad = cur < thr if direction == "drop" else cur > thr
            if bad and not s.active:
                fired.append(Alarm(int(step), key, cur, base, thr, _message(key, cur, base, thr,
                                                                          self.window)))  # fmt: skip
            s.active = bad
        return fired

    def replay(self, rows: Iterable[Mapping[str, Any]]) -> list[Alarm]:
        """Feed the ``kind: "train"`` rows of a ``metrics.jsonl`` in order; returns every alarm."""
        out: list[Alarm] = []
        for r in rows:
            if r.get("kind", "train") == "train":
                out += self.update(int(r["step"]), r)
        return out


def _message(key: str, cur: float, base: float, thr: float, window: int) -> str:
    what = {
        TOOL: "tool-call rate collapsed",
        CLOSURE: "</think> closure collapsed",
        PARSE: "parse-error rate rose",
    }.get(key, f"tool-call rate at {key.removeprefix('tool_rate/')} collapsed")
    return (
        f"{what}: {key} over the last {window} steps is {cur:.3f} "
        f"(start {base:.3f}, alarm threshold {thr:.3f})"
    )


def detect_alarms(
    rows: Iterable[Mapping[str, Any]],
    *,
    window: int,
    tool_frac: float,
    closure_frac: float,
    parse_rise: float,
) -> list[Alarm]:
    """All alarms of a finished metric stream (the ``metrics.jsonl`` rows of a run)."""
    return CollapseDetector(window, tool_frac, closure_frac, parse_rise).replay(rows)
