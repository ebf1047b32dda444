"""Eval scoring: answers read from hostile texts, exact benchmark summaries, markdown."""

from __future__ import annotations

import json
import random
from typing import get_args

import pytest

from paravt.eval.scoring import (
    RuleJudge,
    call_fields,
    final_text,
    markdown_table,
    score_answer,
    summarize,
)
from paravt.types import Sample, ToolCall, ToolCallStatus, Trajectory, Turn

OPTS = ["A. blue circle", "B. red square", "C. green triangle", "D. yellow star"]
MCQ = Sample("q1", "v.mp4", "What appears?", "B", "mcq", options=OPTS)
TVG = Sample(
    "t1", "v.mp4", "When does the light turn on?", "", "tvg", event_start=10.0, event_end=20.0
)
OE = Sample("o1", "v.mp4", "Which process is shown?", "mitosis", "oe")
CALL = (
    '<tool_call>{"name": "crop_video", "arguments": {"start_time": 1, "end_time": 2}}</tool_call>'
)

_KEYS = ["parsed", "source", "correct", "iou", "score", "unparseable", "answer_text"]


# --------------------------------------------------------------------------------------- mcq
@pytest.mark.parametrize(
    "text,parsed,source",
    [
        ("<answer>B</answer>", "B", "answer_block"),
        ("<answer> (c) </answer>", "C", "answer_block"),
        ("<answer>b</answer>", "B", "answer_block"),
        ("<answer>**B**</answer>", "B", "answer_block"),
        ("<answer>The answer is (D)</answer>", "D", "answer_block"),
        ("<answer>Answer: C</answer>", "C", "answer_block"),
        ("<answer>B. red square</answer>", "B", "answer_block"),
        ("<answer>red square</answer>", "B", "answer_block"),  # the option's text
        ("<answer>A</answer>", "A", "answer_block"),  # read, and wrong
        # Bare answers (base models): read from the text after the thinking.
        ("B", "B", "final_text"),
        ("<think>\nIt is the square.\n</think>\nB", "B", "final_text"),
        ("B<|im_end|>", "B", "final_text"),
        (f"<think>look</think>{CALL}<think>seen</think>\nC", "C", "final_text"),
        ("<answer>C", "C", "final_text"),  # unclosed block: its tag is dropped, C read
        # The article is not a choice; hedging names none.
        ("The answer is A man", None, "final_text"),
        ("A man walks in", None, "final_text"),
        ("<answer>A or B</answer>", None, "answer_block"),
        ("<answer>(A) (B)</answer>", None, "answer_block"),
        ("<answer>(B) or option C</answer>", None, "answer_block"),  # issue 27 item 5
        ("<answer>B. C. D.</answer>", None, "answer_block"),
        ("<answer>Option B is correct</answer>", "B", "answer_block"),
        ("<answer>Answer: A since it is round</answer>", "A", "answer_block"),
        # The last complete block wins; an unclosed later one does not override it.
        ("<answer>A</answer> then <answer>D</answer>", "D", "answer_block"),
        ("<answer>A</answer><answer>C", "A", "answer_block"),
        ("<answer>C</answer>and then A", "C", "answer_block"),
        ("<answer>B</answer>" * 10_000, "B", "answer_block"),
        # A letter inside a tool call or the thinking is not an answer.
        ('<tool_call>{"name": "A"}</tool_call>', None, "none"),
        ('<tool_call>{"name": "crop_video"} A', None, "none"),  # unclosed call
        ("<think>The answer is A</think>", None, "none"),
        # Letters outside the options, and things that are not letters.
        ("<answer>E</answer>", None, "answer_block"),
        ("<answer>🅱️</answer>", None, "answer_block"),
        ("<answer>Ⓑ</answer>", None, "answer_block"),
        ("<answer>Ｂ</answer>", None, "answer_block"),  # full-width
        ("\x00\udcff\u202e", None, "final_text"),
        ("<answer></answer>", None, "answer_block"),
        ("<answer><answer>B</answer></answer>", None, "answer_block"),  # block is "<answer>B"
        ("", None, "none"),
        ("   \n ", None, "none"),
        ("<answer>" * 20_000, None, "none"),
        ("x" * 100_000, None, "final_text"),
        ("(" * 50_000 + "A" + ")" * 50_000, "A", "final_text"),  # it does hold "(A)"
    ],
)
def test_mcq_answers(text, parsed, source):
    r = score_answer(MCQ, text)
    assert list(r) == _KEYS
    assert (r["parsed"], r["source"]) == (parsed, source)
    assert r["unparseable"] is (parsed is None)
    assert r["correct"] is (parsed == "B") and r["score"] == float(parsed == "B")
    assert r["iou"] is None
    assert r["answer_text"] is None or len(r["answer_text"]) <= 300


