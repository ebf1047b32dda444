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
:class:`ToolFailure`; the agent loop turns either into that call's error tool response.

A plug-in is code the project does not control, so the agent never calls a tool's method
directly: :class:`ToolBox` (``check``, ``label``, ``instruction``) and
``paravt.agent.encoder.AgentEncoder.decode_views`` (``plan``, ``view``) call it. A method that
raises, or returns what its contract does not allow (a label or instruction that is no text,
over :data:`MAX_LABEL_CHARS` / :data:`MAX_INSTRUCTION_CHARS`, or holds a lone surrogate; a plan
for another video or of more than ``video.crop_max_frames`` frames; a view that is no uint8
``(T, H, W, 3)`` tensor within the crop budget with T finite times; a status that is none),
fails only that call, with status ``tool_error``: the main agent reads ``Error: the <tool>
tool failed (<method>: <why>)`` as for a bad ``crop_video`` call, the trajectory's error log
keeps it, the run's log warns, the rollout counts it (``RolloutStats.calls``) and the step's
metrics count it by tool (``tool_errors/<name>``, ``paravt.metrics.rollout_metrics``). Like
``decode_error`` it is the system's failure, neither paid nor penalised by ``R_tool``.
``load_tools`` checks each tool's name and schema when the run starts
(``paravt.validate.validate_run``: before any model loads).
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from typing import Any, Protocol, get_args, runtime_checkable

import torch

from paravt.config import ConfigError, VideoConfig, resolve_plugin
from paravt.files import unencodable_text
from paravt.types import FrameBatch, FrameRequest, ToolCall, ToolCallStatus, VideoMeta

log = logging.getLogger("paravt.agent.tools")

#: The most characters a tool's :meth:`Tool.instruction` may add to the question it is given
#: (the sub-agent's prompt; the built-in's is about 90). A 1 MB instruction made the
#: sub-agents' batch (left-padded to its longest prompt) try to allocate 40 GB.
MAX_INSTRUCTION_CHARS = 4096
#: The most characters of a :meth:`Tool.label` (the text before a summary; ``[2.0-6.0 s]``).
MAX_LABEL_CHARS = 256
#: The most characters of a tool's schema as JSON (written into every main prompt's system
#: turn; ``crop_video``'s is about 700): a megabyte of description would fill every context.
MAX_SCHEMA_CHARS = 8192
#: What a tool's name may be: OpenAI's and Qwen's function-name rule. No space, no markup:
#: the name is written into the system prompt's ``<tools>`` block and matched against what the
#: model writes, so ``<|im_start|>`` or an empty name would break the template or the parser.
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_STATUSES = frozenset(get_args(ToolCallStatus))


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


def tool_failure(name: str, method: str, why: str) -> ToolFailure:
    """A tool's ``method`` raised or returned garbage (``why``): that call's ``tool_error``
    (module docstring), logged as a warning. The error the model reads is kept short."""
    why = why if len(why) <= 200 else why[:200] + "…"
    why = why.encode("utf-8", "backslashreplace").decode()  # printable, tokenizable
    log.warning("tool %s: %s %s; the call fails as a tool_error", name, method, why)
    return ToolFailure("tool_error", f"the {name} tool failed ({method}: {why})")


def _raised(e: BaseException) -> str:
    return f"raised {type(e).__name__}: {e}" if str(e) else f"raised {type(e).__name__}"


def _fail(call: ToolCall, f: ToolFailure) -> None:
    call.status, call.error = f.status, f.error


def text_problem(v: object, limit: int, what: str) -> str | None:
    """Why ``v`` is no usable text of a tool (``what``: ``label``, ``instruction``), or None."""
    if not isinstance(v, str):
        return f"returned {type(v).__name__}, not a string ({what})"
    if len(v) > limit:
        return f"returned {len(v):,} characters, over the {limit:,} a {what} may hold"
    if bad := unencodable_text(v, what):
        return f"returned text with a {bad.split(' holds a ', 1)[1].split(' (')[0]}"
    return None


