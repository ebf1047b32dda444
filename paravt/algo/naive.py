"""The materialised log-prob path: the reference the trainer's fused path is checked against.

Nothing on the training path calls this module. It is what the trainer did before the fused
path: one forward per sequence through the whole HF model (the lm_head over EVERY position,
prompt and visual tokens included), float32 ``(L, V)`` ``log_softmax(top_p(logits / T))``,
gather, then the objective on that sequence, its backward, and the next sequence. It is kept
because a fast path needs a plain one to be compared with:

* ``tests/test_algo_logprobs.py`` checks that one PPO minibatch gives the same loss and the
  same gradient for every parameter through both paths;
* ``bench/test_bench_train_logprob_phase.py`` measures the fused path's peak memory and time
  against this one on the same inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paravt.algo.logprobs import row_sampling
from paravt.algo.loss import (
    MinibatchResult,
    PolicyObjective,
    agg_denominator,
    minibatch_backward,
)
from paravt.algo.packing import select_sequences
from paravt.models.sampling import sampling_logprobs
from paravt.types import PackedBatch, VisualInputs
from paravt.vision.preprocess import build_model_inputs


def materialised_sequence_logprobs(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    visuals: VisualInputs | None,
    temperature: float,
    top_p: float,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(L,)`` log-probs (position 0: 0) of one sequence from its full ``(L, V)`` logits, and
    with ``with_entropy`` the ``(L,)`` entropy of the same distribution (detached)."""

    p0 = next(model.parameters())
    merge = int(model.config.vision_config.spatial_merge_size)
    inputs = build_model_inputs(
        tokens.tolist(), mm_token_type_ids.tolist(), visuals, p0.device, merge_size=merge,
        dtype=p0.dtype,
    )  # fmt: skip
    logits = model(**inputs, use_cache=False).logits[0, :-1]
    logp = sampling_logprobs(logits, temperature if temperature > 0 else 1.0, top_p)
    lp = logp.gather(-1, inputs["input_ids"][0, 1:, None]).squeeze(-1)
    lp = torch.cat([lp.new_zeros(1), lp])
    if not with_entropy:
        return lp, lp.new_zeros(0)
    with torch.no_grad():
        p = logp.exp()
        ent = -torch.where(p > 0, p * logp, torch.zeros_like(logp)).sum(-1)
    return lp, torch.cat([ent.new_zeros(1), ent])


def materialised_row_logprobs(
    model: torch.nn.Module, batch: PackedBatch, i: int, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``materialised_sequence_logprobs`` of sequence ``i`` under its own T / top-p."""
    a, b = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
    temperature, top_p = row_sampling(batch, i)
    return materialised_sequence_logprobs(
        model, batch.input_ids[a:b], batch.token_types()[a:b], batch.visuals[i],
        temperature, top_p, with_entropy,
    )  # fmt: skip


def materialised_minibatch_backward(
    model: torch.nn.Module,
    batch: PackedBatch,
    objective: PolicyObjective,
    *,
    global_den: float | None = None,
    parts: Sequence[Sequence[int]] | None = None,
) -> MinibatchResult:
    """The pre-fusion policy update of one minibatch: ``minibatch_backward`` with one
    sequence per part (default) and the materialised log-probs, 0 off the loss mask."""
    den = global_den
    if den is None:
        den = agg_denominator(objective.effective_mask(batch), batch, objective.algo.agg)

    def part_loss(seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        view = select_sequences(batch, seqs)
        lps, ents = zip(*(materialised_row_logprobs(model, batch, i, True) for i in seqs))
        lp, ent = torch.cat(lps), torch.cat(ents)
        lp = torch.where(view.loss_mask.to(lp.device) != 0, lp, torch.zeros_like(lp))
        loss, _ = objective(lp, view)
        return loss, lp.detach(), ent

    n = batch.cu_seqlens.numel() - 1
    return minibatch_backward(
        batch, objective, part_loss, parts if parts is not None else [[i] for i in range(n)],
        global_den=den,
    )  # fmt: skip