def test_mcq_options_from_question_and_gold_text():
    q = "What appears?\n(A) blue circle\n(B) red square\n(C) green triangle"
    s = Sample("q2", "v", q, "(C)", "mcq")  # LVBench: options embedded, gold written "(C)"
    assert score_answer(s, "<answer>green triangle</answer>")["correct"] is True
    assert score_answer(s, "<answer>D</answer>")["unparseable"] is True  # 3 options


# --------------------------------------------------------------------------------------- tvg
@pytest.mark.parametrize(
    "text,window,iou",
    [
        ("<answer>The event happens in the 12 - 18 seconds.</answer>", (12.0, 18.0), 0.6),
        ("<answer>from 10 to 20</answer>", (10.0, 20.0), 1.0),
        ("<answer>[12.5, 18]</answer>", (12.5, 18.0), 0.55),
        ("<answer>[10, 20]</answer>", (10.0, 20.0), 1.0),
        ("<answer>12.5s - 18s</answer>", (12.5, 18.0), 0.55),
        ("<answer>10—20</answer>", (10.0, 20.0), 1.0),
        ("<answer>🙂 10 – 20 🙂</answer>", (10.0, 20.0), 1.0),
        ("<answer>5 ~ 25</answer>", (5.0, 25.0), 0.5),
        ("<answer>between 10 and 15</answer>", (10.0, 15.0), 0.5),
        ("<answer>starts at 10 and ends at 15</answer>", (10.0, 15.0), 0.5),
        ("<answer>24.3 - 30.4 seconds</answer>", (24.3, 30.4), 0.0),
        # Clock forms (Charades / LVBench style).
        ("<answer>00:10 - 00:20</answer>", (10.0, 20.0), 1.0),
        ("<answer>0:05 - 0:15</answer>", (5.0, 15.0), 5 / 15),
        ("<answer>0:00:10 - 0:00:20</answer>", (10.0, 20.0), 1.0),
        ("<answer>1:75 - 2:00</answer>", None, 0.0),
        # Negative start is read as written: the union grows.
        ("<answer>-5 - 15</answer>", (-5.0, 15.0), 0.2),
        # Reversed, empty, non-finite and non-numeric windows are unparseable.
        ("<answer>20-10</answer>", None, 0.0),
        ("<answer>15-15</answer>", None, 0.0),
        ("<answer>1e400-2</answer>", None, 0.0),
        ("<answer>nan-5</answer>", None, 0.0),
        ("<answer>0-" + "9" * 400 + "</answer>", None, 0.0),
        ("<answer>" + "9" * 100_000 + "</answer>", None, 0.0),
        ("<answer>around 15</answer>", None, 0.0),
        # Other units and exponents are no window (issue 27 item 6), seconds are.
        ("<answer>10-20 minutes</answer>", None, 0.0),
        ("<answer>10-20 ms</answer>", None, 0.0),
        ("<answer>10-20e3</answer>", None, 0.0),
        ("<answer>from 10s to 20s</answer>", (10.0, 20.0), 1.0),
        ("<answer>ten to twenty</answer>", None, 0.0),
        ("<answer></answer>", None, 0.0),
        # Only the answer block is read: no fallback for temporal answers.
        ("10 - 20", None, 0.0),
        ("<answer>10-20", None, 0.0),
        ("<think>10-20</think>", None, 0.0),
        ("<think>10 - 20</think><answer>no idea</answer>", None, 0.0),
        ("10-20 <answer>15 to 25</answer>", (15.0, 25.0), 5 / 15),
        ("<answer>10-20</answer><answer>12-14</answer>", (12.0, 14.0), 0.2),
        ("", None, 0.0),
    ],
)
def test_tvg_answers(text, window, iou):
    r = score_answer(TVG, text)
    assert list(r) == _KEYS
    assert r["parsed"] == (None if window is None else f"{window[0]}-{window[1]}")
    assert r["unparseable"] is (window is None)
    assert r["iou"] == pytest.approx(iou, abs=1e-12) and r["score"] == r["iou"]
    assert r["correct"] is None
    assert r["source"] == ("answer_block" if "</answer>" in text else "none")


