"""Group-relative advantages (GRPO), spread over main and sub-agent trajectories.

For the G main trajectories of one prompt with rewards ``r_1..r_G`` (``paravt_kernels``):

    A_i = (r_i - mean(r)) / (std(r) + eps) * scale + bias        (normalize_std, GRPO)
    A_i = (r_i - mean(r)) * scale + bias                          (Dr. GRPO)

A group of one has no relative signal (A = 0). The advantage is constant over the tokens of a
trajectory — "GRPO is REINFORCE with a group-mean baseline", the per-token credit is all in the
PPO ratio. Sub-agent trajectories (crops examined by the same weights) share their main
trajectory's reward and therefore its advantage; each sub-agent row of a main trajectory with
``n`` sub-agents gets sequence weight ``1/n``, so a trajectory's total sub-agent gradient does
not grow with the number of crops it requested (the reference's weight did).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paravt.config import AlgoConfig
from paravt.types import Group, Trajectory


@dataclass
class SequenceUnit:
    """One main trajectory and the sub-agent trajectories it spawned (trained together).

    ``advantage`` is the main trajectory's group-relative advantage; ``sub_weight`` the loss
    weight of each sub row (1/len(subs)). Minibatches are cut between units, never inside one,
    so a sub row always finds its parent in the same packed batch.
    """

    main: Trajectory
    subs: list[Trajectory]
    advantage: float
    group_id: int

    @property
    def sub_weight(self) -> float:
        return 1.0 / len(self.subs) if self.subs else 0.0

    @property
    def sequences(self) -> list[Trajectory]:
        return [self.main, *self.subs]


def group_advantages(groups: list[Group], algo: AlgoConfig) -> torch.Tensor:
    """``(sum_g G_g,)`` float32 advantages of every main trajectory, groups in order."""
    from paravt_kernels import group_advantage

    rewards = [t.reward for g in groups for t in g.trajectories]
    index = [gi for gi, g in enumerate(groups) for _ in g.trajectories]
    if not rewards:
        return torch.zeros(0)
    return group_advantage(
        torch.tensor(rewards, dtype=torch.float32),
        torch.tensor(index, dtype=torch.int64),
        normalize_std=algo.normalize_std,
        eps=algo.adv_eps,
        scale=algo.adv_scale,
        bias=algo.adv_bias,
    )


def build_units(groups: list[Group], algo: AlgoConfig) -> list[SequenceUnit]:
    """Main trajectories (+ their sub-agents when ``algo.train_sub_agents``) with advantages."""
    adv = group_advantages(groups, algo).tolist()
    units: list[SequenceUnit] = []
    k = 0
    for g in groups:
        subs_of: dict[str, list[Trajectory]] = {}
        for s in g.sub_trajectories:
            subs_of.setdefault(s.parent or "", []).append(s)
        for t in g.trajectories:
            subs = subs_of.get(t.uid, []) if algo.train_sub_agents else []
            units.append(SequenceUnit(t, subs, float(adv[k]), g.group_id))
            k += 1
    return units
