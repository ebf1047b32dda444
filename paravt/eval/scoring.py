"""Scoring of evaluation answers and per-benchmark summaries (``python -m paravt.eval``).

Three steps, each a function:

* :func:`score_answer` reads one sample's answer from the main agent's full text with the same
  extraction the accuracy reward uses (:mod:`paravt.rewards.accuracy`: ``extract_answer``,
  ``extract_choice``, ``parse_window``, ``temporal_iou``) and scores it by question type;
* :func:`summarize` turns the runner's per-sample rows (``results.jsonl``) into one benchmark's
  summary: its headline metric, breakdowns by category and question type, tool-use figures;
* :func:`markdown_table` renders a summary for a report.

Where this departs from the reference evaluations (``shared/research/benchmarks.md``) and why:

* unparseable answers count as wrong and stay in the denominator (Video-MME's official script
  drops them, §1.4); LongVideoBench's lmms-eval parser guesses a random letter instead (§2.6);
* error rows (the sample could not be run: missing video, engine failure) count as wrong / IoU
  0 and stay in the denominator, and are counted in ``n_errors``. ParaVT's driver dropped
  Charades error rows from the denominator (§7.7) and counted API errors as silent wrongs;
* open-ended MMVU rows are judged as open-ended (ParaVT scored them as letters, capping the
  benchmark at 62.5 %, §5.5) by a :class:`Judge`, by default the offline :class:`RuleJudge`;
  the official metric uses a GPT-4o judge (§5.3), so RuleJudge numbers are not the official
  ones (a heuristic: see :class:`RuleJudge`);
* MLVU's headline is M-Avg, the mean of per-task accuracies (§4.3), not micro accuracy;
* LVBench rows count once in every category of their multi-label ``question_type`` (§3.3);
* a letter is read by :func:`paravt.answers.extract_choice`, which does not take the
  article "A" for a choice (the reference's ``\\b([A-J])\\b`` did, §7.5).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from paravt.answers import extract_answer, extract_choice, normalize_text, parse_window
from paravt.eval.benchmarks import benchmark_headline
from paravt.rewards.accuracy import (
    exact_match,
    gold_choice,
    gold_window,
    sample_options,
    temporal_iou,
    token_f1,
)
from paravt.rewards.format import END_MARKERS
from paravt.rewards.tool import call_counts
from paravt.types import Sample, Trajectory


# ------------------------------------------------------------------------------------ judges
class Judge(Protocol):
    """Decides whether an open-ended prediction answers the question as the gold answer does.

    An implementation that calls a service must raise when the call fails: a failed judgement
    is an error row, never a silent wrong answer (the reference's defect).
    """

    def __call__(self, question: str, gold: str, pred: str) -> bool: ...


_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")
# Before normalize_text drops punctuation: keep "3.5" one token ("3p5", so gold "5" is not
# found in "3.5") and a leading minus ("n5", so gold "5" is not found in "-5 degrees").
_DECIMAL_POINT = re.compile(r"(?<=\d)\.(?=\d)")
_MINUS = re.compile(r"(?<![\w.])-(?=\d)")


def _single_number(s: str) -> float | None:
    """The finite number ``s`` is, alone ("12", "-3.5", "1e3", "1,250", "42."), else None."""
    s = s.strip()
    if s.endswith(".") and len(s) > 1:
        s = s[:-1]
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if not _NUMBER.fullmatch(s):
        return None
    x = float(s)
    return x if math.isfinite(x) else None


def _judge_tokens(s: str) -> list[str]:
    return normalize_text(_MINUS.sub("n", _DECIMAL_POINT.sub("p", s))).split()


def _contains(tokens: list[str], part: list[str]) -> bool:
    k = len(part)
    return any(tokens[i : i + k] == part for i in range(len(tokens) - k + 1))


# Words that turn "the gold appears in the prediction" into a hedge or a denial.
HEDGE_WORDS = frozenset(
    {"not", "no", "or", "nor", "neither", "never", "instead", "rather", "unlike", "except", "but"}
)


@dataclass(frozen=True)
class RuleJudge:
    """The offline open-ended judge: no network, deterministic.

    ``pred`` is correct iff, in this order:

    1. both ``gold`` and ``pred`` are single finite numbers ("12", "-3.5", "1,250", "1e3"): then
       ``|pred - gold| <= rel_tol * |gold|`` decides, and nothing else is tried (so "-5" is not
       "5", which normalisation alone would equate);
    2. the normalised token lists are equal (``normalize_text``: lower-case, punctuation and
       articles dropped; a decimal point and a leading minus are kept inside their number);
    3. the gold has 1 to ``max_gold_tokens`` tokens and occurs as a contiguous run of whole
       tokens in the prediction ("mitosis" in "it is mitosis", not "red" in "reddish"), and
       the prediction has at most ``max_pred_tokens`` tokens (None: no limit). The limit keeps
       a paragraph or a list of guesses ("red blue green") from passing by naming the gold
       somewhere; answer blocks and the short answers the prompts ask for are well under it.
       A prediction holding a negation or an alternative the gold does not ("not", "or",
       "instead", … :data:`HEDGE_WORDS`) never passes this way: "meiosis, not mitosis" and
       "5 or 6" are not "mitosis" and "5".

    An empty gold matches nothing. A heuristic, neither a lower nor an upper bound of the
    official MMVU judge (GPT-4o, benchmarks.md §5.3): that judge also accepts paraphrases and
    equivalent forms these rules reject, and rule 3 can still accept an answer that names the
    gold among other words ("red blue green" for "red"; "O(n^2)" for "O(n)", as punctuation
    is dropped). Plug a model judge in through :class:`Judge` where that matters.
    """

    rel_tol: float = 0.01
    max_gold_tokens: int = 5
    max_pred_tokens: int | None = 20

    def __call__(self, question: str, gold: str, pred: str) -> bool:
        g_num, p_num = _single_number(gold), _single_number(pred)
        if g_num is not None and p_num is not None:
            return abs(p_num - g_num) <= self.rel_tol * abs(g_num)
        g, p = _judge_tokens(gold), _judge_tokens(pred)
        if not g:
            return False
        if g == p:
            return True
        if self.max_pred_tokens is not None and len(p) > self.max_pred_tokens:
            return False
        if HEDGE_WORDS.intersection(p) - set(g):
            return False
        return len(g) <= self.max_gold_tokens and _contains(p, g)


# ----------------------------------------------------------------------------------- answers
_TAG = re.compile(r"</?(?:think|answer|tool_call|tool_response)>")


def _drop_blocks(text: str, open_tag: str, close_tag: str) -> str:
    """``text`` without its ``open…close`` blocks; an unclosed block runs to the next open tag
    or the end. One pass (a lazy regex rescans the rest of the text from every open tag)."""
    parts = text.split(open_tag)
    kept = [parts[0]]
    for part in parts[1:]:
        _, closed, after = part.partition(close_tag)
        if closed:
            kept.append(after)
    return " ".join(kept)


def final_text(text: str) -> str:
    """What a model said outside its thinking and tool calls: the text after the last
    ``</think>`` (all of it without one), less ``<tool_call>``/``<tool_response>`` blocks
    (closed or not), stray tags (an unclosed ``<answer>C`` reads ``C``) and end-of-turn
    markers; stripped. Read for mcq/oe answers when there is no answer block."""
    _, closed, after = text.rpartition("</think>")
    s = after if closed else text
    s = _drop_blocks(s, "<tool_call>", "</tool_call>")
    s = _drop_blocks(s, "<tool_response>", "</tool_response>")
    for marker in END_MARKERS:
        s = s.replace(marker, " ")
    return _TAG.sub(" ", s).strip()


_ANSWER_TEXT_CHARS = 300


def score_answer(sample: Sample, text: str, *, judge: Judge | None = None) -> dict[str, Any]:
    """Score one main agent's full text (all turns, tags included) against ``sample``.

    Returns, in this key order::

        parsed       the answer read: the letter (mcq), the answer text (oe), the window
                     "start-end" in seconds (tvg); None when nothing was read
        source       "answer_block" (the last complete <answer>…</answer>), "final_text" (mcq
                     and oe without an answer block: :func:`final_text`, for base models that
                     answer bare), or "none" (no answer block and, for mcq/oe, no final text)
        correct      bool (mcq, oe); None (tvg)
        iou          IoU with the ground-truth window (tvg; 0.0 when none was read); None else
        score        1.0/0.0 (mcq, oe), the IoU (tvg)
        unparseable  True when nothing could be read: no letter (also a letter outside the
                     options or hedging like "(A) (B)"), an empty answer, no window
        answer_text  the text the answer was read from, first 300 characters; None if none
        em, f1       (oe only) ``exact_match`` and multiset ``token_f1`` of the answer, 0 when
                     unparseable

    * mcq: :func:`extract_choice` over :func:`sample_options`, against :func:`gold_choice`.
    * oe: ``judge`` (default :class:`RuleJudge`) decides ``correct``; ``em``/``f1`` are
      reported beside it. The final-text fallback applies as for mcq (MMVU prompts ask for a
      direct short answer, which base models give without tags).
    * tvg: :func:`parse_window` on the answer block only (a window mentioned while thinking is
      not an answer), IoU with :func:`gold_window`.

    Never raises on ``text`` (any length or content: extraction is linear-time). Raises
    ValueError for a sample whose ``question_type`` is unknown or, for tvg, that has no
    ground-truth window (a dataset defect), and whatever ``judge`` raises.
    """
    qt = sample.question_type
    if qt not in ("mcq", "oe", "tvg"):
        raise ValueError(
            f"sample {sample.id}: question_type {qt!r} is not one of mcq|oe|tvg; fix the row"
        )
    answer = extract_answer(text)
    source = "answer_block"
    if answer is None and qt != "tvg":
        answer = final_text(text) or None
        source = "final_text"
    if answer is None:
        source = "none"
    out: dict[str, Any] = {
        "parsed": None,
        "source": source,
        "correct": None,
        "iou": None,
        "score": 0.0,
        "unparseable": True,
        "answer_text": None if answer is None else answer[:_ANSWER_TEXT_CHARS],
    }
    if qt == "mcq":
        letter = extract_choice(answer, sample_options(sample)) if answer else None
        correct = letter is not None and letter == gold_choice(sample)
        out.update(parsed=letter, correct=correct, score=float(correct), unparseable=not letter)
    elif qt == "oe":
        if answer:
            correct = bool((judge or RuleJudge())(sample.question, sample.answer, answer))
            em, f1 = exact_match(answer, sample.answer), token_f1(answer, sample.answer)
        else:
            correct, em, f1 = False, 0.0, 0.0
        out.update(
            parsed=answer or None,
            correct=correct,
            score=float(correct),
            unparseable=not answer,
            em=em,
            f1=f1,
        )
    else:
        window = parse_window(answer) if answer is not None else None
        iou = temporal_iou(window, gold_window(sample)) if window is not None else 0.0
        parsed = None if window is None else f"{window[0]}-{window[1]}"
        out.update(parsed=parsed, iou=iou, score=iou, unparseable=window is None)
    return out


def call_fields(traj: Trajectory) -> dict[str, int]:
    """The tool fields of a result row, from a main trajectory's recorded calls.

    ``calls`` (every parsed ``<tool_call>``, any status), ``calls_ok`` (executed), ``turns``,
    and ``call_format_errors``: calls whose status is a *model* format error, the set the tool
    reward penalises (:func:`paravt.rewards.tool.call_counts`): ``bad_json``,
    ``unknown_tool``, ``bad_arguments``, ``bad_range``, ``outside_video``,
    ``over_parallel_limit``, ``unclosed``. ``decode_error``, ``sub_agent_error`` and
    ``tool_error`` are failures of the system, not of the model's format, and are not counted.
    """
    n = call_counts(traj)
    return {
        "calls": n["n_calls"],
        "calls_ok": n["n_ok"],
        "call_format_errors": n["n_model_errors"],
        "turns": len(traj.turns),
    }


# --------------------------------------------------------------------------------- summaries
ROW_FIELDS = (
    "id",
    "question_type",
    "categories",
    "correct",
    "iou",
    "unparseable",
    "error",
    "calls",
    "calls_ok",
    "call_format_errors",
    "turns",
)
THRESHOLDS = (0.3, 0.5, 0.7)
NO_CATEGORY = "(none)"


def _value(row: dict[str, Any]) -> float:
    """A row's contribution to its metric: IoU for tvg (0 when absent or not finite), else
    1 for ``correct is True`` and 0 otherwise (wrong, unparseable and error rows alike)."""
    if row["question_type"] == "tvg":
        iou = row["iou"]
        return float(iou) if isinstance(iou, (int, float)) and math.isfinite(iou) else 0.0
    return 1.0 if row["correct"] is True else 0.0


def _labels(value: Any) -> list[str]:
    """The category values a row counts in: a list counts in each distinct entry (LVBench's
    multi-label question_type, the official rule); a missing or empty value in ``(none)``."""
    items = value if isinstance(value, (list, tuple)) else [value]
    labels = {str(v) for v in items if v is not None and str(v) != ""}
    return sorted(labels) or [NO_CATEGORY]


def _mean(xs: list[float]) -> float | None:
    # fsum is exactly rounded, so the summary does not depend on the order of the rows.
    return math.fsum(xs) / len(xs) if xs else None


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def _groups(pairs: Iterable[tuple[str, float]]) -> dict[str, dict[str, Any]]:
    by: dict[str, list[float]] = defaultdict(list)
    for key, v in pairs:
        by[key].append(v)
    return {k: {"n": len(by[k]), "score": _mean(by[k])} for k in sorted(by)}


def _rounded_groups(groups: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {k: {"n": g["n"], "score": _round(g["score"])} for k, g in groups.items()}


def summarize(benchmark: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One benchmark's summary from its result rows (any order; the result does not depend on
    it). JSON-serialisable, floats rounded to 6 decimals, fractions in [0, 1].

    Rows need the fields in :data:`ROW_FIELDS` (ValueError naming the row otherwise); their
    ``score`` is not read: the metrics come from ``correct`` and ``iou``. Every row counts in
    every denominator, error rows (``error`` set) and unparseable rows included, as wrong / IoU 0.

    Keys, in this order (those in brackets only when they apply):

    * ``benchmark``, ``n``, ``n_errors``, ``n_unparseable``;
    * ``metric``, ``score``: the headline. ``m_avg`` for a benchmark registered with that
      headline (MLVU; :func:`paravt.eval.benchmarks.benchmark_headline`, which also matches
      spellings such as "MLVU-dev"), ``mIoU`` when every row is tvg (or, with no rows, for a
      benchmark registered with that headline: Charades-STA),
      ``accuracy`` when no row is tvg, and ``mean_score`` (mean of the rows' values, 0/1 and
      IoU) for a mix of tvg and other rows;
    * [``accuracy``]: correct / number of non-tvg rows (all rows for an mcq/oe benchmark);
    * [``m_avg``] (MLVU): mean over ``task_type`` values of their accuracy (the paper's M-Avg;
      with unequal task sizes it differs from micro accuracy);
    * [``mIoU``, ``R@0.3``, ``R@0.5``, ``R@0.7``]: over the tvg rows; ``R@t`` is the share
      with ``IoU >= t`` (IoU as computed, not rounded);
    * ``by_category``: ``{name: {value: {"n", "score"}}}``, names and values sorted; ``score``
      is the mean row value (accuracy or mIoU); a list-valued category counts the row in each
      value, a missing or empty one under ``"(none)"``;
    * [``by_question_type``]: ``{qt: {"n", "score"}}`` when rows of several types are present;
    * ``tools``: ``tool_call_rate`` (share of rows with any call, valid or not: not the
      training metric of the same name, which counts executed calls), ``calls_per_sample``,
      ``calls_ok_per_sample``, ``call_format_error_rate`` (format errors / all calls; see
      :func:`call_fields` for the statuses), ``turns_per_sample``.

    With no rows: ``n`` 0 and every metric None.
    """
    for row in rows:
        missing = [f for f in ROW_FIELDS if f not in row]
        if missing:
            raise ValueError(
                f"{benchmark}: result row {row.get('id', '?')!r} lacks {', '.join(missing)}; "
                "rows must be written by the eval runner (paravt.eval)"
            )
    n = len(rows)
    values = [_value(r) for r in rows]
    tvg = [v for r, v in zip(rows, values) if r["question_type"] == "tvg"]
    other = [v for r, v in zip(rows, values) if r["question_type"] != "tvg"]

    by_category: dict[str, dict[str, dict[str, Any]]] = {}
    names = sorted({name for r in rows for name in r["categories"]})
    for name in names:
        by_category[name] = _groups(
            (label, v) for r, v in zip(rows, values) for label in _labels(r["categories"].get(name))
        )

    headline = benchmark_headline(benchmark)
    if headline == "m_avg":
        metric = "m_avg"
    elif (tvg and not other) or (not rows and headline == "mIoU"):
        metric = "mIoU"
    elif not tvg:
        metric = "accuracy"
    else:
        metric = "mean_score"

    metrics: dict[str, float | None] = {}
    if other or metric in ("accuracy", "m_avg"):
        metrics["accuracy"] = _mean(other)
    if metric == "m_avg":
        tasks = by_category.get("task_type", _groups((NO_CATEGORY, v) for v in values))
        metrics["m_avg"] = _mean([g["score"] for g in tasks.values()])
    if tvg or metric == "mIoU":
        metrics["mIoU"] = _mean(tvg)
        for t in THRESHOLDS:
            metrics[f"R@{t}"] = _mean([float(iou >= t) for iou in tvg])
    headline = _mean(values) if metric == "mean_score" else metrics[metric]

    calls = [int(r["calls"]) for r in rows]
    tools = {
        "tool_call_rate": _mean([float(c > 0) for c in calls]),
        "calls_per_sample": _mean([float(c) for c in calls]),
        "calls_ok_per_sample": _mean([float(r["calls_ok"]) for r in rows]),
        "call_format_error_rate": (
            sum(int(r["call_format_errors"]) for r in rows) / max(sum(calls), 1) if rows else None
        ),
        "turns_per_sample": _mean([float(r["turns"]) for r in rows]),
    }

    out: dict[str, Any] = {
        "benchmark": benchmark,
        "n": n,
        "n_errors": sum(bool(r["error"]) for r in rows),
        "n_unparseable": sum(bool(r["unparseable"]) for r in rows),
        "metric": metric,
        "score": _round(headline),
    }
    out.update({k: _round(v) for k, v in metrics.items()})
    out["by_category"] = {k: _rounded_groups(g) for k, g in by_category.items()}
    qtypes = _groups((r["question_type"], v) for r, v in zip(rows, values))
    if len(qtypes) > 1:
        out["by_question_type"] = _rounded_groups(qtypes)
    out["tools"] = {k: _round(v) for k, v in tools.items()}
    return out


# ---------------------------------------------------------------------------------- markdown
def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def markdown_table(summary: dict[str, Any]) -> str:
    """A :func:`summarize` result as markdown: the headline row, every metric of the summary,
    then one table per breakdown (by question type, then each category). Percentages with one
    decimal, per-sample counts with two; deterministic for a given summary."""
    tools = summary.get("tools", {})
    lines = _table(
        [
            "benchmark",
            "n",
            "metric",
            "score",
            "errors",
            "unparseable",
            "tool-call rate",
            "calls/sample",
            "format-error rate",
        ],
        [
            [
                str(summary["benchmark"]),
                str(summary["n"]),
                str(summary["metric"]),
                _pct(summary["score"]),
                str(summary["n_errors"]),
                str(summary["n_unparseable"]),
                _pct(tools.get("tool_call_rate")),
                _num(tools.get("calls_per_sample")),
                _pct(tools.get("call_format_error_rate")),
            ]
        ],
    )
    metric_keys = ("accuracy", "m_avg", "mIoU", *(f"R@{t}" for t in THRESHOLDS))
    shown = [k for k in metric_keys if k in summary]
    if shown:
        lines += ["", *_table(shown, [[_pct(summary[k]) for k in shown]])]
    breakdowns = [("question type", "question_type", summary.get("by_question_type", {}))]
    for name, groups in summary.get("by_category", {}).items():
        breakdowns.append((f"category: {name}", name, groups))
    for title, column, groups in breakdowns:
        if groups:
            rows = [[str(v), str(g["n"]), _pct(g["score"])] for v, g in groups.items()]
            lines += ["", f"**by {title}**", "", *_table([column, "n", "score"], rows)]
    return "\n".join(lines) + "\n"