def test_tvg_without_gold_window_names_the_sample():
    bad = Sample("t9", "v", "when?", "soon", "tvg")
    with pytest.raises(ValueError, match="t9.*no ground-truth window"):
        score_answer(bad, "<answer>1-2</answer>")


# ---------------------------------------------------------------------------------------- oe
@pytest.mark.parametrize(
    "gold,pred,want",
    [
        ("mitosis", "Mitosis.", True),
        ("the mitosis", "mitosis", True),  # articles dropped
        ("mitosis", "It is mitosis", True),  # gold as whole tokens in the prediction
        ("red", "reddish", False),  # not a whole token
        ("O(n log n)", "o(n log n)", True),
        ("cell division", "division cell", False),  # order matters
        (
            "a very long gold answer of many tokens",
            "it is a very long gold answer of many tokens",
            False,
        ),
        ("red", "word " * 25 + "red", False),  # a paragraph naming the gold somewhere
        ("red", "red blue green", True),  # the honest limit: a short list passes
        # Negations and alternatives are not the gold (unless the gold holds them).
        ("5", "5 or 6", False),
        ("mitosis", "meiosis, not mitosis", False),
        ("Dolly Zoom", "not a dolly zoom, a tracking shot", False),
        ("Dolly Zoom", "a dolly zoom", True),
        ("not applicable", "it is not applicable", True),
        # Numbers: single numbers within 1 % of the gold; decimals and signs stay numbers.
        ("100", "100.5", True),
        ("100", "102", False),
        ("3.14", "3.1416", True),
        ("1,250", "1250", True),
        ("42", "42.", True),
        ("0", "0.0", True),
        ("0", "0.001", False),
        ("-5", "5", False),
        ("5", "3.5", False),
        ("5", "-5 degrees", False),
        ("5", "5 degrees", True),
        ("1e400", "inf", False),
        ("", "anything", False),
        ("", "", False),
    ],
)
def test_rule_judge(gold, pred, want):
    assert RuleJudge()("q", gold, pred) is want


def test_oe_scoring_reports_em_f1_and_uses_the_judge():
    r = score_answer(OE, "<think>look</think><answer>Mitosis</answer>")
    assert r["correct"] is True and r["score"] == 1.0 and r["em"] == 1.0 and r["f1"] == 1.0
    r = score_answer(OE, "It is mitosis")  # bare answer: the same fallback as mcq
    assert (r["source"], r["correct"], r["em"]) == ("final_text", True, 0.0)
    assert r["f1"] == pytest.approx(0.5)  # P = 1/3, R = 1
    r = score_answer(OE, "<answer></answer>")
    assert r["unparseable"] is True and r["correct"] is False and r["em"] == r["f1"] == 0.0
    assert list(r) == [*_KEYS, "em", "f1"]
    seen = []

    def judge(question: str, gold: str, pred: str) -> bool:
        seen.append((question, gold, pred))
        return False

    assert score_answer(OE, "<answer>mitosis</answer>", judge=judge)["correct"] is False
    assert seen == [("Which process is shown?", "mitosis", "mitosis")]

    def failing(question: str, gold: str, pred: str) -> bool:
        raise RuntimeError("judge API down")

    # A failed judgement is an error for the runner to record, not a silent wrong answer.
    with pytest.raises(RuntimeError, match="judge API down"):
        score_answer(OE, "<answer>mitosis</answer>", judge=failing)


def test_final_text():
    assert final_text(f"<think>a</think>{CALL}<tool_response>B</tool_response> C ") == "C"
    assert final_text("no think at all") == "no think at all"


# -------------------------------------------------------------------------------- tool fields
def test_call_fields_counts_model_format_errors_only():
    statuses = get_args(ToolCallStatus)
    calls = [ToolCall(raw="", status=s) for s in statuses]
    traj = Trajectory("m", "main", "q1", 0, [1], [0], [0.0], 1, turns=[Turn("x", calls), Turn("y")])
    system = {"decode_error", "sub_agent_error", "tool_error"}
    assert call_fields(traj) == {
        "calls": len(statuses),
        "calls_ok": 1,
        "call_format_errors": len(set(statuses) - {"ok"} - system),
        "turns": 2,
    }
    assert len(statuses) == 11 and call_fields(traj)["call_format_errors"] == 7


