"""The PARA-GRPO reward ``R = R_acc + w_fmt · R_fmt + R_tool`` and its breakdown.

``score`` scores one main trajectory; ``score_groups`` fills ``reward`` and
``reward_breakdown`` of every main trajectory of a rollout and gives each sub-agent trajectory
its parent's reward (sub-agents are trained with the main agent's advantage; see
``AlgoConfig.train_sub_agents``).
"""

from __future__ import annotations

from paravt.config import RewardConfig
from paravt.rewards import reference
from paravt.rewards.accuracy import accuracy
from paravt.rewards.format import format_reward
from paravt.rewards.tool import call_counts, tool_reward
from paravt.types import Group, Sample, Trajectory


def full_text(traj: Trajectory) -> str:
    """Forced text + generated text of every turn, in order: what accuracy is read from.

    Falls back to ``traj.answer_text`` for trajectories without turns.
    """
    if not traj.turns:
        return traj.answer_text
    return "".join(t.prefix + t.text for t in traj.turns)


def score(traj: Trajectory, sample: Sample, cfg: RewardConfig) -> dict[str, float]:
    """Reward breakdown of one main trajectory.

    Keys: ``total``, ``acc``, ``has_answer`` (+ ``em``/``f1`` for oe, ``iou`` for tvg), ``fmt``,
    ``fmt_base``, ``anchor``, ``think_closed``, ``flow``, ``unclosed_think``, ``tool``,
    ``n_calls``, ``n_ok``, ``n_model_errors``, ``n_system_errors``, ``num_turns``, ``forced``.
    """
    if traj.role != "main":
        raise ValueError(
            f"trajectory {traj.uid} is a {traj.role} agent; score its parent main trajectory "
            "(sub-agents share the parent's reward via score_groups)"
        )
    # The reference's parts read what the policy generated (paravt.rewards.reference).
    ref_text = reference.completion(traj.turns) if traj.turns else traj.answer_text
    if cfg.answer_extraction == "reference":
        out = accuracy(ref_text, sample, oe_metric=cfg.oe_metric, extract=reference.extract_answer)
    else:
        out = accuracy(full_text(traj), sample, oe_metric=cfg.oe_metric)
    out.update(format_reward(traj.turns, lambda_anchor=cfg.lambda_anchor, base=cfg.base_format))
    if cfg.tool_mode == "reference":
        out["tool"] = reference.tool_reward(ref_text, out["acc"])
        out.update({k: float(v) for k, v in call_counts(traj).items()})
    else:
        out.update(
            tool_reward(
                traj,
                out["acc"],
                tool_bonus=cfg.tool_bonus,
                tool_error_penalty=cfg.tool_error_penalty,
                correct_threshold=cfg.tool_correct_threshold,
            )
        )
    out["num_turns"] = float(len(traj.turns))
    out["forced"] = float(any(t.forced_answer for t in traj.turns))
    out["total"] = out["acc"] + cfg.w_fmt * out["fmt"] + out["tool"]
    return out


def score_groups(groups: list[Group], cfg: RewardConfig) -> None:
    """Fill ``reward``/``reward_breakdown`` of all main trajectories; sub-agents copy their
    parent's (matched by ``Trajectory.parent``)."""
    for g in groups:
        by_uid: dict[str, Trajectory] = {}
        for t in g.trajectories:
            t.reward_breakdown = score(t, g.sample, cfg)
            t.reward = t.reward_breakdown["total"]
            by_uid[t.uid] = t
        for s in g.sub_trajectories:
            parent = by_uid.get(s.parent or "")
            if parent is None:
                raise ValueError(
                    f"sub-agent trajectory {s.uid} names parent {s.parent!r}, which is not a main "
                    f"trajectory of group {g.group_id}; keep sub-agents with their parent's group"
                )
            s.reward = parent.reward
            s.reward_breakdown = dict(parent.reward_breakdown)
