"""The tool protocol: what a tool the main agent calls must provide, and how a config names one.

A tool is looked at, not run: each valid call names a part of the sample's own video, the
tool says which frames to decode (:meth:`Tool.plan`) and what of them to show
(:meth:`Tool.view`), and a sub-agent with the same weights looks at the view and returns a
summary (or, with ``agent.crop_mode=frames``, the view itself goes into the tool response).
Everything tools share — the per-turn budget ``agent.max_parallel``, ONE decode-planner run
and ONE pixel pack for every call of every tool of a turn, ONE batched sub-agent engine call,
failures as error tool responses — is the agent loop's (``paravt.agent.calls``), so a new tool
writes only what differs. ``paravt.agent.crop`` (``crop_video``) is the built-in one.

Tools are named in the config by ``module:attr`` (``agent.tools``, default
``["paravt.agent.crop:CROP"]``) and resolved here (``paravt.config.resolve_plugin``,
``importlib``): a tool module is no import edge of paravt (as an engine of
``paravt.engines.ENGINES`` is not). The attribute is a :class:`Tool` instance or a class /
factory called with no argument.

Contract: :meth:`Tool.check` and :meth:`Tool.plan` never raise for what the model wrote — a bad
call is a status and an error message (``paravt.types.ToolCall``), an undecodable one a
:class:`ToolFailure`; the agent loop turns either into that call's error tool response. A
``plan`` or ``view`` that raises anyway (a tool's bug) fails only its call, as a
``decode_error`` (``paravt.agent.encoder.AgentEncoder.decode_views``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from paravt.config import ConfigError, VideoConfig, resolve_plugin
from paravt.types import FrameBatch, FrameRequest, ToolCall, ToolCallStatus, VideoMeta


@dataclass(frozen=True)
class ToolFailure:
    """A call the tool could not serve (e.g. an empty window once sampled): the call's final
    ``status``, the error the main agent reads and, for the trajectory's ``errors`` log, the
    failure's own wording (``detail``; '' = ``error``)."""

    status: ToolCallStatus
    error: str
    detail: str = ""


@runtime_checkable
class Tool(Protocol):
    """One tool the main agent may call (``<tool_call>{"name": name, "arguments": …}``).

    Used by the parser (:meth:`check`), the prompts (``schema`` in the system prompt's
    ``<tools>`` block, :meth:`label` before each summary), the agent loop's tool step
    (``paravt.agent.calls``: :meth:`plan`, :meth:`view`, :meth:`instruction`) and the SFT
    encoder (``paravt.agent.encoder``), so RL, SFT and evaluation call it the same way.
    """

    #: The function name the model writes.
    name: str
    #: Its Hermes/OpenAI function schema (``{"type": "function", "function": {...}}``).
    schema: dict[str, Any]

    def check(self, call: ToolCall, args: dict[str, Any], duration: float) -> None:
        """Validate ``args`` (already a dict) for a video of ``duration`` seconds: set
        ``call.status`` / ``call.error`` on a bad call (``bad_arguments``, ``bad_range``,
        ``outside_video``), else fill what :meth:`plan` reads (``call.start`` / ``call.end``:
        the part of the video it looks at, clamped). Never raises for model text."""
        ...

    def plan(
        self, call: ToolCall, video: str, meta: VideoMeta, vcfg: VideoConfig, factor: int
    ) -> FrameRequest | ToolFailure:
        """The frames a valid call needs from ``video`` (sizes multiples of ``factor``), or
        why there are none. Never raises."""
        ...

    def view(
        self, call: ToolCall, batch: FrameBatch, vcfg: VideoConfig, factor: int
    ) -> tuple[torch.Tensor, list[float]]:
        """What the sub-agent sees of the decoded ``batch``: uint8 ``(T, H, W, 3)`` frames
        (sides multiples of ``factor``, within ``vcfg``'s crop pixel budget) and their times
        in seconds."""
        ...

    def instruction(self, call: ToolCall, question: str | None) -> str:
        """The sub-agent's instruction after the view (``question``: the user's, when
        ``agent.sub_agent_include_question``)."""
        ...

    def label(self, call: ToolCall) -> str:
        """The text before a valid call's summary in its tool response (e.g. ``[2.0-6.0 s]``)."""
        ...


class ToolBox:
    """The tools of a run by name, in config order (the order of their schemas in the prompt)."""

    def __init__(self, tools: list[Tool]) -> None:
        self.tools: dict[str, Tool] = {}
        for t in tools:
            if t.name in self.tools:
                raise ConfigError(
                    f"agent.tools: two tools are named {t.name!r}; each tool's name must be "
                    "unique (the model calls a tool by name)"
                )
            self.tools[t.name] = t

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    def get(self, name: str) -> Tool | None:
        return self.tools.get(name)

    def label(self, call: ToolCall) -> str:
        """:meth:`Tool.label` of the tool ``call`` names (the prompts' response prefix)."""
        return self.tools[call.name].label(call)

    def __len__(self) -> int:
        return len(self.tools)


def load_tools(specs: list[str], key: str = "agent.tools") -> ToolBox:
    """The :class:`ToolBox` of config ``agent.tools`` (``module:attr`` each; a class or a
    factory is called with no argument). Used by ``paravt.agent.encoder.AgentEncoder`` (so by
    the agent loop, SFT and evaluation) and by ``paravt.validate.validate_run``."""
    if not specs:
        raise ConfigError(f"{key} is empty; name at least one tool (e.g. paravt.agent.crop:CROP)")
    tools: list[Tool] = []
    for spec in specs:
        obj = resolve_plugin(spec, key)
        if isinstance(obj, type) or (callable(obj) and not isinstance(obj, Tool)):
            obj = obj()
        if not isinstance(obj, Tool) or not isinstance(getattr(obj, "name", None), str):
            raise ConfigError(
                f"{key}: {spec!r} is a {type(obj).__name__}, not a tool; it must provide name, "
                "schema, check, plan, view, instruction and label (paravt.agent.tools.Tool)"
            )
        tools.append(obj)
    return ToolBox(tools)


# ------------------------------------------------------------------ helpers for tools' checks
def quote(v: object, limit: int = 60) -> str:
    """A model-written value for an error message, shortened (the message is plain text)."""
    r = v if isinstance(v, str) else repr(v)
    return r if len(r) <= limit else r[:limit] + "…"


def number(v: object) -> float | None:
    """A finite JSON number as a float, else None (JSON ``true`` is not a number)."""
    # bool is an int subclass in Python; JSON true is not a time.
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:  # an integer literal beyond float range
        return None
    return f if math.isfinite(f) else None