# ----------------------------------------------------------------------------------- summary
def row(
    rid: str,
    correct: bool | None = False,
    *,
    qt: str = "mcq",
    iou: float | None = None,
    error: str | None = None,
    unparseable: bool = False,
    calls: int = 0,
    ok: int = 0,
    fmt: int = 0,
    turns: int = 1,
    **categories,
) -> dict:
    return {
        "id": rid,
        "benchmark": "b",
        "question_type": qt,
        "categories": categories,
        "correct": correct,
        "iou": iou,
        "score": 0.0,  # not read by summarize
        "unparseable": unparseable,
        "error": error,
        "calls": calls,
        "calls_ok": ok,
        "call_format_errors": fmt,
        "turns": turns,
    }


def _shuffled_equal(benchmark: str, rows: list[dict]) -> dict:
    out = summarize(benchmark, rows)
    text = json.dumps(out, allow_nan=False)  # JSON-serialisable, no NaN
    for seed in range(5):
        shuffled = rows[:]
        random.Random(seed).shuffle(shuffled)
        assert json.dumps(summarize(benchmark, shuffled)) == text  # values and key order
    return out


def test_summary_videomme_errors_and_unparseable_in_denominator():
    rows = [
        row("1", True, duration="short", task_type="OCR", calls=2, ok=1, fmt=1, turns=2),
        row("2", True, duration="long", task_type="OCR", calls=3, ok=3, turns=3),
        row("3", False, duration="short", task_type="Counting"),
        row("4", False, unparseable=True, duration="medium", task_type="OCR"),
        row("5", None, error="video not found: x.mp4", duration="long", task_type="Counting"),
    ]
    out = _shuffled_equal("videomme", rows)
    assert out == {
        "benchmark": "videomme",
        "n": 5,
        "n_errors": 1,
        "n_unparseable": 1,
        "metric": "accuracy",
        "score": 0.4,
        "accuracy": 0.4,
        "by_category": {
            "duration": {
                "long": {"n": 2, "score": 0.5},
                "medium": {"n": 1, "score": 0.0},
                "short": {"n": 2, "score": 0.5},
            },
            "task_type": {
                "Counting": {"n": 2, "score": 0.0},
                "OCR": {"n": 3, "score": 0.666667},
            },
        },
        "tools": {
            "tool_call_rate": 0.4,
            "calls_per_sample": 1.0,
            "calls_ok_per_sample": 0.8,
            "call_format_error_rate": 0.2,
            "turns_per_sample": 1.6,
        },
    }
    assert list(out) == [
        "benchmark",
        "n",
        "n_errors",
        "n_unparseable",
        "metric",
        "score",
        "accuracy",
        "by_category",
        "tools",
    ]


def test_summary_lvbench_multilabel_counts_in_every_category():
    rows = [
        row("1", True, question_type=["KIR", "TG"]),
        row("2", False, question_type=["TG"]),
        row("3", True, question_type=["KIR", "KIR"]),  # a repeated label counts once
        row("4", False, question_type=[]),
        row("5", True),  # no category at all
    ]
    out = _shuffled_equal("lvbench", rows)
    assert out["accuracy"] == out["score"] == 0.6
    assert out["by_category"] == {
        "question_type": {
            "(none)": {"n": 2, "score": 0.5},
            "KIR": {"n": 2, "score": 1.0},
            "TG": {"n": 2, "score": 0.5},
        }
    }


def test_summary_mlvu_macro_average_differs_from_micro():
    rows = [row(f"a{i}", True, task_type="count") for i in range(8)]
    rows += [row(f"b{i}", False, task_type="order") for i in range(2)]
    rows += [row("c0", True, task_type="plotQA")]
    out = _shuffled_equal("mlvu_dev", rows)
    assert out["metric"] == "m_avg"
    assert out["accuracy"] == round(9 / 11, 6)  # micro
    assert out["m_avg"] == out["score"] == round((1.0 + 0.0 + 1.0) / 3, 6)  # M-Avg
    assert list(out)[:8] == [
        "benchmark",
        "n",
        "n_errors",
        "n_unparseable",
        "metric",
        "score",
        "accuracy",
        "m_avg",
    ]


