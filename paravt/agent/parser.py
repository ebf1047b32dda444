"""Tool-call parser: one turn's generated text -> ``ToolCall`` records, each judged on its own.

A turn may hold several ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` blocks. Every
block is parsed and validated independently, so one malformed call never discards the good
calls beside it (the reference dropped the whole turn). Statuses (``paravt.types.ToolCall``):

``bad_json``            the block is not a JSON object with a string ``name``
``unknown_tool``        ``name`` is none of the run's tools (``agent.tools``; by default only
                        ``crop_video``)
``bad_arguments``       ``arguments`` missing / not an object; or the tool's own check
                        (:meth:`paravt.agent.tools.Tool.check`) rejects them: for
                        ``crop_video`` a key missing, unknown or not a finite number. The
                        reference's ``video_path`` argument (ParaVT's SFT data writes it) is
                        accepted and ignored: the video is always the sample's own, a
                        model-written path is never opened (``paravt.agent.crop``)
``bad_range``           (tool check) ``start_time >= end_time``, or a window that is empty once
                        clamped to ``[0, duration]``
``outside_video``       (tool check) the window lies entirely outside ``[0, duration]``
``over_parallel_limit`` the block is beyond the first ``max_parallel`` blocks of the turn
``unclosed``            a final ``<tool_call>`` without ``</tool_call>`` (accepted and parsed
                        instead when ``allow_unclosed_final_call``)

The parser reads the JSON and the tool's name; each tool checks its own arguments and fills
what it needs later (``crop_video``: the window clamped to ``[0, duration]`` in
``ToolCall.start/end``; partly-outside windows are cropped to their inside part rather than
rejected). Used by the agent loop (every main turn) and the SFT encoder (oracle turns).

A block runs from a ``<tool_call>`` to the next ``</tool_call>`` with no other ``<tool_call>``
in between: a tag the model merely mentions earlier (e.g. inside its thinking) does not swallow
the valid call after it. Likewise only the LAST unmatched ``<tool_call>`` can be an unclosed
call, and not when a ``</think>`` or ``<answer>`` follows it (then it was a mention).
"""

from __future__ import annotations

import json
import re

from paravt.agent.crop import CROP
from paravt.agent.tools import Tool, ToolBox
from paravt.agent.tools import quote as _quote
from paravt.types import ToolCall

#: The tools when a caller names none: the built-in ``crop_video`` only.
DEFAULT_TOOLS = ToolBox([CROP])
_BLOCK_RE = re.compile(r"<tool_call>((?:(?!<tool_call>).)*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"
_MENTION_ENDS = ("</think>", "<answer>")


def parse_call(raw: str, *, duration: float, tools: ToolBox | None = None) -> ToolCall:
    """Parse one block's content (the text between the tags) and have the tool it names
    check its arguments (``tools``: the run's, default ``crop_video`` only)."""
    tools = DEFAULT_TOOLS if tools is None else tools
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
    tool: Tool | None = tools.get(call.name)
    if tool is None:
        names = list(tools.tools)
        which = (
            f"the only tool is {names[0]}"
            if len(names) == 1
            else f"the tools are {', '.join(names)}"
        )
        call.status = "unknown_tool"
        call.error = f"unknown tool '{_quote(call.name)}'; {which}"
        return call
    args = obj.get("arguments")
    if isinstance(args, str):  # some chat formats double-encode arguments
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            pass
    if not isinstance(args, dict):
        call.status = "bad_arguments"
        params = tool.schema.get("function", {}).get("parameters", {}).get("required", [])
        call.error = f"{tool.name} needs an 'arguments' object with {' and '.join(params)}"
        return call
    call.arguments = args
    tools.check(call, args, duration)  # a check that raises fails this call (tool_error)
    return call


def parse_tool_calls(
    text: str,
    *,
    duration: float,
    max_parallel: int,
    allow_unclosed_final: bool = False,
    tools: ToolBox | None = None,
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
            calls.append(parse_call(_strip_end_markers(raw), duration=duration, tools=tools))
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
