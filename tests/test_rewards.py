"""Rewards: every rule of docs/DESIGN.md "PARA-GRPO", including the reference's shortcuts."""

from __future__ import annotations

import time

import pytest

from paravt.answers import options_from_question
from paravt.config import RewardConfig
from paravt.rewards import (
    accuracy,
    analyse_turn,
    extract_answer,
    extract_choice,
    format_reward,
    parse_window,
    score,
    score_groups,
    temporal_iou,
    token_f1,
)
from paravt.rewards.accuracy import sample_options
from paravt.types import Group, Sample, ToolCall, Trajectory, Turn

OPTS = ["A. blue circle", "B. red square", "C. green triangle", "D. yellow star"]
MCQ = Sample("s1", "v.mp4", "What appears?", "B", "mcq", options=OPTS)
THINK = "<think>\n"


def _traj(turns: list[Turn], role: str = "main", uid: str = "m0", parent=None) -> Trajectory:
    return Trajectory(
        uid, role, "s1", 0, [1, 2], [0, 1], [0.0, -0.5], 1, turns=turns, parent=parent
    )


# ------------------------------------------------------------------------------- extraction
def test_answer_is_last_complete_block_never_last_line():
    assert extract_answer("<answer>A</answer> then <answer>C</answer>") == "C"
    # An unclosed trailing block does not override the last complete one.
    assert extract_answer("<answer>B</answer> <answer>D") == "B"
    # No block: no answer, even if the last line looks like one.
    assert extract_answer("reasoning...\nThe answer is B") is None
    # Blocks run from an <answer> to the next </answer>, left to right.
    assert extract_answer("<answer>A<answer>B</answer>") == "A<answer>B"
    assert extract_answer("<answer>A</answer></answer>") == "A"
    assert extract_answer("<answer></answer>") == ""
    assert accuracy("I think\nB", MCQ)["acc"] == 0.0


@pytest.mark.parametrize(
    "text,want",
    [
        ("B", "B"),
        ("(B)", "B"),
        ("B.", "B"),
        ("**B**", "B"),
        ("_(b)_", "B"),
        ("b) red square", "B"),
        ("B. red square", "B"),
        ("The answer is (B)", "B"),
        ("the answer is B.", "B"),
        ("Answer: C", "C"),
        ("I pick option D", "D"),
        ("It is clearly (c) here", "C"),
        ("red square", "B"),  # the option text itself
        # The article "A" is not a choice (the reference's \b([A-D])\b took it as A).
        ("A red square appears in the middle", None),
        # A phrase followed by a lower-case article names no letter.
        ("The answer is a red square", None),
    ],
)
def test_extract_choice(text, want):
    assert extract_choice(text, OPTS) == want


def test_choice_beyond_options_rejected():
    assert extract_choice("F", OPTS) is None
    assert extract_choice("F", []) == "F"  # no options: any letter
    # The explicit answer names E, one of no options: it does not fall through to "(B)".
    assert extract_choice("Answer: E (B)", OPTS) is None


@pytest.mark.parametrize(
    "text,want",
    [
        # An explicit "the answer is X" wins over earlier mentions, and the last one wins.
        ("option C is wrong, the answer is D", "D"),
        ("Option C looks close but the correct option is D.", "D"),
        ("I first thought the answer is B, but the answer is (C)", "C"),
        # An article (or "I") followed by a word is not a letter, even after a phrase.
        ("The answer is A man walking", None),
        ("Answer: A man walks", None),
        ("A man walks", None),
        ("the answer is A.", "A"),
        ("The answer is (A) a man walks", "A"),
        # Hedging over several parenthesised letters or option mentions names none.
        ("It is (A) or maybe (C)", None),
        ("option B or option D", None),
        ("(A) (B)", None),
        ("B. red square, not (C)", None),  # an option letter elsewhere: hedging
        ("B. red square, not (c)", "B"),  # lower-case: an enumeration, not an option
        ("(B) red square (b)", "B"),
        # Common spellings of the explicit phrase.
        ("The answer is: B", "B"),
        ("Answer is: C", "C"),
        ("The final answer is **D**", "D"),
    ],
)
def test_extract_choice_precedence(text, want):
    assert extract_choice(text, OPTS) == want