def test_summary_charades_miou_recall_with_boundaries_and_errors():
    half = score_answer(TVG, "<answer>10-15</answer>")["iou"]  # exactly 0.5
    ious = [half, 0.3, 0.7, 0.69999, 0.29999, 1.0, 0.0]
    rows = [row(str(i), None, qt="tvg", iou=v) for i, v in enumerate(ious)]
    rows.append(row("err", None, qt="tvg", iou=None, error="video not found"))
    rows.append(row("unp", None, qt="tvg", iou=0.0, unparseable=True))
    out = _shuffled_equal("charades_sta", rows)
    assert half == 0.5
    n = 9
    assert out["n"] == n and out["n_errors"] == 1 and out["n_unparseable"] == 1
    assert out["metric"] == "mIoU"
    assert out["mIoU"] == out["score"] == round(sum(ious) / n, 6)
    assert out["R@0.3"] == round(5 / n, 6)  # 0.5, 0.3, 0.7, 0.69999, 1.0
    assert out["R@0.5"] == round(4 / n, 6)  # 0.5 exactly counts
    assert out["R@0.7"] == round(2 / n, 6)  # 0.7 and 1.0
    assert "accuracy" not in out and "by_question_type" not in out


def test_summary_mmvu_by_question_type_and_mixed_tvg():
    rows = [
        row("1", True, subject="Biology"),
        row("2", False, subject="Biology"),
        row("3", True, qt="oe", subject="Law"),
        row("4", False, qt="oe", subject="Law", unparseable=True),
        row("5", False, qt="oe", subject="Law"),
    ]
    out = _shuffled_equal("mmvu", rows)
    assert out["accuracy"] == 0.4 and out["metric"] == "accuracy"
    assert out["by_question_type"] == {
        "mcq": {"n": 2, "score": 0.5},
        "oe": {"n": 3, "score": 0.333333},
    }
    mixed = rows[:2] + [row("t", None, qt="tvg", iou=0.25)]
    out = _shuffled_equal("synth", mixed)
    assert (out["metric"], out["score"], out["accuracy"]) == ("mean_score", 0.416667, 0.5)
    assert out["mIoU"] == 0.25 and out["R@0.3"] == 0.0
    assert out["by_question_type"]["tvg"] == {"n": 1, "score": 0.25}


def test_summary_empty():
    assert summarize("videomme", []) == {
        "benchmark": "videomme",
        "n": 0,
        "n_errors": 0,
        "n_unparseable": 0,
        "metric": "accuracy",
        "score": None,
        "accuracy": None,
        "by_category": {},
        "tools": {
            "tool_call_rate": None,
            "calls_per_sample": None,
            "calls_ok_per_sample": None,
            "call_format_error_rate": None,
            "turns_per_sample": None,
        },
    }
    ch = summarize("charades_sta", [])
    assert ch["metric"] == "mIoU" and ch["mIoU"] is None and ch["R@0.7"] is None
    ml = summarize("mlvu", [])
    assert ml["metric"] == "m_avg" and ml["m_avg"] is None and ml["score"] is None
    json.dumps([ch, ml], allow_nan=False)


def test_summary_rejects_incomplete_rows():
    bad = row("r7", True)
    del bad["calls_ok"]
    with pytest.raises(ValueError, match="'r7' lacks calls_ok"):
        summarize("videomme", [bad])


# ---------------------------------------------------------------------------------- markdown
def test_markdown_table_contains_the_numbers():
    rows = [
        row("1", True, duration="short", calls=2, ok=1, fmt=1),
        row("2", False, duration="long"),
        row("3", True, qt="oe", duration="long"),
    ]
    md = markdown_table(summarize("mmvu", rows))
    assert md == markdown_table(summarize("mmvu", rows[::-1]))
    head = "| mmvu | 3 | accuracy | 66.7% | 0 | 0 | 33.3% | 0.67 | 50.0% |"
    assert head in md.splitlines()
    assert "| long | 2 | 50.0% |" in md and "| short | 1 | 100.0% |" in md
    assert "| oe | 1 | 100.0% |" in md and "**by category: duration**" in md
    tv = markdown_table(summarize("charades_sta", [row("t", None, qt="tvg", iou=0.5)]))
    assert "| mIoU | R@0.3 | R@0.5 | R@0.7 |" in tv and "| 50.0% | 100.0% | 100.0% | 0.0% |" in tv
    empty = markdown_table(summarize("videomme", []))
    assert "| videomme | 0 | accuracy | n/a | 0 | 0 | n/a | n/a | n/a |" in empty
