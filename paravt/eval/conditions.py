"""``train.eval_conditions``: the held-out evaluation's conditions, parsed and checked.

Light on purpose (no torch, no paravt import): ``paravt.config.validate`` checks the entries
before anything loads (a malformed entry is one of its ``ConfigError`` lines);
``paravt.eval.heldout`` rolls each condition out.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class EvalConditionsError(ValueError):
    """A ``train.eval_conditions`` entry is malformed; the message names it and the fix."""


class EvalCondition(NamedTuple):
    """One held-out condition: its name (``K4_tools``, ``K4_tools_greedy``), the overview
    budget K, whether the tool round runs, and whether it decodes greedily (one sample a
    prompt, main and sub-agents at temperature 0) instead of ``train.eval_samples`` samples at
    the rollout temperatures."""

    name: str
    k: int
    tools: bool
    greedy: bool = False


def eval_conditions(cfg: Any) -> list[EvalCondition]:
    """``train.eval_conditions`` parsed (``cfg``: a ``paravt.config.Config``): ``'K:tools'`` or
    ``'K:notools'``, with ``':greedy'`` appended for a greedy condition, e.g.
    ``EvalCondition("K4_tools", 4, True)`` and ``EvalCondition("K8_tools_greedy", 8, True,
    True)`` for ``['4:tools', '8:tools:greedy']``.

    Raises ``EvalConditionsError`` naming a malformed entry."""
    t = cfg.train
    raw = list(t.eval_conditions) or [f"{t.eval_frames or cfg.video.fixed_frames}:tools"]
    out: list[EvalCondition] = []
    for c in raw:
        k, _, rest = str(c).partition(":")
        mode, _, how = rest.partition(":")
        ok = k.strip().isdigit() and int(k) >= 1 and mode in ("tools", "notools")
        if not ok or how not in ("", "greedy"):
            raise EvalConditionsError(
                f"train.eval_conditions entry {c!r} is not 'K:tools' or 'K:notools' with K >= 1, "
                "optionally ':greedy' after it (e.g. ['4:tools', '4:tools:greedy', '32:notools'])"
            )
        name = f"K{int(k)}_{mode}" + ("_greedy" if how else "")
        out.append(EvalCondition(name, int(k), mode == "tools", bool(how)))
    if len({c.name for c in out}) != len(out):
        raise EvalConditionsError(f"train.eval_conditions={raw} repeats a condition")
    return out