def test_options_parsed_from_the_question_when_the_row_has_none():
    q = "Q: what appears?\n(A) blue circle\nB. red square\nC: green triangle\nD) yellow star"
    q += "\nAnswer with the option's letter."
    want = ["A. blue circle", "B. red square", "C. green triangle", "D. yellow star"]
    assert options_from_question(q) == want
    assert options_from_question("Which colour? A. red B. blue") == []  # inline: not parsed
    assert options_from_question("I. Introduction\nText") == []  # a lone lettered line
    bare = Sample("s", "v", q, "B", "mcq")
    assert sample_options(bare) == want and sample_options(MCQ) == OPTS
    # The option text now maps to its letter, and letters beyond D are rejected.
    assert accuracy("<answer>red square</answer>", bare)["acc"] == 1.0
    assert extract_choice("E", sample_options(bare)) is None
    wrong_gt = Sample("s", "v", q, "E", "mcq")  # a row whose answer is not one of its options
    assert accuracy("<answer>E</answer>", wrong_gt)["acc"] == 0.0


def test_mcq_accuracy_article_shortcut():
    a = Sample("s", "v", "q", "A", "mcq", options=OPTS)
    assert accuracy("<answer>A red square appears</answer>", a)["acc"] == 0.0
    assert accuracy("<answer>The answer is (A)</answer>", a)["acc"] == 1.0
    assert accuracy("<answer>B</answer>", MCQ)["acc"] == 1.0
    assert accuracy("<answer>C</answer>", MCQ)["acc"] == 0.0


# ------------------------------------------------------------------------------ open-ended
def test_token_f1_is_multiset_not_set():
    # Sets would give {red} vs {red} -> 1.0.
    assert token_f1("red red red", "red") == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))
    assert token_f1("red square", "a red square.") == 1.0  # articles, punctuation normalised
    assert token_f1("red circle", "red square") == pytest.approx(0.5)
    assert token_f1("", "red") == 0.0


def test_oe_exact_and_partial():
    s = Sample("s", "v", "q", "the red square", "oe")
    r = accuracy("<answer>Red square!</answer>", s)
    assert r["em"] == 1.0 and r["f1"] == 1.0 and r["acc"] == 1.0
    r = accuracy("<answer>red circle</answer>", s)
    assert r["em"] == 0.0 and r["acc"] == pytest.approx(0.5)
    assert accuracy("<answer>red circle</answer>", s, oe_metric="exact")["acc"] == 0.0
    with pytest.raises(ValueError, match="oe_metric"):
        accuracy("<answer>x</answer>", s, oe_metric="bleu")


# -------------------------------------------------------------------------------- temporal
@pytest.mark.parametrize(
    "text,want",
    [
        ("12.5-18", (12.5, 18.0)),
        ("from 12.5 to 18 seconds", (12.5, 18.0)),
        ("[12.5, 18]", (12.5, 18.0)),
        ("12.5s - 18s", (12.5, 18.0)),
        ("18-12", None),
        ("no window", None),
        # Charades-style answers (the lmms-eval prompt's own example) and other phrasings.
        ("The event happens in the 24.3 - 30.4 seconds.", (24.3, 30.4)),
        ("between 3 and 4.5 s", (3.0, 4.5)),
        ("starts at 5 and ends at 9", (5.0, 9.0)),
        ("start time: 5, end time: 9", (5.0, 9.0)),
        ("12.5~18", (12.5, 18.0)),
        # Clock times: MM:SS and HH:MM:SS, fractional seconds.
        ("<time>00:19.7 - 00:25.6</time>", (19.7, 25.6)),
        ("1:05 - 1:20", (65.0, 80.0)),
        ("from 1:02:03 to 1:02:10", (3723.0, 3730.0)),
        ("1:75 - 2:00", None),  # not a clock
        # A number never starts inside another token: "1e400-2" holds no "400-2".
        ("1e400-2", None),
        ("nan-5", None),
        ("5-5", None),
        ("-5 - 10", (-5.0, 10.0)),
        ("在24.3-30.4秒", (24.3, 30.4)),
    ],
)
def test_parse_window(text, want):
    assert parse_window(text) == want


