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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from paravt.algo.logprobs import gathered_logprobs
from paravt.algo.packing import microbatches, select_sequences, trained_rows
from paravt.config import AlgoConfig
from paravt.models.forward import as_root_forward, backbone_and_head, packed_hidden_rows
from paravt.types import PackedBatch


class PolicyObjective:
    """Base: ``__call__(logprob, batch) -> (loss, stats)``; ``needs_prox`` asks the trainer
    for ``batch.prox_logprobs`` (and ``needs_ref`` for ``batch.ref_logprobs``)."""

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
        ref = batch.ref_logprobs
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
        # lazy: looked up per call, so a swapped paravt_kernels op is the one used
        from paravt_kernels import policy_loss

        d = logprob.device
        return policy_loss(
            logprob,
            batch.old_logprobs.to(d),
            batch.advantages.to(d),
            batch.loss_mask.to(d),
            **self._kwargs(batch, d),
        )

    def fused(
        self,
        hidden: torch.Tensor,
        head: torch.nn.Module,
        rows: PackedBatch,
        temperatures: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The objective straight from the hidden rows that predict ``rows``' tokens
        (``trained_rows``), through ``paravt_kernels.linear_policy_loss`` (lm_head inside,
        ``temperatures`` ``(n,)`` per row): ``(loss, logprob (n,), entropy (n,))``, the last
        two detached. The same inputs as ``__call__`` feeds ``policy_loss``."""
        # lazy: looked up per call, so a swapped paravt_kernels op is the one used
        from paravt_kernels import linear_policy_loss

        d = hidden.device
        loss, _, lp, ent = linear_policy_loss(
            hidden, head.weight, rows.input_ids.to(d), rows.old_logprobs.to(d),
            rows.advantages.to(d), rows.loss_mask.to(d), temperature=temperatures.to(d),
            bias=head.bias, **self._kwargs(rows, d),
        )  # fmt: skip
        return loss, lp, ent


class PPOClip(PolicyObjective):
    """PPO-clip against the behaviour log-probs (GRPO as in the reference recipe)."""


class DecoupledPPO(PolicyObjective):
    """Decoupled PPO: clip against the proximal policy, capped behaviour importance weight."""

    needs_prox: ClassVar[bool] = True

    def effective_mask(self, batch: PackedBatch) -> torch.Tensor:
        mask = batch.loss_mask.float()
        if self.algo.behav_cap is None:
            return mask
        w = torch.exp(batch.prox_logprobs.float().cpu() - batch.old_logprobs.float())
        return torch.where(w > self.algo.behav_cap, 0.0, mask)

    def _kwargs(self, batch: PackedBatch, device: torch.device) -> dict:
        if batch.prox_logprobs is None:
            raise ValueError(
                "algo.loss=decoupled needs the proximal log-probs in batch.prox_logprobs "
                "(a no-grad forward before the update); the trainer fills it"
            )
        return {
            **super()._kwargs(batch, device),
            "prox_logprob": batch.prox_logprobs.to(device),
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


# part_loss(seqs) -> (loss, logprob, entropy): the objective aggregated over the sequences
# ``seqs`` of the minibatch ALONE (with grad), and their per-token log-probs / entropy
# ``(sum_i L_i,)`` in the order of ``seqs`` (detached, 0 off the trained tokens).
PartLossFn = Callable[[list[int]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def minibatch_backward(
    batch: PackedBatch,
    objective: PolicyObjective,
    part_loss: PartLossFn,
    parts: Sequence[Sequence[int]],
    *,
    global_den: float,
    world: int = 1,
    num_parts: int = 0,
) -> MinibatchResult:
    """Accumulate the minibatch's policy gradient one part (micro-batch) at a time.

    The aggregated loss is a sum over sequences, ``L = sum_s (d_s / D) L_s`` with ``L_s`` the
    objective on sequence ``s`` alone and ``d_s`` its share of the normaliser
    (``sequence_denominators``). The objective over a part ``P`` alone is
    ``L_P = sum_{s in P} d_s L_s / D_P`` with ``D_P = sum_{s in P} d_s``, so each part is
    forwarded, scaled by ``D_P / D`` and back-propagated on its own: peak memory is one part's
    activations (gradient accumulation), and the sum of the gradients equals the gradient of
    the whole minibatch's loss exactly. ``D`` is the *global* normaliser (summed over ranks)
    and the factor ``world`` undoes FSDP's gradient averaging.

    ``parts`` covers every sequence once (``paravt.algo.packing.microbatches``: a token budget
    per part on the trainer's path; one sequence per part in the materialised reference,
    ``paravt.algo.naive``). ``num_parts`` > ``len(parts)`` pads with zero-weight
    forward/backward passes over part 0: under FSDP every rank must run the same number of
    forwards (each one all-gathers parameters).
    """
    cu = batch.cu_seqlens.tolist()
    eff = objective.effective_mask(batch)
    dens = sequence_denominators(eff, batch, objective.algo.agg)
    covered = sorted(i for p in parts for i in p)
    if covered != list(range(len(cu) - 1)):
        raise ValueError(f"parts {list(map(list, parts))} must cover each sequence exactly once")
    logprobs = torch.zeros(batch.input_ids.numel())
    entropy = torch.zeros(batch.input_ids.numel())
    loss_num = 0.0
    for k in range(max(len(parts), num_parts)):
        real = k < len(parts)
        seqs = list(parts[k if real else 0])
        loss_p, lp, ent = part_loss(seqs)
        d_p = float(dens[seqs].sum())
        coef = world * d_p / global_den if (real and global_den > 0) else 0.0
        (loss_p * coef).backward()
        if not real:
            continue
        loss_num += float(loss_p.detach()) * d_p
        o = 0
        for i in seqs:
            n = cu[i + 1] - cu[i]
            logprobs[cu[i] : cu[i + 1]] = lp[o : o + n].detach().float().cpu()
            if ent.numel():
                entropy[cu[i] : cu[i + 1]] = ent[o : o + n].detach().float().cpu()
            o += n
    with torch.no_grad():
        _, st = objective(logprobs, batch)
    return MinibatchResult(
        loss_num=loss_num,
        logprobs=logprobs,
        entropy_sum=float((entropy * eff).sum()),
        entropy_count=float(eff.sum()),
        stats={k: float(v) for k, v in st.items()},
    )


def policy_part_loss(
    model: torch.nn.Module, batch: PackedBatch, objective: PolicyObjective, seqs: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """THE trainer's policy loss of the sequences ``seqs`` of ``batch`` (a ``PartLossFn``):
    one packed backbone forward over them (``paravt.models.forward``: no attention across
    sequences, each its own mrope positions and visual features), the hidden rows that predict
    a trained token gathered (``trained_rows``), and the objective from those rows through
    the fused ``paravt_kernels.linear_policy_loss`` (``PolicyObjective.fused``): no
    ``(tokens, vocab)`` logits, no lm_head forward, each row under its sequence's sampling
    temperature. A part with a ``top_p < 1`` sequence needs the nucleus, which the fused op
    does not do: its rows' log-probs come from ``paravt.algo.logprobs`` on the gathered rows
    (``(n, V)`` logits of those rows only) and the objective from ``policy_loss``.
    Under FSDP2 it runs as a forward of the root unit (lm_head weight gathered). Returns
    ``(loss, logprob, entropy)`` with the last two ``(sum_i L_i,)`` in ``seqs`` order, detached,
    0 off the trained tokens."""
    return as_root_forward(model, _policy_part_loss, batch, objective, list(seqs))


def _policy_part_loss(
    model: torch.nn.Module, batch: PackedBatch, objective: PolicyObjective, seqs: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    view = select_sequences(batch, seqs)
    rows, index = trained_rows(view)
    h = packed_hidden_rows(model, batch, seqs, index - 1)  # row t - 1 predicts token t
    _, head = backbone_and_head(model)
    counts = (rows.cu_seqlens[1:] - rows.cu_seqlens[:-1]).long()
    assert rows.temperatures is not None and rows.top_ps is not None
    temps = torch.where(rows.temperatures > 0, rows.temperatures, 1.0)  # greedy: T = 1
    if bool((rows.top_ps >= 1.0).all()):
        loss, lp_n, ent_n = objective.fused(h, head, rows, temps.repeat_interleave(counts))
    else:
        lp_n, ent_n = gathered_logprobs(head, h, rows, with_entropy=True)
        loss, _ = objective(lp_n, rows)
        if not loss.requires_grad:  # no trained row: keep the backward (FSDP collectives)
            loss = loss + 0.0 * h.sum()
    n = view.input_ids.numel()
    lp = torch.zeros(n).index_copy(0, index, lp_n.detach().float().cpu())
    ent = torch.zeros(n).index_copy(0, index, ent_n.detach().float().cpu())
    return loss, lp, ent


def policy_minibatch_backward(
    model: torch.nn.Module,
    batch: PackedBatch,
    objective: PolicyObjective,
    *,
    global_den: float,
    max_tokens: int,
    world: int = 1,
    parts: Sequence[Sequence[int]] | None = None,
    num_parts: int = 0,
) -> MinibatchResult:
    """The trainer's policy update of one minibatch (``paravt.train.train_step``):
    ``minibatch_backward`` over micro-batches of at most ``max_tokens`` tokens
    (``paravt.algo.packing.microbatches``, or the given ``parts``), each through
    ``policy_part_loss``."""
    if parts is None:
        parts = microbatches(batch, max_tokens)
    return minibatch_backward(
        batch, objective, lambda seqs: policy_part_loss(model, batch, objective, seqs), parts,
        global_den=global_den, world=world, num_parts=num_parts,
    )  # fmt: skip