def view_problem(view: object, vcfg: VideoConfig, factor: int) -> str | None:
    """Why a :meth:`Tool.view` result is not a view the pixel pack can take, or None: a
    ``(frames, times)`` pair, frames a uint8 ``(T, H, W, 3)`` tensor with ``1 <= T <=
    video.crop_max_frames``, sides multiples of ``factor`` and ``H * W <=
    video.crop_max_pixels``, ``times`` T finite numbers."""
    if not isinstance(view, tuple) or len(view) != 2:
        return f"returned {type(view).__name__}, not a (frames, times) pair"
    frames, times = view
    if not isinstance(frames, torch.Tensor) or frames.dtype != torch.uint8 or frames.ndim != 4:
        what = (
            f"{frames.dtype} {tuple(frames.shape)}"
            if isinstance(frames, torch.Tensor)
            else type(frames).__name__
        )
        return f"returned frames of {what}, not a uint8 (T, H, W, 3) tensor"
    t, h, w, c = frames.shape
    if c != 3 or not 1 <= t <= max(vcfg.crop_max_frames, 1):
        return (
            f"returned frames of shape {tuple(frames.shape)}: need 3 channels and 1 to "
            f"{vcfg.crop_max_frames} frames (video.crop_max_frames)"
        )
    if h % factor or w % factor or h * w > vcfg.crop_max_pixels or h * w == 0:
        return (
            f"returned {h}x{w} frames: sides must be multiples of {factor} and the area at "
            f"most video.crop_max_pixels={vcfg.crop_max_pixels}"
        )
    try:
        ok = len(times) == t and all(math.isfinite(float(x)) for x in times)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        return f"returned times that are not {t} finite numbers of seconds"
    return None


def plan_problem(plan: object, video: str, vcfg: VideoConfig) -> str | None:
    """Why a :meth:`Tool.plan` result is neither a :class:`FrameRequest` of ``video`` (the
    sample's own: a plug-in never opens another file) of at most ``video.crop_max_frames``
    times, nor a :class:`ToolFailure` of a failure status, or None."""
    if isinstance(plan, ToolFailure):
        if plan.status not in _STATUSES or plan.status == "ok" or not isinstance(plan.error, str):
            return f"returned a ToolFailure of status {plan.status!r}"
        return None
    if not isinstance(plan, FrameRequest):
        return f"returned {type(plan).__name__}, not a FrameRequest or ToolFailure"
    if plan.video != video:
        return "asked for another file than the sample's video"
    n = len(plan.timestamps)
    if not 1 <= n <= max(vcfg.crop_max_frames, 1):
        return f"asked for {n} frames, not 1 to {vcfg.crop_max_frames} (video.crop_max_frames)"
    return None


def schema_problem(name: str, schema: object) -> str | None:
    """Why ``schema`` is not a function schema for tool ``name``, or None: a JSON-serialisable
    (at most :data:`MAX_SCHEMA_CHARS`) ``{"type": "function", "function": {"name": name, "parameters": <object schema>, ...}}``
    whose parameters pass jsonschema's meta-schema check (when jsonschema is installed; else a
    structural check of ``type`` / ``properties`` / ``required``)."""
    if not isinstance(schema, dict):
        return f"schema is {type(schema).__name__}, not a dict"
    try:
        size = len(json.dumps(schema, allow_nan=False))
    except (TypeError, ValueError) as e:
        return f"schema is not JSON ({e})"
    if size > MAX_SCHEMA_CHARS:
        return (
            f"schema is {size:,} characters of JSON, over the {MAX_SCHEMA_CHARS:,} a tool's "
            "schema may take in every prompt; shorten its descriptions"
        )
    fn = schema.get("function")
    if schema.get("type") != "function" or not isinstance(fn, dict):
        return 'schema must be {"type": "function", "function": {...}}'
    if fn.get("name") != name:
        return f"schema's function name {fn.get('name')!r} is not the tool's name {name!r}"
    if not isinstance(fn.get("description", ""), str):
        return "schema's function description is not a string"
    params = fn.get("parameters")
    if not isinstance(params, dict) or params.get("type") != "object":
        return 'schema\'s parameters must be a JSON schema {"type": "object", ...}'
    try:
        import jsonschema
    except ImportError:
        jsonschema = None  # type: ignore[assignment]
    if jsonschema is not None:
        try:
            jsonschema.validators.validator_for(params).check_schema(params)
        except jsonschema.SchemaError as e:
            return f"schema's parameters are no valid JSON schema ({e.message})"
        return None
    props, req = params.get("properties", {}), params.get("required", [])
    if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
        return "schema's parameters.properties must map each argument to a schema object"
    if not isinstance(req, list) or not all(isinstance(r, str) and r in props for r in req):
        return "schema's parameters.required must list names of its properties"
    return None


