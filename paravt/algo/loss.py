"""PARA-GRPO policy objectives, assembled over ``paravt_kernels.policy_loss``.

The maths (ratio, clips, behaviour weight, KL estimators, aggregation) lives only in the
kernel op; this module decides *what* is fed to it. Two objectives, picked by ``algo.loss``:

``ppo`` — PPO-clip against the behaviour policy μ (the engine's log-probs)::

    r_t = π_θ(x_t) / μ(x_t)
    l_t = max(-A r_t, -A clip(r_t, 1-ε_low, 1+ε_high))     [dual clip: min(l_t, -A c) if A<0]
        + β KL_k(π_θ || π_ref)

``decoupled`` — clip against the proximal policy π_prox (the weights before this step's
updates, one no-grad forward) and correct for μ ≠ π_prox with a capped importance weight::

    r_t = π_θ / π_prox,  w_t = π_prox / μ  (tokens with w_t > behav_cap leave the loss)
    l_t = w_t · max(-A r_t, -A clip(r_t, ...)) + β KL_k

The ``+ β KL_k`` term is there only with ``algo.kl_mode == 'loss'``. With ``'reward'`` the KL
to π_ref is a per-token reward penalty already inside ``batch.advantages``
(``paravt.algo.advantages.apply_kl_reward``) and the loss has no KL term; the reference's
log-probs are still passed to the op with ``kl_coef = 0`` so ``kl_mean`` keeps reporting
KL(π_θ || π_ref).

Aggregation (``algo.agg``) over the minibatch with per-sequence weights (sub-agent rows 1/n):
token-mean | seq-mean-token-mean | seq-mean-token-sum (see ``AlgoConfig.agg`` for the biases).

Across ranks: FSDP averages gradients over ``W`` ranks, and each rank only sees its own
sequences, so a rank's locally-normalised loss is rescaled by ``W · D_local / D_global`` where
``D`` is the aggregation's denominator (weighted token count, or weighted sequence count);
then the averaged gradient equals the single-process gradient of the global minibatch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from paravt.config import AlgoConfig
from paravt.types import PackedBatch


class PolicyObjective:
    """Base: ``__call__(logprob, batch) -> (loss, stats)``; ``needs_prox`` asks the trainer
    for ``batch.extras['prox_logprobs']`` (and ``needs_ref`` for ``'ref_logprobs'``)."""

    needs_prox: ClassVar[bool] = False

    def __init__(self, algo: AlgoConfig) -> None:
        self.algo = algo

    @property
    def needs_ref(self) -> bool:
        """A reference model is needed (for the loss term or the reward penalty)."""
        return self.algo.kl_coef != 0.0

    @property
    def kl_in_loss(self) -> bool:
        """The KL is a loss term (``algo.kl_mode == 'loss'``), not a reward penalty."""
        return self.needs_ref and self.algo.kl_mode == "loss"

    def _kwargs(self, batch: PackedBatch, device: torch.device) -> dict:
        a = self.algo
        ref = batch.extras.get("ref_logprobs")
        return {
            "ref_logprob": ref.to(device) if (ref is not None and self.needs_ref) else None,
            "clip_low": a.clip_low,
            "clip_high": a.clip_high,
            "dual_clip": a.dual_clip,
            "kl_coef": a.kl_coef if self.kl_in_loss else 0.0,
            "kl_type": a.kl_type,
            "agg": a.agg,
            "cu_seqlens": batch.cu_seqlens.to(device),
            "seq_weights": batch.seq_weights.to(device),
        }

    def effective_mask(self, batch: PackedBatch) -> torch.Tensor:
        """The tokens the loss averages over (the kernel's final mask), ``(N,)`` float32."""
        return batch.loss_mask.float()

    def __call__(
        self, logprob: torch.Tensor, batch: PackedBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        from paravt_kernels import policy_loss

        d = logprob.device
        return policy_loss(
            logprob,
            batch.old_logprobs.to(d),
            batch.advantages.to(d),
            batch.loss_mask.to(d),
            **self._kwargs(batch, d),
        )


class PPOClip(PolicyObjective):
    """PPO-clip against the behaviour log-probs (GRPO as in the reference recipe)."""


class DecoupledPPO(PolicyObjective):
    """Decoupled PPO: clip against the proximal policy, capped behaviour importance weight."""

    needs_prox: ClassVar[bool] = True

    def effective_mask(self, batch: PackedBatch) -> torch.Tensor:
        mask = batch.loss_mask.float()
        if self.algo.behav_cap is None:
            return mask
        w = torch.exp(batch.extras["prox_logprobs"].float().cpu() - batch.old_logprobs.float())
        return torch.where(w > self.algo.behav_cap, 0.0, mask)

    def _kwargs(self, batch: PackedBatch, device: torch.device) -> dict:
        if "prox_logprobs" not in batch.extras:
            raise ValueError(
                "algo.loss=decoupled needs the proximal log-probs in batch.extras"
                "['prox_logprobs'] (a no-grad forward before the update); the trainer fills it"
            )
        return {
            **super()._kwargs(batch, device),
            "prox_logprob": batch.extras["prox_logprobs"].to(device),
            "behav_cap": self.algo.behav_cap,
        }


OBJECTIVES: dict[str, type[PolicyObjective]] = {"ppo": PPOClip, "decoupled": DecoupledPPO}


def make_objective(algo: AlgoConfig) -> PolicyObjective:
    if algo.loss not in OBJECTIVES:
        raise ValueError(f"algo.loss='{algo.loss}' is not one of {sorted(OBJECTIVES)}")
    return OBJECTIVES[algo.loss](algo)


def sequence_denominators(mask: torch.Tensor, batch: PackedBatch, agg: str) -> torch.Tensor:
    """Each sequence's share ``d_s`` of the aggregation's normaliser ``D = sum_s d_s``, ``(B,)``:
    token-mean ``d_s = w_s M_s``; seq-mean-* ``d_s = w_s [M_s > 0]`` (``M_s`` = mask mass)."""
    cu = batch.cu_seqlens.long().cpu()
    lengths = cu[1:] - cu[:-1]
    sid = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    m_seq = torch.zeros(lengths.numel()).index_add_(0, sid, mask.float().cpu())
    w = batch.seq_weights.float().cpu()
    return w * m_seq if agg == "token-mean" else w * (m_seq > 0).float()


def agg_denominator(mask: torch.Tensor, batch: PackedBatch, agg: str) -> float:
    """The aggregation's normaliser ``D`` on this rank (see ``aggregation_weights``):
    token-mean: ``sum_t w_s(t) m_t``; seq-mean-*: ``sum_s w_s [M_s > 0]``."""
    return float(sequence_denominators(mask, batch, agg).sum())


@dataclass
class MinibatchResult:
    """What one minibatch's backward leaves behind (local to this rank)."""

    loss_num: float  # sum_s d_s * loss_s: the global loss is all_reduce(loss_num) / D_global
    logprobs: torch.Tensor  # (N,) detached policy log-probs used for the update
    entropy_sum: float  # sum of per-token entropy over loss-mask tokens
    entropy_count: float
    stats: dict[str, float]  # policy_loss stats over the whole local minibatch (no grad)


def minibatch_backward(
    batch: PackedBatch,
    objective: PolicyObjective,
    seq_logprobs: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    *,
    global_den: float,
    world: int = 1,
    num_forwards: int = 0,
) -> MinibatchResult:
    """Accumulate the minibatch's policy gradient one sequence at a time.

    The aggregated loss is a sum over sequences, ``L = sum_s (d_s / D) L_s`` with ``L_s`` the
    objective on sequence ``s`` alone and ``d_s`` its share of the normaliser
    (``sequence_denominators``), so each sequence is forwarded, scaled and back-propagated on
    its own: peak memory is one sequence's activations (gradient accumulation), and the sum
    of the gradients equals the gradient of the packed loss exactly. ``D`` is the *global*
    normaliser (summed over ranks) and the factor ``world`` undoes FSDP's gradient averaging.

    ``seq_logprobs(i)`` returns sequence ``i``'s ``(L_i,)`` log-probs (with grad) and entropy.
    ``num_forwards`` > B pads with zero-weight forward/backward passes over sequence 0: under
    FSDP every rank must run the same number of forwards (each one all-gathers parameters).
    """
    cu = batch.cu_seqlens.tolist()
    n_seq = len(cu) - 1
    eff = objective.effective_mask(batch)
    dens = sequence_denominators(eff, batch, objective.algo.agg)
    lps: list[torch.Tensor] = []
    loss_num, ent_sum = 0.0, 0.0
    for i in range(max(n_seq, num_forwards)):
        real = i < n_seq
        j = i if real else 0
        lp, ent = seq_logprobs(j)
        part = sequence_view(batch, j)
        loss_s, _ = objective(lp, part)
        coef = world * float(dens[j]) / global_den if (real and global_den > 0) else 0.0
        (loss_s * coef).backward()
        if real:
            lps.append(lp.detach())
            loss_num += float(loss_s.detach()) * float(dens[j])
            if ent.numel():
                ent_sum += float((ent.detach().cpu() * eff[cu[j] : cu[j + 1]]).sum())
    logprobs = torch.cat(lps).cpu() if lps else torch.zeros(0)
    with torch.no_grad():
        _, st = objective(logprobs, batch)
    return MinibatchResult(
        loss_num=loss_num,
        logprobs=logprobs,
        entropy_sum=ent_sum,
        entropy_count=float(eff.sum()),
        stats={k: float(v) for k, v in st.items()},
    )


def sequence_view(batch: PackedBatch, i: int) -> PackedBatch:
    """Sequence ``i`` of a packed batch as a one-sequence ``PackedBatch`` (tensor slices)."""
    cu = batch.cu_seqlens
    a, b = int(cu[i]), int(cu[i + 1])
    extras = {}
    for k, v in batch.extras.items():
        if torch.is_tensor(v) and v.dim() == 1 and v.numel() == batch.input_ids.numel():
            extras[k] = v[a:b]
    return PackedBatch(
        input_ids=batch.input_ids[a:b],
        cu_seqlens=torch.tensor([0, b - a], dtype=cu.dtype),
        loss_mask=batch.loss_mask[a:b],
        old_logprobs=batch.old_logprobs[a:b],
        advantages=batch.advantages[a:b],
        seq_weights=batch.seq_weights[i : i + 1],
        temperatures=None if batch.temperatures is None else batch.temperatures[i : i + 1],
        top_ps=None if batch.top_ps is None else batch.top_ps[i : i + 1],
        uids=batch.uids[i : i + 1],
        visuals=batch.visuals[i : i + 1],
        extras=extras,
    )
