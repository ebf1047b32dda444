"""Padding-free batches and the per-token log-probs the loss needs.

``pack_units`` concatenates the token ids of every trajectory (main rows, each followed by its
sub-agent rows) into one ``(N,)`` layout with ``cu_seqlens (B+1,)``: there is no pad token
anywhere, so no compute and no normalisation is spent on padding.

``packed_logprobs`` fills that layout with ``log p_θ(x_t | x_<t) / T``-scaled log-probs:

* **per-sequence path (now, every device)**: one forward per sequence (its own length, its own
  visual inputs), the per-token outputs concatenated into the packed ``(N,)`` vector. HF
  Qwen3-VL with SDPA cannot put several sequences in one row without attending across them,
  so this is the padding-free option available here.
* **varlen path (slot)**: with flash-attn varlen on GPU, one packed forward with
  ``cu_seqlens`` / ``position_ids`` restarting per sequence computes the same vector. It
  plugs in as another ``LogprobFn`` with the same signature; nothing else changes.

Alignment: ``logprob[t]`` is the log-prob of token ``t`` given tokens ``< t`` (position 0 of
each sequence is 0, never trained). ``Trajectory.loss_mask``/``logprobs`` use the same
alignment, so no shifting happens anywhere else.

Sampling parameters: the engine's behaviour log-probs are of ``softmax(top_p(logits / T))``
with the ``T``/``top_p`` of *that row's* request (main agents ``rollout.temperature``,
sub-agents ``rollout.sub_temperature``). The trainer's log-probs must be of the same
distribution for the PPO ratio to be 1 at step start, so each row carries its own
(``Trajectory.temperature``/``top_p`` -> ``PackedBatch.temperatures``/``top_ps``) and every
pass here (policy, proximal, reference) reads them from the batch; no caller passes a
temperature. Scoring a ``T = 0.3`` sub-agent row at the main ``T = 0.7`` put its ratios at
0.5-1.9 before any update.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from paravt.algo.advantages import SequenceUnit
from paravt.types import PackedBatch, Trajectory, VisualInputs

# (model, batch, with_entropy) -> (logprob (N,), entropy (N,) or empty); each sequence under
# its own ``batch.temperatures[i]`` / ``batch.top_ps[i]``.
LogprobFn = Callable[[torch.nn.Module, PackedBatch, bool], tuple[torch.Tensor, torch.Tensor]]


def _mm_types(traj: Trajectory) -> list[int]:
    mm = traj.extras.get("mm_token_type_ids")
    if mm is None:
        return [0] * len(traj.tokens)
    mm = list(mm.tolist() if torch.is_tensor(mm) else mm)
    if len(mm) != len(traj.tokens):
        raise ValueError(
            f"trajectory {traj.uid}: extras['mm_token_type_ids'] has {len(mm)} entries for "
            f"{len(traj.tokens)} tokens; the rollout must keep them aligned"
        )
    return mm


def pack_units(units: Sequence[SequenceUnit]) -> PackedBatch:
    """Pack units (main + sub rows) into one padding-free batch.

    Per-token advantages come from ``paravt_kernels.broadcast_to_tokens``: a main row spreads
    its own group advantage, a sub row (``parent_index >= 0``) its parent's. ``seq_weights`` is
    1 for main rows and ``1/num_sub`` for sub rows. ``temperatures``/``top_ps`` are each row's
    own sampling parameters (a sub-agent's may differ from its parent's).
    """
    from paravt_kernels import broadcast_to_tokens

    seqs: list[Trajectory] = []
    values: list[float] = []
    parents: list[int] = []
    weights: list[float] = []
    for u in units:
        base = len(seqs)
        seqs.append(u.main)
        values.append(u.advantage)
        parents.append(-1)
        weights.append(1.0)
        for s in u.subs:
            seqs.append(s)
            values.append(0.0)  # replaced by the parent's value in broadcast_to_tokens
            parents.append(base)
            weights.append(u.sub_weight)
    lengths = torch.tensor([len(t.tokens) for t in seqs], dtype=torch.int64)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    n = int(cu[-1])
    adv = broadcast_to_tokens(
        torch.tensor(values, dtype=torch.float32),
        cu,
        parent_index=torch.tensor(parents, dtype=torch.int64),
        total_tokens=n,
    )
    cat_i = [x for t in seqs for x in t.tokens]
    return PackedBatch(
        input_ids=torch.tensor(cat_i, dtype=torch.int64),
        cu_seqlens=cu,
        loss_mask=torch.tensor([x for t in seqs for x in t.loss_mask], dtype=torch.float32),
        old_logprobs=torch.tensor([x for t in seqs for x in t.logprobs], dtype=torch.float32),
        advantages=adv.float(),
        seq_weights=torch.tensor(weights, dtype=torch.float32),
        temperatures=torch.tensor([t.temperature for t in seqs], dtype=torch.float32),
        top_ps=torch.tensor([t.top_p for t in seqs], dtype=torch.float32),
        uids=[t.uid for t in seqs],
        visuals=[t.visuals for t in seqs],
        extras={
            "mm_token_type_ids": torch.tensor(
                [x for t in seqs for x in _mm_types(t)], dtype=torch.int64
            ),
            "parent_index": torch.tensor(parents, dtype=torch.int64),
            "roles": [t.role for t in seqs],
        },
    )


def split_units(units: Sequence[SequenceUnit], n: int) -> list[list[SequenceUnit]]:
    """``n`` contiguous minibatches of units (sizes differ by at most one; none empty)."""
    if n < 1:
        raise ValueError(f"minibatches={n} must be >= 1")
    n = min(n, max(1, len(units)))
    q, r = divmod(len(units), n)
    out, i = [], 0
    for k in range(n):
        size = q + (1 if k < r else 0)
        out.append(list(units[i : i + size]))
        i += size
    return out


def sequence_logprobs(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    visuals: VisualInputs | None,
    temperature: float,
    with_entropy: bool = False,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: ``(L,)`` log-probs of each token given its prefix (position 0 → 0) under
    the engine's sampling distribution ``log_softmax(top_p(logits / T))``
    (``paravt.rollout.hf.sampling_logprobs``), and (optionally, no grad) the ``(L,)`` entropy
    ``H = -sum_v p_v log p_v`` of that distribution at the position that predicted the token.
    """
    from paravt.rollout.hf import sampling_logprobs
    from paravt.vision.preprocess import build_model_inputs

    p0 = next(model.parameters())
    merge = int(model.config.vision_config.spatial_merge_size)
    inputs = build_model_inputs(
        tokens.tolist(), mm_token_type_ids.tolist(), visuals, p0.device, merge_size=merge,
        dtype=p0.dtype,
    )  # fmt: skip
    logits = model(**inputs, use_cache=False).logits[0, :-1]
    logp = sampling_logprobs(logits, temperature, top_p)  # (L-1, V) float32
    tgt = inputs["input_ids"][0, 1:]
    lp = logp.gather(-1, tgt[:, None]).squeeze(-1)
    zero = lp.new_zeros(1)
    lp = torch.cat([zero, lp])
    if not with_entropy:
        return lp, lp.new_zeros(0)
    with torch.no_grad():
        lq = logp.detach()
        p = lq.exp()
        # Tokens outside the nucleus have p = 0 and log p = -inf: they add 0, not NaN.
        ent = -torch.where(p > 0, p * lq, torch.zeros_like(lq)).sum(-1)
        ent = torch.cat([zero.detach(), ent])
    return lp, ent


