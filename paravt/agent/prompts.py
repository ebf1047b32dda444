"""Prompt texts and the tool schema, in the Qwen/Hermes chat layout.

Everything the model reads that is not a video frame comes from this file, so SFT, RL and eval
share one wording. The chat layout (``<|im_start|>role\\n…<|im_end|>\\n``) is written out here
rather than produced by a chat template, because the agent appends token segments to a live
context and must never re-template history (see ``paravt.agent.context``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from paravt.types import Sample, ToolCall

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# The markup around each tool response's content (``paravt.agent.context.add_tool_turn``).
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>\n", "\n</tool_response>"

# JSON Schema of the built-in crop_video tool (paravt.agent.crop; validated against the JSON
# Schema meta-schema in tests).
CROP_VIDEO_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "crop_video",
        "description": (
            "Look closely at a time window of the current video. A helper watches the window at "
            "a higher frame rate and returns a short description of what happens in it. "
            "Several calls in one turn run in parallel."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "start_time": {
                    "type": "number",
                    "description": "Window start in seconds from the beginning of the video.",
                },
                "end_time": {
                    "type": "number",
                    "description": "Window end in seconds; must be greater than start_time.",
                },
            },
            "required": ["start_time", "end_time"],
            "additionalProperties": False,
        },
    },
}


def system_prompt(max_parallel: int, schemas: list[dict[str, Any]] | None = None) -> str:
    """Main-agent system prompt: role, the Hermes ``<tools>`` block (one JSON schema a line:
    ``schemas``, the run's tools in ``agent.tools`` order; default ``crop_video`` alone), the
    answer format."""
    tools = "\n".join(json.dumps(s) for s in (schemas or [CROP_VIDEO_SCHEMA]))
    return (
        "You are a careful video analyst. You see a few overview frames of a long video, each "
        "with its timestamp, and answer a question about it.\n\n"
        "# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        "<tools>\n"
        f"{tools}\n"
        "</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        "<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call>\n\n"
        f"You may make up to {max_parallel} calls in one turn; they run in parallel. Think inside "
        "<think></think> first. When you know the answer, reply with <answer>…</answer> only."
    )


def question_text(sample: Sample, duration: float) -> str:
    """The user's text after the overview frames: duration, subtitles (when the sample has
    them: ``Sample.extra['subtitles']``, e.g. Video-MME with subtitles), question, options,
    answer form."""
    parts = [f"The video is {duration:.1f} seconds long."]
    subtitles = str(sample.extra.get("subtitles") or "").strip()
    if subtitles:
        parts.append(f"The video's subtitles are listed below:\n{subtitles}")
    parts.append(f"Question: {sample.question}")
    q = sample.question
    if sample.question_type == "mcq" and sample.options:
        lettered = [
            o if re.match(r"^\(?[A-Z][.):]", o) else f"{chr(65 + i)}. {o}"
            for i, o in enumerate(sample.options)
        ]
        # Datasets often already list the options in the question; never print them twice.
        if not all(o in q for o in lettered):
            parts.append("Options:\n" + "\n".join(lettered))
    if "answer" not in q.lower():
        parts.append(_ANSWER_FORM.get(sample.question_type, _ANSWER_FORM["oe"]))
    return "\n".join(parts)


_ANSWER_FORM = {
    "mcq": "Answer with the option's letter.",
    "oe": "Answer with a short phrase.",
    "tvg": "Answer with the time window in seconds, as start-end.",
}


def sub_system_prompt() -> str:
    return (
        "You are a video clip describer. You see frames of a short clip of a longer video, each "
        "with its timestamp. Describe concisely what happens in the clip and when."
    )


def sub_user_text(start: float, end: float, question: str | None) -> str:
    """The sub-agent's instruction after the crop frames (question optional by config)."""
    s = f"The clip covers {start:.1f}-{end:.1f} s of the video. Describe what happens in it."
    if question:
        s += f" It will help answer: {question}"
    return s


def tool_turn_texts(
    calls: list[ToolCall], max_parallel: int, label: Callable[[ToolCall], str] | None = None
) -> list[str]:
    """The contents of one tool turn, in order: one per call the turn is allowed
    (``agent.max_parallel``: a summary or that call's error), then ONE shared error for all the
    calls past the limit, however many (the parser marks them ``over_parallel_limit``).

    One response per over-limit call let a turn of 74 minimal calls append ~2,000 tokens; with
    the shared error a tool turn holds at most ``max_parallel + 1`` responses, which
    ``paravt.agent.context.tool_turn_max_tokens`` bounds. ``label``: the text before a valid
    call's summary (``paravt.agent.tools.ToolBox.label``; default the crop window)."""
    shown = [c for c in calls if c.status != "over_parallel_limit"]
    out = [tool_response_text(c, label) for c in shown]
    over = len(calls) - len(shown)
    if over:
        out.append(over_limit_text(over, len(shown), max_parallel))
    return out


def over_limit_text(n_over: int, n_before: int, max_parallel: int) -> str:
    """The one error the main agent reads for the ``n_over`` calls that follow the turn's
    first ``n_before`` calls and are past the per-turn limit ``max_parallel``."""
    first, last = n_before + 1, n_before + n_over
    which = f"call {first} was" if n_over == 1 else f"calls {first}-{last} were"
    return (
        f"Error: {which} not run: at most {max_parallel} tool calls run per turn. "
        f"Make at most {max_parallel} calls in one turn."
    )


def tool_response_text(call: ToolCall, label: Callable[[ToolCall], str] | None = None) -> str:
    """What the main agent reads for one call: its tool's ``label`` and the summary, or the
    error it made. ``label`` defaults to ``crop_video``'s window, ``[start-end s]``.

    Plain text (it quotes the model): ``paravt.agent.context.add_tool_turn`` tokenises it
    with no special-token parsing and wraps it in the ``<tool_response>`` markup."""
    if call.status == "ok":
        if label is not None:
            head = label(call)  # ToolBox.label: a label that fails marks the call failed
            if call.status == "ok":
                return f"{head} {call.response}"
            return f"Error: {call.error}"
        assert call.start is not None and call.end is not None
        return f"[{call.start:.1f}-{call.end:.1f} s] {call.response}"
    return f"Error: {call.error}"