@pytest.mark.parametrize(
    "text",
    [
        "1" * 100_000,
        "1" + " " * 100_000,
        "<answer>" * 12_500,
        "start 1 " * 12_500,
        "option A or " * 9_000,  # each mention opens a list; read once, not once per mention
        "1-2 m " * 16_000,
    ],
)
def test_extraction_linear_on_huge_text(text):
    # The former patterns backtracked quadratically: 25 s on 20 KB of digits.
    t0 = time.perf_counter()
    parse_window(text), extract_answer(text), extract_choice(text, OPTS)
    assert time.perf_counter() - t0 < 1.0


def test_temporal_iou():
    assert temporal_iou((10, 20), (15, 25)) == pytest.approx(5 / 15)
    assert temporal_iou((0, 5), (6, 9)) == 0.0
    # Non-finite bounds score 0, never 1.0 (NaN compares false inside min/max).
    nan, inf = float("nan"), float("inf")
    for gold in [(nan, nan), (nan, 20.0), (10.0, inf), (-inf, inf)]:
        assert temporal_iou((10.0, 20.0), gold) == 0.0 and temporal_iou(gold, (10.0, 20.0)) == 0.0
    s_nan = Sample("s", "v", "when?", "", "tvg", event_start=nan, event_end=nan)
    assert accuracy("<answer>10-20</answer>", s_nan)["acc"] == 0.0
    assert parse_window("0-" + "9" * 400) is None  # 400 digits parse to inf
    s = Sample("s", "v", "when?", "", "tvg", event_start=10.0, event_end=20.0)
    assert accuracy("<answer>from 15 to 25 seconds</answer>", s)["acc"] == pytest.approx(1 / 3)
    s2 = Sample("s", "v", "when?", "10-20", "tvg")
    assert accuracy("<answer>10-20</answer>", s2)["iou"] == 1.0
    bad = Sample("s9", "v", "when?", "soon", "tvg")
    with pytest.raises(ValueError, match="s9.*no ground-truth window"):
        accuracy("<answer>1-2</answer>", bad)


# ---------------------------------------------------------------------------------- format
def test_forced_prefix_counts_as_opened_think():
    gen = "The red square is at 40 s.\n</think>\n<answer>B</answer>"
    ours = format_reward([Turn(gen, prefix=THINK)], lambda_anchor=0.5)
    assert ours["think_closed"] == 1.0 and ours["flow"] == 1.0 and ours["anchor"] == 1.0
    assert ours["fmt"] == pytest.approx(1.0 + 0.5 * 1.0)
    # Scoring only generated text (the reference) never sees the <think>: anchor never fires.
    ref = format_reward([Turn(gen, prefix="")], lambda_anchor=0.5)
    assert ref["anchor"] == 0.0 and ref["fmt"] == 0.0


def test_unclosed_think_penalised():
    r = format_reward([Turn("rambling on and on", prefix=THINK)], lambda_anchor=0.5)
    assert r["unclosed_think"] == 1.0 and r["anchor"] == -1.0 and r["fmt"] == -0.5


def test_repeated_and_empty_tags_earn_nothing():
    rep = "<think>again</think>\n<answer>B</answer>"  # second <think> inside the turn
    assert analyse_turn(THINK + rep) == {
        "opened": True,
        "closed": False,
        "unclosed": False,
        "well_formed": False,
        "answer": False,
    }
    assert not analyse_turn(THINK + "</think>\n<answer>B</answer>")["closed"]  # empty think
    assert not analyse_turn(THINK + "x</think>\n<answer> </answer>")["well_formed"]  # empty
    two = THINK + "x</think>\n<answer>B</answer><answer>C</answer>"
    assert not analyse_turn(two)["well_formed"]
    assert format_reward([Turn(rep, prefix=THINK)], lambda_anchor=0.5)["fmt"] == 0.0


