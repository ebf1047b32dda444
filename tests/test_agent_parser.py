"""Tool-call parser, tool schema and prompt texts."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from paravt.agent import parse_call, parse_tool_calls
from paravt.agent.prompts import (
    CROP_VIDEO_SCHEMA,
    question_text,
    system_prompt,
    tool_response_text,
)
from paravt.types import Sample, ToolCall


def _block(obj) -> str:
    body = obj if isinstance(obj, str) else json.dumps(obj)
    return f"<tool_call>\n{body}\n</tool_call>"


def _crop(s, e) -> dict:
    return {"name": "crop_video", "arguments": {"start_time": s, "end_time": e}}


@pytest.mark.parametrize(
    "body,status,err",
    [
        (_crop(10, 20), "ok", ""),
        (_crop(10.5, 20), "ok", ""),
        ('{"name": "crop_video", "arguments": {"start_time": 1, ', "bad_json", "not valid JSON"),
        ("[1, 2]", "bad_json", "JSON object"),
        ({"name": "zoom_in", "arguments": {}}, "unknown_tool", "unknown tool 'zoom_in'"),
        ({"name": "crop_video"}, "bad_arguments", "'arguments' object"),
        ({"name": "crop_video", "arguments": {"start_time": 1}}, "bad_arguments", "end_time"),
        (_crop("1", 5), "bad_arguments", "start_time='1' must be a number"),
        (_crop(True, 5), "bad_arguments", "must be a number"),
        (
            {
                "name": "crop_video",
                "arguments": {"start_time": 1, "end_time": 5, "video": "/etc/x"},
            },
            "bad_arguments",
            "unknown argument(s) video",
        ),
        (_crop(20, 10), "bad_range", "start_time 20 s must be smaller than end_time 10 s"),
        (_crop(5, 5), "bad_range", "smaller"),
        (_crop(130, 150), "outside_video", "outside the video, which lasts 120.0 s"),
        (_crop(-20, -5), "outside_video", "outside"),
        # Empty once clamped: touches the video only at its first / last instant.
        (_crop(-20, 0), "bad_range", "empty inside the video [0, 120.0] s"),
        (_crop(120, 150), "bad_range", "empty inside the video"),
        # The reference's call format (ParaVT SFT data) names the video: accepted, ignored.
        (
            {
                "name": "crop_video",
                "arguments": {"video_path": "/etc/passwd", "start_time": 1, "end_time": 5},
            },
            "ok",
            "",
        ),
        # Hostile numbers and JSON never raise.
        (
            '{"name": "crop_video", "arguments": {"start_time": 1, "end_time": '
            + "9" * 5000
            + "}}",
            "bad_json",
            "not usable JSON",
        ),
        (
            '{"name": "crop_video", "arguments": {"start_time": 1, "end_time": 1'
            + "0" * 400
            + "}}",
            "bad_arguments",
            "must be a number",
        ),
        (
            '{"name": "crop_video", "arguments": {"start_time": 1, "end_time": 1e999}}',
            "bad_arguments",
            "must be a number",
        ),
        ("[" * 100_000 + "]" * 100_000, "bad_json", "JSON"),
        ({"name": "x" * 10_000, "arguments": {}}, "unknown_tool", "…"),
    ],
)
def test_parse_call_statuses(body, status, err):
    raw = body if isinstance(body, str) else json.dumps(body)
    c = parse_call(raw, duration=120.0)
    assert c.status == status
    assert err in c.error
    if status == "ok":
        assert c.start == c.arguments["start_time"] and c.end == c.arguments["end_time"]
    assert len(c.error) < 200  # errors quote the model's strings shortened


def test_tool_call_mentioned_in_thinking_does_not_swallow_the_next_call():
    text = (
        "<think>I could use <tool_call> here, or <tool_call> twice.</think>\n"
        + _block(_crop(1, 2))
        + "\n"
        + _block(_crop(3, 4))
    )
    calls = parse_tool_calls(text, duration=60, max_parallel=5)
    assert [(c.status, c.start, c.end) for c in calls] == [("ok", 1.0, 2.0), ("ok", 3.0, 4.0)]
    # Nor the unclosed final call (when those are accepted), nor an answer turn.
    unclosed = "<think>I will use a <tool_call> block.</think> <tool_call>" + json.dumps(
        _crop(1, 5)
    )
    calls = parse_tool_calls(unclosed, duration=60, max_parallel=5, allow_unclosed_final=True)
    assert [(c.status, c.end) for c in calls] == [("ok", 5.0)]
    answer = "<think>I could emit <tool_call> but no.</think><answer>B</answer>"
    assert parse_tool_calls(answer, duration=60, max_parallel=5) == []


def test_clamping_and_double_encoded_arguments():
    c = parse_call(json.dumps(_crop(-5, 300)), duration=120.0)
    assert c.status == "ok" and (c.start, c.end) == (0.0, 120.0)
    s = json.dumps(
        {"name": "crop_video", "arguments": json.dumps({"start_time": 1, "end_time": 2})}
    )
    assert parse_call(s, duration=10.0).status == "ok"


def test_each_call_judged_alone_and_parallel_cap():
    text = (
        "<think>x</think>"
        + _block(_crop(1, 2))
        + _block("{oops")
        + _block(_crop(3, 4))
        + _block(_crop(5, 6))
    )
    calls = parse_tool_calls(text, duration=60, max_parallel=3)
    assert [c.status for c in calls] == ["ok", "bad_json", "ok", "over_parallel_limit"]
    assert "at most 3 tool calls" in calls[3].error and "call 4" in calls[3].error
    assert parse_tool_calls("no calls here </tool_call>", duration=60, max_parallel=3) == []


def test_unclosed_final_call():
    text = (
        _block(_crop(1, 2))
        + '\n<tool_call>\n{"name": "crop_video", "arguments": {"start_time": 3, "end_time": 9}}<|im_end|>'
    )
    strict = parse_tool_calls(text, duration=60, max_parallel=5)
    assert [c.status for c in strict] == ["ok", "unclosed"]
    lenient = parse_tool_calls(text, duration=60, max_parallel=5, allow_unclosed_final=True)
    assert [c.status for c in lenient] == ["ok", "ok"] and lenient[1].end == 9.0
    # A truncated unclosed call still fails on its own JSON.
    cut = parse_tool_calls(
        '<tool_call>{"name": "crop', duration=60, max_parallel=5, allow_unclosed_final=True
    )
    assert [c.status for c in cut] == ["bad_json"]


def test_tool_schema_is_valid_json_schema_and_in_system_prompt():
    params = CROP_VIDEO_SCHEMA["function"]["parameters"]
    jsonschema.Draft202012Validator.check_schema(params)
    v = jsonschema.Draft202012Validator(params)
    assert v.is_valid({"start_time": 1.5, "end_time": 4})
    assert not v.is_valid({"start_time": 1.5})
    assert not v.is_valid({"start_time": "1", "end_time": 4})
    assert not v.is_valid({"start_time": 1, "end_time": 4, "video": "x.mp4"})
    sp = system_prompt(5)
    block = re.search(r"<tools>\n(.*)\n</tools>", sp, re.DOTALL).group(1)
    assert json.loads(block) == CROP_VIDEO_SCHEMA
    assert "up to 5 calls" in sp


def test_question_text_options_once():
    s = Sample("s", "v", "Which shape?", "B", "mcq", options=["red circle", "blue square"])
    q = question_text(s, 61.0)
    assert "61.0 seconds" in q and "A. red circle\nB. blue square" in q and "letter" in q
    listed = Sample(
        "s",
        "v",
        "Which?\nA. red circle\nB. blue square\nAnswer with the letter.",
        "B",
        "mcq",
        options=["red circle", "blue square"],
    )
    q2 = question_text(listed, 61.0)
    assert q2.count("red circle") == 1 and q2.count("Answer") == 1
    # Video-MME's options arrive lettered: never "A. A. Apples."
    vm = Sample("s", "v", "Which?", "C", "mcq", options=["A. Apples.", "B. Candles."])
    assert "Options:\nA. Apples.\nB. Candles." in question_text(vm, 9.0)


def test_question_text_subtitles_before_the_question():
    s = Sample("s", "v", "Who speaks?", "A", "mcq", options=["x", "y"])
    assert "subtitles" not in question_text(s, 5.0)
    s.extra["subtitles"] = "hello there\n<not a tag for us>"
    q = question_text(s, 5.0)
    assert q.index("subtitles are listed below:\nhello there\n<not a tag") < q.index("Question:")


def test_tool_response_text_summary_or_error():
    ok = ToolCall("{}", "crop_video", status="ok", start=1.0, end=4.5, response="A dog runs.")
    bad = ToolCall("{", status="bad_json", error="the tool call is not valid JSON (x)")
    assert tool_response_text(ok) == "[1.0-4.5 s] A dog runs."
    assert tool_response_text(bad) == "Error: the tool call is not valid JSON (x)"


@pytest.mark.parametrize(
    "body, status",
    [
        # A marker inside the call is part of what the model wrote: the call is wrong.
        (
            '{"name": "crop<|im_end|>_video", "arguments": {"start_time": 1, "end_time": 5}}',
            "unknown_tool",
        ),
        (
            '{"name": "crop_video", "arguments": {"start_time": 1, "end_time": 1<|endoftext|>0}}',
            "bad_json",
        ),
        (
            '{"name": "crop_video", "arguments": {"start_time": 1<|im_end|>, "end_time": 5}}',
            "bad_json",
        ),
        # Only a marker that ends the call is generation's stop token, and is dropped.
        ('{"name": "crop_video", "arguments": {"start_time": 1, "end_time": 5}}<|im_end|>', "ok"),
        (
            '{"name": "crop_video", "arguments": {"start_time": 1, "end_time": 5}}<|im_end|>\n'
            "<|endoftext|>",
            "ok",
        ),
    ],
)
@pytest.mark.parametrize("closed", [True, False])
def test_end_markers_stripped_only_at_the_end(body, status, closed):
    text = f"<tool_call>\n{body}" + ("\n</tool_call>" if closed else "")
    calls = parse_tool_calls(text, duration=60, max_parallel=5, allow_unclosed_final=True)
    assert [c.status for c in calls] == [status]
    if status == "ok":
        assert (calls[0].start, calls[0].end) == (1.0, 5.0)
