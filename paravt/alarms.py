"""Collapse alarms: the failure modes PARA-GRPO exists to prevent, caught while a run trains.

Under vanilla GRPO the tool-call rate and ``</think>`` closure collapse within a few steps and
parse errors climb. :class:`CollapseDetector` watches one stream of step metrics (the rows of
``metrics.jsonl``) and raises an :class:`Alarm` when, over the last ``window`` steps:

* the tool-call rate (``tool_call_rate``, and each ``tool_rate/K{k}``) falls below
  ``tool_frac`` x its starting level, and the fall is significant at its sample size (below);
* ``think_closure_rate`` falls below ``closure_frac`` x its starting level;
* ``parse_error_rate`` rises more than ``parse_rise`` above its starting level (absolute).

The starting level of a metric is the mean of its first ``window`` observations (a per-K rate
is observed only on steps that drew that K); the rolling value is the mean of its last
``window`` observations. A metric is judged from its ``window + 1``-th observation on.
An alarm is edge-triggered: it fires when its condition becomes
true and re-arms once the rolling mean is back across the threshold, so a collapse that
persists is reported once.

Sample size (tool-call rates). The unit is the prompt, not the rollout: a prompt's G rollouts
share its video, question and K, so they are not independent. A step's row carries, per rate
``X``, the number of prompts ``prompts/X`` and the mean of their squared per-prompt rates
``prompt_sq/X`` (``paravt.metrics.rollout_metrics``); ``X`` itself is the mean of the
per-prompt rates (every prompt has G rollouts). Pooling the steps of the starting level (b) and
of the window (w) gives ``n`` prompts, their mean ``m`` and sample variance ``s²``, and the
alarm needs, besides ``m_w < tool_frac · m_b``:

* at least ``min_prompts`` prompts in each (``MIN_PROMPTS``: a variance needs two), and
* a one-sided t-test of ``H0: mean_w >= tool_frac · mean_b`` on the prompt-level rates
  rejecting at level ``alpha`` (``ALPHA``)::

      t = (tool_frac · m_b - m_w) / sqrt(s² · (tool_frac² / n_b + 1 / n_w)),
      s² = ((n_b - 1) s_b² + (n_w - 1) s_w²) / (n_b + n_w - 2),   df = n_b + n_w - 2

  The variance is pooled (Student, not Welch): a handful of prompts that all happen not to
  call has a sample variance of 0, which would make any fall look certain. With no variance on
  either side the fall itself decides. A row without these keys (a run logged before them)
  counts as one prompt.

Why: the embedded default (4 prompts a step over 4 values of K, G = 4) observes about one
prompt per K per step, so a 5-step window of ``tool_rate/K8`` is ~5 prompts, and the bare
"mean below half the start" rule raised three false alarms on a healthy run (held-out tool use
at K = 4 did not move). With the test, such a window alarms only when nearly all its prompts
stopped calling; a real collapse (most prompts at 0) still fires within a few of its steps.
Honest limits: prompts are treated as independent across steps (the policy drifts, so they
are not quite), and the test runs at every step (no correction for repeated looks; the edge
trigger and the small ``alpha`` keep the false-alarm rate of a whole run low).

Empty steps (:class:`EmptySteps`): a step whose every prompt was skipped (all its video reads
failed: 0 groups) trains on nothing; it logs no rollout value (``rollout_metrics`` of no
rollout is empty, not 0.0), raises an alarm row, and ``train.max_empty_steps`` of them in a row
stop the run with ``EmptyStepsError`` naming the skipped prompts' errors: one bad step can be
a transient (a network file system that blinked), several in a row mean the data is unreadable
and the run would spend its whole budget on nothing while looking healthy (rc 0).

Pure (no I/O, no torch): ``paravt.train`` feeds it each step's metrics, prints the alarms and
logs them to ``metrics.jsonl`` as ``kind: "alarm"`` rows, which ``paravt.view`` shows. On
``--resume`` the trainer replays the kept rows (:meth:`CollapseDetector.replay`) so that
starting levels and armed states are those of the uninterrupted run.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

TOOL = "tool_call_rate"
CLOSURE = "think_closure_rate"
PARSE = "parse_error_rate"
PER_K_TOOL = "tool_rate/K"
# Keys of a rate's prompt-level sample in a step's row: number of prompts, mean squared rate.
PROMPTS, PROMPT_SQ = "prompts/", "prompt_sq/"
# Defaults of the significance rule (module docstring): prompts needed on each side, and the
# level of the one-sided test. 0.005 keeps a healthy default run (4 Ks x ~35 tested steps)
# silent; a collapse to ~0 over 5+ prompts gives p < 1e-3.
MIN_PROMPTS = 2
ALPHA = 0.005


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
    # (prompts, mean rate, mean squared rate) of each observation, for the significance rule.
    first_n: list[tuple[float, float, float]] = field(default_factory=list)
    last_n: deque = field(default_factory=deque)
    n: int = 0
    active: bool = False


def _pooled(obs: Iterable[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Prompts ``n``, mean and sample variance of the per-prompt rates of several steps."""
    n = sq = tot = 0.0
    for k, m, m2 in obs:
        n, tot, sq = n + k, tot + k * m, sq + k * m2
    if n <= 0:
        return 0.0, 0.0, 0.0
    mean = tot / n
    var = max(sq / n - mean * mean, 0.0) * n / (n - 1) if n > 1 else 0.0
    return n, mean, var