def test_multi_turn_flow_and_tool_blocks():
    t1 = Turn(
        'look\n</think>\n<tool_call>\n{"name": "crop_video"}\n</tool_call>\n'
        "<tool_call>\n{}\n</tool_call><|im_end|>",
        prefix=THINK,
    )
    t2 = Turn("seen\n</think>\n<answer>B</answer><|im_end|>", prefix=THINK)
    r = format_reward([t1, t2], lambda_anchor=0.5)
    assert r["fmt_base"] == 1.0 and r["think_closed"] == 1.0 and r["flow"] == 1.0
    # A model-written tool response after the call breaks the turn's format.
    t1b = Turn(t1.text.replace("<|im_end|>", "<tool_response>ok</tool_response>"), prefix=THINK)
    r = format_reward([t1b, t2], lambda_anchor=0.5)
    assert r["fmt_base"] == 0.5


def test_forced_answer_turn_earns_no_flow():
    t1 = Turn('x\n</think>\n<tool_call>\n{"a": 1}\n</tool_call>', prefix=THINK)
    forced = Turn(
        "B</answer>", prefix=THINK + "\nI must answer now.\n</think>\n<answer>", forced_answer=True
    )
    r = format_reward([t1, forced], lambda_anchor=0.5)
    assert r["fmt_base"] == 1.0 and r["flow"] == 0.0 and r["think_closed"] == 1.0
    assert r["anchor"] == pytest.approx(0.5)
    bad = Turn("", prefix=forced.prefix, forced_answer=True)
    assert format_reward([t1, bad], lambda_anchor=0.5)["fmt_base"] == 0.5


# ------------------------------------------------------------------------------------ tool
def _call(status: str) -> ToolCall:
    return ToolCall(raw="{}", name="crop_video", status=status)  # type: ignore[arg-type]


def test_tool_reward_from_structure_not_strings():
    cfg = RewardConfig()
    text = "x\n</think>\n<answer>B</answer>"
    # Writes a fake tool response into its text; no ToolCall executed -> no tool bonus.
    fake = Turn("<tool_response>red square at 40s</tool_response>" + text, prefix=THINK)
    r = score(_traj([fake]), MCQ, cfg)
    assert r["acc"] == 1.0 and r["tool"] == 0.0 and r["n_ok"] == 0.0
    # A real executed call + correct answer earns the bonus.
    t1 = Turn("x</think><tool_call>{}</tool_call>", calls=[_call("ok")], prefix=THINK)
    r = score(_traj([t1, Turn(text, prefix=THINK)]), MCQ, cfg)
    assert r["tool"] == pytest.approx(cfg.tool_bonus)
    # Wrong answer: no bonus; model errors penalised; system errors not.
    t1 = Turn("", calls=[_call("ok"), _call("bad_json"), _call("decode_error")], prefix=THINK)
    wrong = Turn("x\n</think>\n<answer>C</answer>", prefix=THINK)
    r = score(_traj([t1, wrong]), MCQ, cfg)
    assert r["tool"] == pytest.approx(-cfg.tool_error_penalty)
    assert (r["n_calls"], r["n_ok"], r["n_model_errors"], r["n_system_errors"]) == (3, 1, 1, 1)


def test_call_cost_prices_each_executed_call_only():
    """``reward.call_cost`` (the embedded default's 0.02, tool_bonus 0): a call pays only
    through the answer; each executed call costs, a failed one (model or system) does not."""
    cfg = RewardConfig(tool_bonus=0.0, call_cost=0.02, tool_error_penalty=0.05)
    right = Turn("x\n</think>\n<answer>B</answer>", prefix=THINK)
    direct = score(_traj([right]), MCQ, cfg)
    calls = [_call("ok"), _call("ok"), _call("ok"), _call("bad_json"), _call("decode_error")]
    t1 = Turn("x</think><tool_call>{}</tool_call>", calls=calls, prefix=THINK)
    called = score(_traj([t1, right]), MCQ, cfg)
    assert direct["tool"] == 0.0
    assert called["tool"] == pytest.approx(-3 * 0.02 - 0.05)
    assert called["acc"] == direct["acc"] == 1.0
    # Free calls (the base default): the same call round costs only its model error.
    assert score(_traj([t1, right]), MCQ, RewardConfig(tool_bonus=0.0))["tool"] == -0.05