class ToolBox:
    """The tools of a run by name, in config order (the order of their schemas in the prompt).

    Also the one place the agent calls a tool's ``check``, ``label`` and ``instruction``
    through (module docstring): a plug-in's exception or garbage fails that call only."""

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

    def check(self, call: ToolCall, args: dict[str, Any], duration: float) -> None:
        """:meth:`Tool.check` of the tool ``call`` names (the parser's); a check that raises or
        leaves no known status fails the call as a ``tool_error``."""
        tool = self.tools[call.name]
        try:
            tool.check(call, args, duration)
        except Exception as e:  # noqa: BLE001 — a plug-in's bug fails its call, not the run
            _fail(call, tool_failure(tool.name, "check", _raised(e)))
            return
        if call.status not in _STATUSES or not isinstance(call.error, str):
            _fail(call, tool_failure(tool.name, "check", f"set status {call.status!r}"))
        elif call.status != "ok" and (why := text_problem(call.error, MAX_LABEL_CHARS, "error")):
            _fail(call, tool_failure(tool.name, "check", why))

    def label(self, call: ToolCall) -> str:
        """:meth:`Tool.label` of the tool ``call`` names (the prompts' response prefix). One
        that raises or returns no short text fails the call (``tool_error``; ``""`` here, and
        ``prompts.tool_response_text`` shows the error instead)."""
        tool = self.tools[call.name]
        try:
            text = tool.label(call)
        except Exception as e:  # noqa: BLE001 — a plug-in's bug fails its call, not the run
            _fail(call, tool_failure(tool.name, "label", _raised(e)))
            return ""
        if why := text_problem(text, MAX_LABEL_CHARS, "label"):
            _fail(call, tool_failure(tool.name, "label", why))
            return ""
        return text

    def instruction(self, call: ToolCall, question: str | None) -> str | ToolFailure:
        """:meth:`Tool.instruction` of the tool ``call`` names (the sub-agent's prompt), or the
        call's ``tool_error`` when it raises or returns no text of at most
        :data:`MAX_INSTRUCTION_CHARS` beyond the question's length."""
        tool = self.tools[call.name]
        try:
            text = tool.instruction(call, question)
        except Exception as e:  # noqa: BLE001 — a plug-in's bug fails its call, not the run
            return tool_failure(tool.name, "instruction", _raised(e))
        limit = MAX_INSTRUCTION_CHARS + len(question or "")
        if why := text_problem(text, limit, "instruction"):
            return tool_failure(tool.name, "instruction", why)
        return text

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
            try:
                obj = obj()
            except Exception as e:  # noqa: BLE001 — named in the refusal, before any load
                raise ConfigError(
                    f"{key}: {spec!r} could not be built with no argument ({_raised(e)}); "
                    "name an instance (module:TOOL) or give its constructor defaults"
                ) from None
        if not isinstance(obj, Tool) or not isinstance(getattr(obj, "name", None), str):
            raise ConfigError(
                f"{key}: {spec!r} is a {type(obj).__name__}, not a tool; it must provide name, "
                "schema, check, plan, view, instruction and label (paravt.agent.tools.Tool)"
            )
        if not TOOL_NAME.fullmatch(obj.name):
            raise ConfigError(
                f"{key}: {spec!r} is named {quote(obj.name)!r}; a tool's name is 1 to 64 "
                "letters, digits, '_' or '-' (no spaces or markup: the model writes it in "
                "<tool_call> and the prompt lists it); rename it"
            )
        if why := schema_problem(obj.name, getattr(obj, "schema", None)):
            raise ConfigError(f"{key}: {spec!r}: its {why}; fix the tool's schema")
        tools.append(obj)
    return ToolBox(tools)


# ------------------------------------------------------------------ helpers for tools' checks
def quote(v: object, limit: int = 60) -> str:
    """A model-written value for an error message, shortened (the message is plain text)."""
    r = v if isinstance(v, str) else repr(v)
    return r if len(r) <= limit else r[:limit] + "…"


def numbers(
    call: ToolCall,
    args: dict[str, Any],
    names: tuple[str, ...] | list[str],
    *,
    optional: tuple[str, ...] = (),
    unit: str = "",
) -> dict[str, float] | None:
    """The numbers (``number``) ``args`` holds under ``names``, for a tool's ``check``
    (``crop_video``'s and the shipped ``zoom_frame``'s): on the first one missing (and not
    ``optional``) or not a number, ``call`` gets status ``bad_arguments`` and an error naming
    it (``unit``, e.g. ``"seconds"``, said there) and the result is None."""
    vals: dict[str, float] = {}
    for k in names:
        if k not in args:
            if k in optional:
                continue
            call.status = "bad_arguments"
            call.error = f"missing argument {k}" + (f" ({unit})" if unit else "")
            return None
        v = number(args[k])
        if v is None:
            call.status = "bad_arguments"
            call.error = f"argument {k}={quote(repr(args[k]))} must be a number" + (
                f" of {unit}" if unit else ""
            )
            return None
        vals[k] = v
    return vals


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
