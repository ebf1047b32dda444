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

KL as a reward (``algo.kl_mode == 'reward'``, ``apply_kl_reward``): after packing, each trained
token ``t`` of a row gets the reward ``r_t = -β KL_k(μ_t, π_ref,t)`` (``μ`` the behaviour
log-probs) and its advantage becomes ``A + sum_{t' >= t, m_t' = 1} r_t'`` — the return-to-go
of the KL rewards with γ = λ = 1 and no critic, which is what AReaL's ``compute_advantages``
does with ``kl_ctl`` (there the group-normalised score sits on the last token, so every token
sees it, as ``A`` does here). The penalty is *not* divided by the group std: a group whose
task rewards are all equal keeps a small, KL-only advantage instead of one amplified to ±1.
"""

from __future__ import annotations

import torch

from paravt.config import AlgoConfig
from paravt.types import Group, PackedBatch, SequenceUnit, Trajectory


def group_advantages(
    groups: list[Group], algo: AlgoConfig, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``(sum_g G_g,)`` float32 advantages of every main trajectory, groups in order, computed
    on ``device`` by the ``paravt_kernels`` op: on a CUDA device (the trainer's, ``train_step``
    via ``build_units``) its Triton kernel runs (``PARAVT_IMPL=auto``), elsewhere its torch
    path."""
    # lazy: looked up per call, so a swapped paravt_kernels op is the one used
    from paravt_kernels import group_advantage

    rewards = [t.reward for g in groups for t in g.trajectories]
    index = [gi for gi, g in enumerate(groups) for _ in g.trajectories]
    if not rewards:
        return torch.zeros(0, device=device)
    return group_advantage(
        torch.tensor(rewards, dtype=torch.float32, device=device),
        torch.tensor(index, dtype=torch.int64, device=device),
        normalize_std=algo.normalize_std,
        eps=algo.adv_eps,
        scale=algo.adv_scale,
        bias=algo.adv_bias,
    )


def build_units(
    groups: list[Group], algo: AlgoConfig, device: torch.device | str = "cpu"
) -> list[SequenceUnit]:
    """Main trajectories (+ their sub-agents when ``algo.train_sub_agents``) with advantages
    (``group_advantages`` on ``device``: the trainer passes its own)."""
    adv = group_advantages(groups, algo, device).tolist()
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


def apply_kl_reward(batch: PackedBatch, algo: AlgoConfig) -> torch.Tensor:
    """KL to the reference as a per-token reward penalty (``algo.kl_mode == 'reward'``).

    Needs ``batch.ref_logprobs`` ``(N,)`` (log π_ref, scored under each row's own
    sampling parameters). With ``m`` the loss mask, ``μ`` the behaviour log-probs and
    ``k_t = m_t · KL_k(μ_t, ref_t)`` (``algo.kl_type``; k1: ``μ_t - ref_t``), it shifts
    ``batch.advantages`` in place, per row ``s``::

        A_t <- A_t - β · sum_{t' >= t, t' in s} k_t'          (β = algo.kl_coef)

    and returns the ``(B,)`` float32 total penalty ``β · sum_{t in s} k_t`` of each row (what
    its first trained token's advantage moved by; logged as ``kl_penalty``). In
    ``kl_mode == 'loss'`` or with ``kl_coef == 0`` it changes nothing and returns zeros.
    Tokens with ``m_t = 0`` add no penalty (their own advantage is shifted too, but they are
    outside the loss).
    """
    # lazy: looked up per call, so a swapped paravt_kernels op is the one used
    from paravt_kernels.policy_loss_reference import kl_penalty

    n_seq = batch.cu_seqlens.numel() - 1
    if algo.kl_mode != "reward" or algo.kl_coef == 0.0:
        return torch.zeros(n_seq)
    ref = batch.ref_logprobs
    if ref is None:
        raise ValueError(
            "algo.kl_mode=reward needs batch.ref_logprobs (the frozen reference's "
            "log-probs); the trainer fills it when algo.kl_coef != 0"
        )
    mask = batch.loss_mask.float()
    pen = algo.kl_coef * kl_penalty(batch.old_logprobs.float(), ref.float().cpu(), algo.kl_type)
    # where, not a product: with top_p < 1 the reference gives -inf to forced tokens outside
    # its nucleus, and inf * 0 = NaN would spread through the return-to-go.
    pen = torch.where(mask > 0, pen, torch.zeros_like(pen))
    cu = batch.cu_seqlens.long().tolist()
    totals = torch.zeros(n_seq)
    adv = batch.advantages.float().clone()
    for i in range(n_seq):
        a, e = cu[i], cu[i + 1]
        togo = pen[a:e].flip(0).cumsum(0).flip(0)  # sum over t' >= t within the row
        adv[a:e] -= togo
        totals[i] = togo[0] if e > a else 0.0
    batch.advantages = adv
    return totals