def drop_p_value(
    base: tuple[float, float, float], win: tuple[float, float, float], frac: float
) -> float:
    """One-sided p-value of ``H0: mean_win >= frac · mean_base`` (Student's t, pooled).

    ``base`` / ``win``: ``(n, mean, sample variance)`` of prompt-level rates (:func:`_pooled`).
    The variance is pooled over both sides: a window of a few prompts that all happen not to
    call has a sample variance of 0, and Welch's test would then call any fall certain (per-
    prompt rates are skewed: many prompts sit at 0). With no variance anywhere the p-value is
    0 when the window is below, else 1."""
    (nb, mb, vb), (nw, mw, vw) = base, win
    diff = frac * mb - mw
    df = nb + nw - 2
    pooled = ((nb - 1) * vb + (nw - 1) * vw) / df if df > 0 else 0.0
    se2 = pooled * (frac * frac / nb + 1.0 / nw)
    if se2 <= 0:
        return 0.0 if diff > 0 else 1.0
    return student_t_sf(diff / math.sqrt(se2), df)


def student_t_sf(t: float, df: float) -> float:
    """``P(T > t)`` for Student's t with ``df`` (real, > 0) degrees of freedom."""
    x = df / (df + t * t)
    tail = 0.5 * _betainc(0.5 * df, 0.5, x)
    return tail if t > 0 else 1.0 - tail


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta ``I_x(a, b)`` (Lentz's continued fraction)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbeta = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    front = math.exp(lbeta + a * math.log(x) + b * math.log1p(-x))
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on the other side
        return 1.0 - _betainc(b, a, 1.0 - x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-14:
            break
    return front * h / a


class CollapseDetector:
    """Rolling collapse detection over a stream of step metrics (see the module docstring).

    ``window``: steps in the starting level and in the rolling mean (>= 1);
    ``tool_frac`` / ``closure_frac``: alarm below this fraction of the starting level (0 = off);
    ``parse_rise``: alarm when the parse-error rate exceeds its start by this much (<= 0 is
    not allowed by the config; a value > 1 never fires);
    ``min_prompts`` / ``alpha``: the sample-size rule of the tool-call rates (module docstring).
    """

    def __init__(
        self,
        window: int,
        tool_frac: float,
        closure_frac: float,
        parse_rise: float,
        *,
        min_prompts: int = MIN_PROMPTS,
        alpha: float = ALPHA,
    ) -> None:
        if window < 1:
            raise ValueError(f"CollapseDetector: window={window} must be >= 1")
        if min_prompts < 1 or not 0 < alpha <= 1:
            raise ValueError(
                f"CollapseDetector: min_prompts={min_prompts} must be >= 1 and alpha={alpha} in "
                "(0, 1] (alpha=1 and min_prompts=1 turn the sample-size rule off)"
            )
        self.min_prompts = min_prompts
        self.alpha = alpha
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
            s = self.series.setdefault(
                key,
                _Series(direction, last=deque(maxlen=self.window),
                        last_n=deque(maxlen=self.window)),
            )  # fmt: skip
            n, sq = metrics.get(PROMPTS + key), metrics.get(PROMPT_SQ + key)
            obs = (
                (float(n), float(v), float(sq))
                if isinstance(n, (int, float)) and n > 0 and isinstance(sq, (int, float))
                else (1.0, float(v), float(v) ** 2)  # a row without them: one prompt
            )
            s.n += 1
            if len(s.first) < self.window:
                s.first.append(float(v))
                s.first_n.append(obs)
            s.last.append(float(v))
            s.last_n.append(obs)
            if s.n <= self.window:
                continue  # still measuring the starting level
            base = sum(s.first) / len(s.first)
            cur = sum(s.last) / len(s.last)
            thr = self._threshold(key, base)
            crossed = cur < thr if direction == "drop" else cur > thr
            sure, note = crossed, ""
            if crossed and not s.active and key != CLOSURE and direction == "drop":
                pb, pw = _pooled(s.first_n), _pooled(s.last_n)  # a tool-call rate
                if min(pb[0], pw[0]) < self.min_prompts:
                    sure = False
                else:
                    p = drop_p_value(pb, pw, self.tool_frac)
                    sure = p < self.alpha
                    note = f"; {int(pw[0])} prompts vs {int(pb[0])} at the start, p={p:.2g}"
            if sure and not s.active:
                msg = _message(key, cur, base, thr, self.window) + note
                fired.append(Alarm(int(step), key, cur, base, thr, msg))
            # Re-armed only once the mean is back across the threshold (not when the
            # significance of a persisting fall wavers).
            s.active = crossed and (s.active or sure)
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
    min_prompts: int = MIN_PROMPTS,
    alpha: float = ALPHA,
) -> list[Alarm]:
    """All alarms of a finished metric stream (the ``metrics.jsonl`` rows of a run)."""
    return CollapseDetector(
        window, tool_frac, closure_frac, parse_rise, min_prompts=min_prompts, alpha=alpha
    ).replay(rows)


class EmptyStepsError(RuntimeError):
    """``train.max_empty_steps`` steps in a row trained on nothing; ``paravt.train.main``
    exits 1 with its message."""


class EmptySteps:
    """Counts the steps in a row that trained on nothing (``num_groups == 0``); ``paravt.train``
    feeds it each step (``update``), logs the alarm, then calls ``check``. ``limit``:
    ``train.max_empty_steps`` (0: never stop, alarm only). A resumed run counts afresh."""

    def __init__(self, limit: int) -> None:
        self.limit, self.run = int(limit), 0
        self.why = ""

    def update(self, step: int, metrics: Mapping[str, Any], errors: Iterable[str]) -> Alarm | None:
        """The step's alarm when it was empty, None otherwise. ``errors``: the step's skipped
        prompts' errors (``RolloutBatch.errors`` of every rank), quoted in the alarm."""
        if metrics.get("num_groups", 1) > 0:
            self.run = 0
            return None
        self.run += 1
        errs = list(errors)
        shown = "; ".join(errs[:3]) + (f"; ... ({len(errs) - 3} more)" if len(errs) > 3 else "")
        self.why = f"every prompt was skipped ({shown or 'no error recorded'})"
        return Alarm(
            step, "num_groups", 0.0, 0.0, 0.0, f"step {step} trained on nothing: {self.why}"
        )

    def check(self, step: int) -> None:
        """Raise ``EmptyStepsError`` once ``limit`` steps in a row, up to ``step``, were empty."""
        if self.limit and self.run >= self.limit:
            raise EmptyStepsError(
                f"{self.run} steps in a row trained on nothing (steps {step - self.run + 1}.."
                f"{step}): {self.why}. Fix the videos (or data.path / data.video_root) and "
                "rerun with --resume; train.max_empty_steps sets how many such steps stop a "
                "run (0: never)."
            )
