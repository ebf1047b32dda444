"""Tool-call parser: one turn's generated text -> ``ToolCall`` records, each judged on its own.

A turn may hold several ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` blocks. Every
block is parsed and validated independently, so one malformed call never discards the good
calls beside it (the reference dropped the whole turn). Statuses (``paravt.types.ToolCall``):

``bad_json``            the block is not a JSON object with a string ``name``
``unknown_tool``        ``name`` is not ``crop_video``
``bad_arguments``       ``arguments`` missing / not an object / a key missing, unknown or not a
                        finite number. The reference's ``video_path`` argument (ParaVT's SFT
                        data writes it) is accepted and ignored: the video is always the
                        sample's own, a model-written path is never opened
``bad_range``           ``start_time >= end_time``, or a window that is empty once clamped to
                        ``[0, duration]`` (it only touches the video's first or last instant)
``outside_video``       the window lies entirely outside ``[0, duration]``
``over_parallel_limit`` the block is beyond the first ``max_parallel`` blocks of the turn
``unclosed``            a final ``<tool_call>`` without ``</tool_call>`` (accepted and parsed
                        instead when ``allow_unclosed_final_call``)

Valid calls are clamped to ``[0, duration]`` (``ToolCall.start/end``); partly-outside windows
are cropped to their inside part rather than rejected.

A block runs from a ``<tool_call>`` to the next ``</tool_call>`` with no other ``<tool_call>``
in between: a tag the model merely mentions earlier (e.g. inside its thinking) does not swallow
the valid call after it. Likewise only the LAST unmatched ``<tool_call>`` can be an unclosed
call, and not when a ``</think>`` or ``<answer>`` follows it (then it was a mention).
"""

from __future__ import annotations

import json
import math
import re

from paravt.types import ToolCall

TOOL_NAME = "crop_video"
ARG_NAMES = ("start_time", "end_time")
# Accepted and ignored (the reference's call format); never used to open a file.
IGNORED_ARGS = ("video_path",)
_BLOCK_RE = re.compile(r"<tool_call>((?:(?!<tool_call>).)*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"
_MENTION_ENDS = ("</think>", "<answer>")


def _quote(v: object, limit: int = 60) -> str:
    """A model-written value for an error message, shortened (the message is plain text)."""
    r = v if isinstance(v, str) else repr(v)
    return r if len(r) <= limit else r[:limit] + "…"


def _number(v: object) -> float | None:
    # bool is an int subclass in Python; JSON true is not a time.
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:  # an integer literal beyond float range
        return None
    return f if math.isfinite(f) else None


def parse_call(raw: str, *, duration: float) -> ToolCall:
    """Parse and validate one block's content (the text between the tags)."""
    call = ToolCall(raw=raw)
    try:
        obj = json.loads(raw.strip())
    except json.JSONDecodeError as e:
        call.status, call.error = "bad_json", f"the tool call is not valid JSON ({e.msg})"
        return call
    except (ValueError, RecursionError) as e:  # >4300-digit integers, absurd nesting
        call.status = "bad_json"
        call.error = f"the tool call is not usable JSON ({type(e).__name__})"
        return call
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        call.status = "bad_json"
        call.error = 'the tool call must be a JSON object {"name": ..., "arguments": {...}}'
        return call
    call.name = obj["name"]
    if call.name != TOOL_NAME:
        call.status = "unknown_tool"
        call.error = f"unknown tool '{_quote(call.name)}'; the only tool is {TOOL_NAME}"
        return call
    args = obj.get("arguments")
    if isinstance(args, str):  # some chat formats double-encode arguments
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            pass
    if not isinstance(args, dict):
        call.status = "bad_arguments"
        call.error = f"{TOOL_NAME} needs an 'arguments' object with start_time and end_time"
        return call
    call.arguments = args
    extra = sorted(set(args) - set(ARG_NAMES) - set(IGNORED_ARGS))
    if extra:
        call.status = "bad_arguments"
        call.error = (
            f"unknown argument(s) {_quote(', '.join(extra))}; {TOOL_NAME} takes only start_time and "
            "end_time (the video is always the current one)"
        )
        return call
    vals = {}
    for k in ARG_NAMES:
        if k not in args:
            call.status, call.error = "bad_arguments", f"missing argument {k} (seconds)"
            return call
        v = _number(args[k])
        if v is None:
            call.status = "bad_arguments"
            call.error = f"argument {k}={_quote(repr(args[k]))} must be a number of seconds"
            return call
        vals[k] = v
    s, e = vals["start_time"], vals["end_time"]
    if s >= e:
        call.status = "bad_range"
        call.error = f"start_time {s:g} s must be smaller than end_time {e:g} s"
        return call
    if e < 0 or s > duration:
        call.status = "outside_video"
        call.error = f"window [{s:g}, {e:g}] s is outside the video, which lasts {duration:.1f} s"
        return call
    cs, ce = max(s, 0.0), min(e, duration)
    if ce <= cs:
        call.status = "bad_range"
        call.error = (
            f"window [{s:g}, {e:g}] s is empty inside the video [0, {duration:.1f}] s; give a "
            "window that overlaps it"
        )
        return call
    call.start, call.end = cs, ce
    return call


def parse_tool_calls(
    text: str,
    *,
    duration: float,
    max_parallel: int,
    allow_unclosed_final: bool = False,
) -> list[ToolCall]:
    """All tool calls of one generated turn, in order, each with its status.

    Blocks past the first ``max_parallel`` are not executed (``over_parallel_limit``) but are
    still reported, so the model sees why and the metric counts them.
    """
    blocks: list[str] = []
    pos = 0
    for m in _BLOCK_RE.finditer(text):
        blocks.append(m.group(1))
        pos = m.end()
    tail = text[pos:]
    unclosed_raw: str | None = None
    if _OPEN in tail:
        # The last opening tag is the candidate call; one followed by a closed thought or an
        # answer was only mentioned (e.g. "<think>I could use <tool_call>…</think><answer>").
        rest = tail[tail.rindex(_OPEN) + len(_OPEN) :]
        if not any(m in rest for m in _MENTION_ENDS):
            unclosed_raw = rest
    calls: list[ToolCall] = []
    items = [(b, False) for b in blocks]
    if unclosed_raw is not None:
        items.append((unclosed_raw, True))
    for i, (raw, is_unclosed) in enumerate(items):
        if i >= max_parallel:
            calls.append(
                ToolCall(
                    raw=raw,
                    status="over_parallel_limit",
                    error=f"at most {max_parallel} tool calls run per turn; this was call {i + 1}",
                )
            )
        elif is_unclosed and not allow_unclosed_final:
            calls.append(
                ToolCall(
                    raw=raw,
                    status="unclosed",
                    error="the tool call was not closed with </tool_call>",
                )
            )
        else:
            calls.append(parse_call(_strip_end_markers(raw), duration=duration))
    return calls


_END_MARKERS = ("<|im_end|>", "<|endoftext|>")


def _strip_end_markers(raw: str) -> str:
    """``raw`` without the stop tokens that END it (an unclosed final call runs to the end of
    the turn, stop token included). Markers inside the call are left in place: they are part of
    what the model wrote, and ``crop<|im_end|>_video`` or ``1<|endoftext|>0`` is a wrong call,
    not a valid one."""
    end = len(raw)
    while True:  # an index, not repeated slicing: a run of markers costs linear time
        while end and raw[end - 1].isspace():
            end -= 1
        marker = next((m for m in _END_MARKERS if raw.endswith(m, 0, end)), None)
        if marker is None:
            return raw[:end]
        end -= len(marker)
