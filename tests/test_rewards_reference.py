"""Issue 38 item 2: the ParaVT reference's vanilla reward parts (``paravt.rewards.reference``),
under ``reward.base_format`` / ``answer_extraction`` / ``tool_mode`` = ``reference``.

The expected values are the reference code's own on these strings (EvolvingLMMs-Lab/ParaVT
cf55249, ``paravt/rl/rewards/format.py`` ``compute_format_reward`` with ANSWER_SUFFIX and
ANCHOR_WEIGHT off, ``utils.py`` ``extract_answer`` (``""`` written as None here: both score 0),
``tool.py`` ``compute_tool_reward``), computed by running those functions; paravt's reading
matched them on these and on 20,000 random tag soups."""

from __future__ import annotations

import pytest

from paravt.config import ConfigError, RewardConfig, load_config
from paravt.rewards import reference, score
from paravt.types import Sample, ToolCall, Trajectory, Turn

CALL = (
    '<tool_call>\n{"name": "crop_video", "arguments": {"start_time": 0.0, "end_time": 10.0}}'
    "\n</tool_call>"
)
OPEN_ANSWER = "<think>\nThe overview shows a red square.\n<answer>red</answer>"
CLOSED_ANSWER = "<think>\nThe overview shows a red square.\n</think>\n<answer>red</answer>"
OPEN_CALL = "<think>\nI will check the whole video.\n" + CALL


@pytest.mark.parametrize(
    "text,fmt,answer,tool_right,tool_wrong",
    [
        # an unclosed <think>: its think credit (0.3) and the answer's (0.2 + 0.1), no balance
        (OPEN_ANSWER, 0.6, "red", 0.0, 0.0),
        (CLOSED_ANSWER, 0.7, "red", 0.0, 0.0),  # + 0.1: every tag pair balanced
        # an unclosed <think> before a call: think (0.3) + think-before-tool (0.3); the answer
        # falls back to the last line that is no tool tag
        (OPEN_CALL, 0.6, "</tool_call>", 0.6, 0.1),
        ("<think>short</think><answer></answer>", 0.0, None, 0.0, 0.0),  # < 10 chars, empty
        ("red", 0.0, "red", 0.0, 0.0),  # no tags: the last line is the answer
        # after </think>: the tail without chat markers
        ("<think>\nhmm, the square is blue\n</think>\nblue<|im_end|>", 0.4, "blue", 0.0, 0.0),
        ("I think it is\ngreen\n<tool_call>x", 0.0, "green", 0.0, 0.0),
        ("<answer>A</answer><answer>B</answer>", 0.4, "A", 0.0, 0.0),  # the first block
        # a model-written <tool_response> pays 0.3 instead of 0.1; complete tool blocks are cut
        # from the fallback's tail
        (
            '<think>\nlong enough thought\n</think>\n<tool_call>{"name":"x"}</tool_call>'
            "<tool_response>r</tool_response>\nyellow",
            0.7,
            "yellow",
            0.8,
            0.3,
        ),
        ('<tool_call>\n{"name": "crop_video"}', 0.0, '{"name": "crop_video"}', 0.6, 0.1),
        ("<tool_code>\n# comment\ncrop(1, 2)\n</tool_code>", 0.0, "</tool_code>", 0.6, 0.1),
    ],
)
def test_reference_parts_match_the_reference_code(text, fmt, answer, tool_right, tool_wrong):
    assert reference.base_format(text) == pytest.approx(fmt)
    assert reference.extract_answer(text) == answer
    assert reference.tool_reward(text, 1.0) == pytest.approx(tool_right)
    assert reference.tool_reward(text, 0.0) == pytest.approx(tool_wrong)


SPOT = Sample("s1", "v.mp4", "What colour is the square?", "red", "oe")


def _traj(*turns: Turn) -> Trajectory:
    return Trajectory("m0", "main", "s1", 0, [1, 2], [0, 1], [0.0, -0.5], 1, turns=list(turns))


def test_an_unclosed_think_is_accepted_by_reference_and_refused_by_strict() -> None:
    strict = RewardConfig(lambda_anchor=0.0)
    ref = RewardConfig(lambda_anchor=0.0, base_format="reference")
    # vanilla_ref: no pinned <think>, the model writes it (and never closes it)
    unclosed = _traj(Turn(text=OPEN_ANSWER))
    s, r = score(unclosed, SPOT, strict), score(unclosed, SPOT, ref)
    assert s["fmt_base"] == 0.0 and s["unclosed_think"] == 1.0
    assert r["fmt_base"] == pytest.approx(0.6) and r["fmt"] == pytest.approx(0.6)
    assert s["acc"] == r["acc"] == 1.0  # both read the answer block
    closed = _traj(Turn(text=CLOSED_ANSWER))
    assert score(closed, SPOT, strict)["fmt_base"] == 1.0
    assert score(closed, SPOT, ref)["fmt_base"] == pytest.approx(0.7)
    # A pinned prefix is the prompt's for the reference: not scored (no think credit: the
    # answer's 0.3 and the balance bonus, all tag counts being equal).
    pinned = _traj(Turn(text="The overview shows a red square.\n<answer>red</answer>",
                        prefix="<think>\n"))  # fmt: skip
    assert score(pinned, SPOT, ref)["fmt_base"] == pytest.approx(0.4)


def test_reference_answers_and_tool_reward_through_score() -> None:
    ok = ToolCall(raw="{}", name="crop_video", status="ok", start=0.0, end=10.0)
    no_block = _traj(Turn(text="<think>\nthe square looks red to me\n</think>\nred"))
    strict = RewardConfig(lambda_anchor=0.0)
    ref = RewardConfig(lambda_anchor=0.0, answer_extraction="reference", tool_mode="reference")
    assert score(no_block, SPOT, strict)["acc"] == 0.0  # no answer block: no answer
    assert score(no_block, SPOT, ref)["acc"] == 1.0  # the text after </think>
    # R_tool from the text: a parseable call pays 0.1 + 0.5 with a right answer, executed or
    # not; paravt's structural R_tool pays tool_bonus only for an executed crop.
    called = _traj(
        Turn(text="<think>\nI will check the whole video.\n</think>\n" + CALL, calls=[ok]),
        Turn(text="\nI must answer now.\n</think>\n<answer>red</answer>".split("<answer>")[1],
             prefix="\nI must answer now.\n</think>\n<answer>", forced_answer=True),
    )  # fmt: skip
    r = score(called, SPOT, ref)
    assert r["acc"] == 1.0 and r["tool"] == pytest.approx(0.6) and r["n_ok"] == 1.0
    assert score(called, SPOT, strict)["tool"] == pytest.approx(strict.tool_bonus)
    unexecuted = _traj(Turn(text="<think>\nI will check the whole video.\n</think>\n" + CALL))
    assert score(unexecuted, SPOT, ref)["tool"] == pytest.approx(0.1)  # no answer, no call ran
    assert score(unexecuted, SPOT, strict)["tool"] == 0.0
    with pytest.raises(ConfigError, match="reward.base_format='loose' is not one of strict"):
        load_config("tiny_cpu", overrides=["reward.base_format=loose"])
