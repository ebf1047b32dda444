"""``train.eval_conditions``: the held-out evaluation's conditions, parsed and checked.

Light on purpose (no torch, no paravt import): ``paravt.config.validate`` checks the entries
before anything loads (a malformed entry is one of its ``ConfigError`` lines);
``paravt.eval.heldout`` rolls each condition out.
"""

from __future__ import annotations

from typing import Any


class EvalConditionsError(ValueError):
    """A ``train.eval_conditions`` entry is malformed; the message names it and the fix."""


def eval_conditions(cfg: Any) -> list[tuple[str, int, bool]]:
    """``train.eval_conditions`` as ``(name, K, tools)``, e.g. ``("K4_tools", 4, True)``
    (``cfg``: a ``paravt.config.Config``).

    Raises ``EvalConditionsError`` naming a malformed entry."""
    t = cfg.train
    raw = list(t.eval_conditions) or [f"{t.eval_frames or cfg.video.fixed_frames}:tools"]
    out: list[tuple[str, int, bool]] = []
    for c in raw:
        k, _, mode = str(c).partition(":")
        if not k.strip().isdigit() or int(k) < 1 or mode not in ("tools", "notools"):
            raise EvalConditionsError(
                f"train.eval_conditions entry {c!r} is not 'K:tools' or 'K:notools' with K >= 1 "
                "(e.g. ['4:tools', '4:notools', '32:notools'])"
            )
        out.append((f"K{int(k)}_{mode}", int(k), mode == "tools"))
    if len({n for n, _, _ in out}) != len(out):
        raise EvalConditionsError(f"train.eval_conditions={raw} repeats a condition")
    return out
