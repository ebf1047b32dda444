"""The ParaVT reference implementation's reward parts, for its vanilla GRPO (``vanilla_ref``).

paravt's own rewards (``format.py``, ``tool.py``, ``accuracy.py``) close shortcuts the
reference left open; the collapse experiment also needs the reference's vanilla as it was, to
compare with (``paravt.experiments.arms``, arm ``vanilla_ref``). These functions are paravt's
reading of EvolvingLMMs-Lab/ParaVT at commit cf55249 (no code of it is copied):

* ``paravt/rl/rewards/format.py`` ``compute_format_reward`` with ``ANSWER_SUFFIX`` off and
  ``ANCHOR_WEIGHT`` 0 (``paravt/rl/configs/vanilla_grpo_8b.yaml``): :func:`base_format`;
* ``paravt/rl/rewards/tool.py`` ``compute_tool_reward``: :func:`tool_reward`;
* ``paravt/rl/rewards/utils.py`` ``extract_answer`` (its answer fallbacks),
  ``has_parseable_tool_call``, ``has_substantive_think``, ``think_before_tool``;
* ``paravt/rl/rewards/compose.py`` (``acc + format_weight · format + tool``) and
  ``paravt/rl/workflow.py`` (what is scored: the tokens the policy generated, every turn's,
  concatenated; ``<think>\\n`` is part of the prompt, never scored, and only appended under
  ``THINK_PREFIX`` or ``ANSWER_SUFFIX``, both off for vanilla).

What the reference does, and paravt's strict rewards do not:

* the base format reward is **closure-blind**: ``<think>`` followed by at least 10 characters
  earns its 0.3 whether or not ``</think>`` ever comes (an unclosed ``<think>`` runs to the
  first ``<tool_``, ``<answer>``, ``<|im_end|>`` or the end);
* the answer falls back: the first ``<answer>…</answer>`` block, else the text after the first
  ``</think>`` with complete tool blocks removed, else the last non-empty line (that does not
  start with ``<|im_`` or ``<tool_``);
* R_tool is read from the text: 0.1 for a ``<tool_call>`` whose body is JSON naming a tool
  (or a ``<tool_code>`` line with a call), 0.3 instead when ``<tool_response>`` is in the
  scored text (which holds generated tokens only: the model has to write it), plus 0.5 when
  R_acc > 0 (partial credit counts), at most 1.

The texts are scanned with ``str.find`` in one pass (the reference's lazy regexes to ``$``
rescan from every unclosed tag). Used by ``paravt.rewards.compose.score`` under
``reward.base_format`` / ``answer_extraction`` / ``tool_mode`` = ``reference``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence

from paravt.types import Turn

_THINK, _THINK_END = "<think>", "</think>"
_ANSWER, _ANSWER_END = "<answer>", "</answer>"
_CALL, _CALL_END = "<tool_call>", "</tool_call>"
_CODE, _CODE_END = "<tool_code>", "</tool_code>"
_RESP, _RESP_END = "<tool_response>", "</tool_response>"
#: Where an unclosed ``<think>`` ends for the reference (besides the end of the text).
_OPEN_THINK_STOPS = ("<tool_", _ANSWER, "<|im_end|>")
#: The tag pairs whose counts must match for the reference's balance bonus.
_BALANCED = ((_THINK, _THINK_END), (_CALL, _CALL_END), (_CODE, _CODE_END), (_ANSWER, _ANSWER_END))


def completion(turns: Sequence[Turn]) -> str:
    """The text the reference scores, from paravt's turns: what the policy generated, every
    turn's in order. A forced-answer turn keeps its forced prefix (``…</think>\\n<answer>``):
    the reference has no forced answer (its last turn runs free), and without the prefix the
    answer paravt forced could not be read at all. A pinned ``<think>`` of a non-forced turn
    is not scored, as in the reference (its prefix is part of the prompt)."""
    return "".join((t.prefix if t.forced_answer else "") + t.text for t in turns)


def _bodies(text: str, open_: str, close: str, *, to_end: bool) -> Iterator[str]:
    """The bodies of ``open_ … close`` blocks, left to right; ``to_end``: an unclosed block runs
    to the end of the text (the reference's ``(?:close|$)``), else it is no block."""
    pos = 0
    while (i := text.find(open_, pos)) >= 0:
        j = text.find(close, i + len(open_))
        if j < 0:
            if to_end:
                yield text[i + len(open_) :]
            return
        yield text[i + len(open_) : j]
        pos = j + len(close)


def _first_answer(text: str) -> str | None:
    return next(_bodies(text, _ANSWER, _ANSWER_END, to_end=False), None)


def has_substantive_think(text: str, min_chars: int = 10) -> bool:
    """The first ``<think>``'s thought has ``min_chars`` or more characters (stripped): up to
    the first ``</think>`` after it, or, none following, up to the first ``<tool_``,
    ``<answer>``, ``<|im_end|>`` or the end."""
    i = text.find(_THINK)
    if i < 0:
        return False
    start = i + len(_THINK)
    end = text.find(_THINK_END, start)
    if end < 0:
        stops = [k for s in _OPEN_THINK_STOPS if (k := text.find(s, start)) >= 0]
        end = min(stops, default=len(text))
    return len(text[start:end].strip()) >= min_chars


def has_parseable_tool_call(text: str) -> bool:
    """A ``<tool_call>`` (closed or running to the end) whose body is a JSON object with a
    ``"name"``, or a ``<tool_code>`` with a line holding ``(`` that is no ``#`` comment."""
    for body in _bodies(text, _CALL, _CALL_END, to_end=True):
        body = body.strip()
        if not body or body.startswith("<|im_end|>"):
            continue
        try:
            data = json.loads(body)
        except ValueError:
            continue
        if isinstance(data, dict) and "name" in data:
            return True
    for body in _bodies(text, _CODE, _CODE_END, to_end=True):
        body = body.strip()
        if not body or body.startswith("<|im_end|>"):
            continue
        for line in body.splitlines():
            line = line.strip()
            if line and "(" in line and not line.startswith("#"):
                return True
    return False


def think_before_tool(text: str) -> bool:
    """The first ``<think>`` comes before the first ``<tool_call>`` / ``<tool_code>``."""
    think = text.find(_THINK)
    calls = [k for tag in (_CALL, _CODE) if (k := text.find(tag)) >= 0]
    return think >= 0 and bool(calls) and think < min(calls)


def base_format(text: str) -> float:
    """The reference's vanilla format reward of ``text`` (:func:`completion`), in [0, 1]:
    0.3 for a substantive ``<think>`` (closed or not), 0.2 + 0.1 for an answer block with a
    non-empty body, 0.3 for a parseable tool call after the ``<think>``, and 0.1 when the
    score is positive and every tag pair is balanced."""
    think = has_substantive_think(text)
    score = 0.0
    if think:
        score += 0.3
    if any(b.strip() for b in _bodies(text, _ANSWER, _ANSWER_END, to_end=False)):
        score += 0.2 + 0.1  # both tags are there: the block has a body
    if think and has_parseable_tool_call(text) and think_before_tool(text):
        score += 0.3
    if score > 0 and all(text.count(a) == text.count(b) for a, b in _BALANCED):
        score += 0.1
    return min(score, 1.0)


def _drop_blocks(text: str, open_: str, close: str) -> str:
    """``text`` without its complete ``open_ … close`` blocks (an unclosed one stays)."""
    out, pos = [], 0
    while (i := text.find(open_, pos)) >= 0:
        j = text.find(close, i + len(open_))
        if j < 0:
            break
        out.append(text[pos:i])
        pos = j + len(close)
    out.append(text[pos:])
    return "".join(out)


def extract_answer(text: str) -> str | None:
    """The reference's answer with its fallbacks (None where it finds nothing, which scores
    0): the first ``<answer>`` block; else, after the first ``</think>``, the text without
    its complete tool-call, tool-code and tool-response blocks and chat markers; else the last
    non-empty line that does not start with ``<|im_`` or ``<tool_``."""
    if (body := _first_answer(text)) is not None:
        return body.strip() or None
    if _THINK_END in text:
        tail = text.split(_THINK_END, 1)[1]
        for a, b in ((_CALL, _CALL_END), (_CODE, _CODE_END), (_RESP, _RESP_END)):
            tail = _drop_blocks(tail, a, b)
        tail = tail.replace("<|im_end|>", "").replace("<|im_start|>", "").strip()
        if tail:
            return tail
    lines = [
        s
        for line in text.splitlines()
        if (s := line.strip()) and not s.startswith("<|im_") and not s.startswith("<tool_")
    ]
    return lines[-1] if lines else None


def tool_reward(text: str, acc: float) -> float:
    """The reference's R_tool of ``text`` (:func:`completion`) with accuracy ``acc``: 0 without
    a parseable call; else 0.1, or 0.3 if ``<tool_response>`` is in the text; + 0.5 when
    ``acc > 0``; at most 1. Executed or not, the call's text is what pays."""
    if not has_parseable_tool_call(text):
        return 0.0
    r = 0.3 if _RESP in text else 0.1
    if acc > 0:
        r += 0.5
    return min(r, 1.0)