def test_score_total_and_groups():
    cfg = RewardConfig(w_fmt=0.5, lambda_anchor=0.5)
    good = _traj([Turn("x\n</think>\n<answer>B</answer>", prefix=THINK)], uid="m0")
    bad = _traj([Turn("no idea", prefix=THINK)], uid="m1")
    sub = _traj([], role="sub", uid="m0/s0", parent="m0")
    g = Group(MCQ, 0, 8, [good, bad], [sub])
    score_groups([g], cfg)
    assert good.reward == pytest.approx(1.0 + 0.5 * (1.0 + 0.5 * 1.0))
    assert bad.reward == pytest.approx(0.0 + 0.5 * (0.0 + 0.5 * -1.0))
    assert sub.reward == good.reward and sub.reward_breakdown == good.reward_breakdown
    assert good.reward_breakdown["total"] == good.reward
    orphan = _traj([], role="sub", uid="x/s0", parent="nope")
    with pytest.raises(ValueError, match="x/s0.*nope"):
        score_groups([Group(MCQ, 0, 8, [good], [orphan])], cfg)
    with pytest.raises(ValueError, match="sub agent"):
        score(sub, MCQ, cfg)


@pytest.mark.parametrize(
    "text, fn",
    [
        ("start" + " " * 5000 + "!", "window"),
        ("start time" + " " * 5000 + "!", "window"),
        ("<answer>The event starts" + "\n" * 5000 + "at 3</answer>", "window"),
        ("answer" + " " * 5000 + "!", "choice"),
        ("The answer is" + " " * 5000 + "!", "choice"),
        ("correct option is" + " " * 5000 + "!", "choice"),
        ("option" + " " * 5000 + "!", "choice"),
    ],
)
def test_blank_runs_cost_linear_time(text, fn):
    """Runs of blanks are cheap tokens for a degenerate policy; the patterns must not
    backtrack over them (cubic before: 22 s on 1,000 spaces after "start")."""
    t0 = time.perf_counter()
    (parse_window if fn == "window" else extract_choice)(text)
    assert time.perf_counter() - t0 < 0.5


@pytest.mark.parametrize(
    "answer, letter",
    [
        ("B. The person(s) leave the room", "B"),
        ("C. Both (a) and (b)", "C"),
        ("A. Step (i) first", "A"),
        ("B) blue (see frame (c))", "B"),
        ("A. (a) and (c) only", "A"),
        ("(A) (B)", None),
        ("B. red (C) blue", None),
    ],
)
def test_opening_letter_hedging_counts_only_option_letters(answer, letter):
    assert extract_choice(answer, ["A. x", "B. y", "C. z", "D. w"]) == letter


@pytest.mark.parametrize(
    "text, window",
    [
        ("Answer:12.5-18", (12.5, 18.0)),
        ("time:12.5-18.0", (12.5, 18.0)),
        ("24.3-30.4 (between frames 3 and 5)", (24.3, 30.4)),  # the earliest form decides
        ("between 3 and 5, not 24.3-30.4", (3.0, 5.0)),
        ("12:05-12:30", (725.0, 750.0)),
    ],
)
def test_parse_window_more_forms(text, window):
    assert parse_window(text) == window


# Issue 27 item 5: every letter reads alike, and a hedge or a list of options is no answer.
OPTS5 = [f"{c}. option {c.lower()}" for c in "ABCDE"]


def _other(letter: str) -> str:
    return "ABCDE"[("ABCDE".index(letter) + 2) % 5]


