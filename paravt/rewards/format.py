"""Format reward ``R_fmt = R_base + λ_anchor · R_anchor`` (PARA-GRPO anchoring).

The scored text of a main-agent turn is its forced prefix plus what it generated
(``Turn.prefix + Turn.text``). Because the rollout forces ``<think>\\n`` before every generation,
the prefix *is* an opened ``<think>``: the model's job is to close it and go on. The reference
implementation scored only generated text, never saw the ``<think>``, and so its anchor never
fired; here the prefix is part of the scored text.

Per non-forced turn ``s`` (prefix + generated):

* *closed*: exactly one ``<think>`` (at the start), exactly one ``</think>`` after it, and
  non-empty thinking in between. Repeated or empty tags earn nothing.
* *unclosed*: a ``<think>`` was opened and no ``</think>`` follows.
* *well-formed*: closed, and after ``</think>`` either one or more non-empty
  ``<tool_call>…</tool_call>`` blocks and nothing else, or exactly one non-empty
  ``<answer>…</answer>`` block and nothing else. Any other tag (a model-written
  ``<tool_response>``, a second ``<answer>``) makes the turn ill-formed.

A forced-answer turn (after ``max_turns``) was closed by the engine, not the model: it earns no
closure or flow credit, and counts as well-formed iff the generated part is ``X</answer>`` with
non-empty ``X``.

Then, over the turns of one trajectory::

    R_base   = mean_turns(well_formed)                                   ∈ [0, 1]
    R_anchor = 0.5 · mean_nonforced(closed) + 0.5 · flow − 1.0 · unclosed ∈ [-1, 1]

where ``flow`` = the last turn is non-forced, closed and ends in a well-formed answer block
(the full think → answer flow), and ``unclosed`` = some non-forced turn left ``<think>`` open.
"""

from __future__ import annotations

import re

from paravt.rewards import reference
from paravt.types import Turn

_TAG_RE = re.compile(r"</?(think|answer|tool_call|tool_response)>")
_TOOL_BLOCK_RE = re.compile(r"\s*<tool_call>(.*?)</tool_call>\s*", re.DOTALL)
_ANSWER_ONLY_RE = re.compile(r"\s*<answer>(.*?)</answer>\s*", re.DOTALL)

# End-of-turn markers the engine may leave at the end of decoded text; not part of the format.
END_MARKERS = ("<|im_end|>", "<|endoftext|>")


def _strip_end(s: str) -> str:
    s = s.rstrip()
    changed = True
    while changed:
        changed = False
        for m in END_MARKERS:
            if s.endswith(m):
                s = s[: -len(m)].rstrip()
                changed = True
    return s


def analyse_turn(text: str) -> dict[str, bool]:
    """Structure of one non-forced turn's scored text (forced prefix + generated)."""
    s = _strip_end(text)
    opens, closes = s.count("<think>"), s.count("</think>")
    opened = opens >= 1
    closed = False
    rest = ""
    if opens == 1 and closes == 1 and s.lstrip().startswith("<think>"):
        head, _, rest = s.partition("</think>")
        thinking = head.lstrip()[len("<think>") :]
        closed = bool(thinking.strip()) and not _TAG_RE.search(thinking)
    unclosed = opened and closes == 0
    well_formed = False
    answer = False
    if closed:
        m = _ANSWER_ONLY_RE.fullmatch(rest)
        if m:
            answer = bool(m.group(1).strip()) and not _TAG_RE.search(m.group(1))
            well_formed = answer
        else:
            blocks = _TOOL_BLOCK_RE.findall(rest)
            # Only tool-call blocks (and whitespace) may follow the thinking.
            if blocks and _TOOL_BLOCK_RE.sub("", rest) == "":
                well_formed = all(b.strip() and not _TAG_RE.search(b) for b in blocks)
    return {
        "opened": opened,
        "closed": closed,
        "unclosed": unclosed,
        "well_formed": well_formed,
        "answer": answer,
    }


def _forced_turn_ok(generated: str) -> bool:
    m = re.fullmatch(r"(.*?)</answer>", _strip_end(generated), re.DOTALL)
    return bool(m and m.group(1).strip() and not _TAG_RE.search(m.group(1)))


def format_reward(
    turns: list[Turn], *, lambda_anchor: float, base: str = "strict"
) -> dict[str, float]:
    """``R_fmt`` of a main trajectory's turns, with its parts.

    Returns ``fmt`` (``R_base + lambda_anchor * R_anchor``), ``fmt_base``, ``anchor``,
    ``think_closed`` (fraction of non-forced turns), ``flow`` and ``unclosed_think`` (0/1).
    ``base`` (``reward.base_format``): ``strict``, R_base as above; ``reference``, the
    reference's closure-blind score of the generated text
    (``paravt.rewards.reference.base_format``; R_anchor and the other parts unchanged).
    """
    if not turns:
        return dict.fromkeys(
            ("fmt", "fmt_base", "anchor", "think_closed", "flow", "unclosed_think"), 0.0
        )
    wf: list[float] = []
    closed: list[float] = []
    unclosed = False
    last: dict[str, bool] | None = None
    for t in turns:
        if t.forced_answer:
            wf.append(float(_forced_turn_ok(t.text)))
            last = None
            continue
        a = analyse_turn(t.prefix + t.text)
        wf.append(float(a["well_formed"]))
        closed.append(float(a["closed"]))
        unclosed |= a["unclosed"]
        last = a
    flow = float(last is not None and last["closed"] and last["answer"])
    closure = sum(closed) / len(closed) if closed else 0.0
    if base == "reference":
        r_base = reference.base_format(reference.completion(turns))
    else:
        r_base = sum(wf) / len(wf)
    anchor = 0.5 * closure + 0.5 * flow - 1.0 * float(unclosed)
    return {
        "fmt": r_base + lambda_anchor * anchor,
        "fmt_base": r_base,
        "anchor": anchor,
        "think_closed": closure,
        "flow": flow,
        "unclosed_think": float(unclosed),
    }