def row_sampling(batch: PackedBatch, i: int) -> tuple[float, float]:
    """``(temperature, top_p)`` sequence ``i`` of ``batch`` was sampled with."""
    if batch.temperatures is None or batch.top_ps is None:
        raise ValueError(
            "PackedBatch.temperatures/top_ps are None: a log-prob pass needs each row's sampling "
            "parameters; build batches with pack_units (it copies Trajectory.temperature/top_p)"
        )
    return float(batch.temperatures[i]), float(batch.top_ps[i])


def row_logprobs(
    model: torch.nn.Module, batch: PackedBatch, i: int, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sequence_logprobs`` of sequence ``i`` of ``batch`` under its own sampling parameters
    (``row_sampling``). The trainer's per-sequence policy forward (``train_step``) and every
    packed pass (``packed_logprobs``: proximal, reference) go through here."""
    cu = batch.cu_seqlens
    a, b = int(cu[i]), int(cu[i + 1])
    temperature, top_p = row_sampling(batch, i)
    mm = batch.extras["mm_token_type_ids"][a:b]
    return sequence_logprobs(
        model, batch.input_ids[a:b], mm, batch.visuals[i], temperature, with_entropy, top_p
    )


def per_sequence_logprobs(
    model: torch.nn.Module, batch: PackedBatch, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Padding-free packed log-probs ``(N,)`` (and entropy) from one forward per sequence."""
    lps, ents = [], []
    for i in range(batch.cu_seqlens.numel() - 1):
        lp, ent = row_logprobs(model, batch, i, with_entropy)
        lps.append(lp)
        ents.append(ent)
    # Results stay on the model's device (the loss runs there too).
    empty = torch.zeros(0)
    return (torch.cat(lps) if lps else empty), (torch.cat(ents) if with_entropy else empty)


# The log-prob path in use. A flash-attn varlen forward would be registered here on GPU.
LOGPROB_PATHS: dict[str, LogprobFn] = {"per_sequence": per_sequence_logprobs}


def packed_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    with_entropy: bool = False,
    path: str = "per_sequence",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to a registered ``LogprobFn`` (see the module docstring); each sequence is
    scored under its own ``batch.temperatures[i]`` / ``batch.top_ps[i]``."""
    if path not in LOGPROB_PATHS:
        raise ValueError(f"log-prob path '{path}' is not one of {sorted(LOGPROB_PATHS)}")
    return LOGPROB_PATHS[path](model, batch, with_entropy)


def concat_packed(batches: Sequence[PackedBatch]) -> PackedBatch:
    """Concatenate packed batches (e.g. every rank's share of a step) into one."""
    cus, off = [torch.zeros(1, dtype=torch.int32)], 0
    for b in batches:
        cus.append(b.cu_seqlens[1:].to(torch.int32) + off)
        off += int(b.cu_seqlens[-1])
    n = off
    extras: dict = {}
    for k in batches[0].extras:
        vals = [b.extras[k] for b in batches]
        if all(torch.is_tensor(v) and v.dim() == 1 for v in vals):
            if k == "parent_index":  # sequence-level; re-base parents onto the merged rows
                shifted, base = [], 0
                for b, v in zip(batches, vals):
                    shifted.append(torch.where(v >= 0, v + base, v))
                    base += b.cu_seqlens.numel() - 1
                extras[k] = torch.cat(shifted)
            else:
                extras[k] = torch.cat(vals)
        elif all(isinstance(v, list) for v in vals):
            extras[k] = [x for v in vals for x in v]
    out = PackedBatch(
        input_ids=torch.cat([b.input_ids for b in batches]),
        cu_seqlens=torch.cat(cus),
        loss_mask=torch.cat([b.loss_mask for b in batches]),
        old_logprobs=torch.cat([b.old_logprobs for b in batches]),
        advantages=torch.cat([b.advantages for b in batches]),
        seq_weights=torch.cat([b.seq_weights for b in batches]),
        temperatures=_cat_optional([b.temperatures for b in batches]),
        top_ps=_cat_optional([b.top_ps for b in batches]),
        uids=[u for b in batches for u in b.uids],
        visuals=[v for b in batches for v in b.visuals],
        extras=extras,
    )
    assert out.input_ids.numel() == n
    return out


def _cat_optional(parts: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    return None if any(p is None for p in parts) else torch.cat(parts)  # type: ignore[arg-type]