@pytest.mark.parametrize("letter", list("ABCDE"))
@pytest.mark.parametrize(
    "phrase, names",
    [
        # A letter before a word that cannot follow the article "A" is the letter.
        ("Option {L} is correct", True),
        ("Answer: {L} since it is the red one", True),
        ("The answer is {L} because the frames show it", True),
        ("option {L} looks right", True),
        # A letter before any other word is read as the word, for "A" and every other letter.
        ("Answer: {L} man walks", False),
        ("The answer is {L} man walking", False),
        # Hedges and lists name no option, whichever letter comes first.
        ("option {L} or option {M}", False),
        ("({L}) or option {M}", False),
        ("{L} or {M}", False),
        ("The answer is {L} or {M}", False),
        ("Answer: ({L}) or ({M})", False),
        ("the answer is {L}, {M}", False),
        ("option {L} or {M}", False),
        ("{L}. {M}.", False),
        ("({L}) red, ({M}) blue", False),
    ],
)
def test_every_letter_reads_alike(letter, phrase, names):
    text = phrase.format(L=letter, M=_other(letter))
    assert extract_choice(text, OPTS5) == (letter if names else None), text


def test_a_list_of_all_options_names_none():
    assert extract_choice("A. B. C. D.", OPTS) is None
    assert extract_choice("A. B. C. D. E.", OPTS5) is None
    # A letter elsewhere that is not an option is no hedge ("D" of three); one listed right
    # after the answer is ("B or D").
    assert extract_choice("(B) red, not option D", OPTS[:3]) == "B"
    assert extract_choice("(B) or option D", OPTS[:3]) is None


# Issue 27 item 6: a window in another unit, or written with an exponent, is no window.
@pytest.mark.parametrize(
    "text, window",
    [
        ("12.5-16.5 minutes", None),
        ("12.5-16.5 ms", None),
        ("12.5-16.5e3", None),
        ("12.5-16.5E+3", None),
        ("12.5e1-16.5", None),
        ("12.5 - 16.5 min", None),
        ("12.5m-16.5m", None),
        ("12.5-16.5 hours", None),
        ("12.5-16.5 frames", None),
        ("12.5-16.5%", None),
        ("12.5-16.5分钟", None),
        ("from 12.5 to 16.5 minutes", None),
        ("starts at 5 minutes and ends at 9 minutes", None),
        ("00:12 - 00:16 min", None),
        # Seconds, spelled every way the benchmarks' prompts and answers do.
        ("12.5 - 16.5 seconds", (12.5, 16.5)),
        ("from 12.5s to 16.5s", (12.5, 16.5)),
        ("12.5-16.5 sec.", (12.5, 16.5)),
        ("12.5-16.5secs", (12.5, 16.5)),
        ("The event happens in the 12.5 - 16.5 seconds.", (12.5, 16.5)),
        ("The event happens in the 12.5 - 16.5 seonds.", (12.5, 16.5)),  # lmms-eval's typo
        ("<time>00:12.5 - 00:16.5</time>", (12.5, 16.5)),
        ("12.5-16.5 in the video", (12.5, 16.5)),
        ("12.5-16.5秒", (12.5, 16.5)),
        # A window in minutes is skipped, its restatement in seconds read.
        ("12.5-16.5 minutes, i.e. 750-990 seconds", (750.0, 990.0)),
    ],
)
def test_parse_window_reads_seconds_only(text, window):
    assert parse_window(text) == window


def test_window_in_other_units_scores_zero():
    s = Sample("s", "v", "when?", "", "tvg", event_start=12.5, event_end=16.5)
    for answer in ("12.5-16.5 minutes", "12.5-16.5 ms", "12.5-16.5e3"):
        r = accuracy(f"<answer>{answer}</answer>", s)
        assert (r["acc"], r["iou"], r["has_answer"]) == (0.0, 0.0, 1.0), answer
    assert accuracy("<answer>12.5-16.5 seconds</answer>", s)["acc"] == 1.0
