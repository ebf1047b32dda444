"""Tool reward ``R_tool``, computed from the trajectory's *structure*, never from its text.

The rollout records every ``<tool_call>`` it parsed as a :class:`paravt.types.ToolCall` with a
status; only calls the agent loop actually executed (crop decoded, sub-agent answered) have
``status == 'ok'``. A model that writes ``<tool_response>`` or "I called the tool" into its own
text changes no ``ToolCall`` and so earns nothing here (the reference paid for such strings)::

    R_tool = tool_bonus · [n_ok ≥ 1 and R_acc ≥ tool_correct_threshold]
             − tool_error_penalty · n_model_errors − call_cost · n_ok

``call_cost`` (``reward.call_cost``) prices each executed call: with ``tool_bonus = 0`` a call
pays only through the answer it makes right, so a policy that crops when the overview already
shows the answer loses ``call_cost`` per crop against one that answers at once.

``n_model_errors`` counts calls the *model* got wrong (bad JSON, unknown tool, bad arguments,
bad range, outside the video, over the parallel limit, unclosed). Failures of the system
(``decode_error``, ``sub_agent_error``, and ``tool_error``: a plug-in tool's own bug) are
neither paid nor penalised.
"""

from __future__ import annotations

from paravt.types import Trajectory

SYSTEM_ERRORS = frozenset({"decode_error", "sub_agent_error", "tool_error"})


def call_counts(traj: Trajectory) -> dict[str, int]:
    """``n_calls`` (all parsed), ``n_ok`` (executed), ``n_model_errors``, ``n_system_errors``."""
    calls = [c for t in traj.turns for c in t.calls]
    n_ok = sum(c.status == "ok" for c in calls)
    n_sys = sum(c.status in SYSTEM_ERRORS for c in calls)
    return {
        "n_calls": len(calls),
        "n_ok": n_ok,
        "n_model_errors": len(calls) - n_ok - n_sys,
        "n_system_errors": n_sys,
    }


def tool_reward(
    traj: Trajectory,
    acc: float,
    *,
    tool_bonus: float,
    tool_error_penalty: float,
    correct_threshold: float,
    call_cost: float = 0.0,
) -> dict[str, float]:
    """``R_tool`` and the call counts it was computed from (as floats, for logging)."""
    n = call_counts(traj)
    bonus = tool_bonus if (n["n_ok"] >= 1 and acc >= correct_threshold) else 0.0
    r = bonus - tool_error_penalty * n["n_model_errors"] - call_cost * n["n_ok"]
    return {"tool": r, **{k: float(v) for k, v in n.items()}}
