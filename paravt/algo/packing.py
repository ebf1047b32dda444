"""Padding-free batches and the per-token log-probs the loss needs.

``pack_units`` concatenates the token ids of every trajectory (main rows, each followed by its
sub-agent rows) into one ``(N,)`` layout with ``cu_seqlens (B+1,)``: there is no pad token
anywhere, so no compute and no normalisation is spent on padding.

``packed_logprobs`` fills that layout with ``log p_θ(x_t | x_<t)`` under each row's sampling
distribution, for the trained tokens (``loss_mask != 0``) only, 0 elsewhere. Every log-prob
goes through ONE function, ``sequence_logprobs``: the model's backbone gives hidden states,
only the rows that predict a trained token go through the lm_head, inside
``paravt_kernels.linear_logprob`` (temperature inside the kernel): no ``(tokens, vocab)``
logits for the prompt, the visual tokens or anything else (``top_p < 1`` materialises the
logits of the gathered rows only).

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

import types
from collections.abc import Callable, Sequence
from typing import Any

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
    tokens: Sequence[int] | torch.Tensor,
    mm_token_type_ids: Sequence[int] | torch.Tensor | None,
    visuals: VisualInputs | None,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    target_mask: torch.Tensor | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """THE teacher-forced log-prob of one sequence: one backbone forward, no ``(L, V)`` logits.

    Returns ``(L,)`` float32 ``lp`` with ``lp[t] = log p(x_t | x_<t)`` under the engine's
    sampling distribution ``log_softmax(top_p(logits / T))``
    (``paravt.rollout.hf.sampling_logprobs``; ``T <= 0``, greedy, counts as ``T = 1``) at every
    *target* position ``t`` — those with ``target_mask[t] != 0`` (``None``: all of
    ``1..L-1``) — and exactly 0 elsewhere, position 0 included. With ``with_entropy`` also the
    ``(L,)`` entropy ``H = -sum_v p_v log p_v`` of that distribution at the same positions
    (detached; 0 elsewhere), else an empty tensor. Differentiable w.r.t. the model's weights
    (no ``torch.no_grad`` inside; wrap the call for inference).

    How: the model's backbone (``model.model``: vision tower, merger, language model, final
    norm) gives the last hidden states ``(L, d)``; only the ``n`` rows that predict a target
    (row ``t - 1`` for target ``t``) are gathered, and ``paravt_kernels.linear_logprob`` takes
    them through the lm_head weight with ``T`` inside the kernel — the lm_head module's
    forward never runs, and no ``(L, V)`` (nor ``(n, V)``) tensor exists. ``top_p < 1`` needs
    the sorted distribution, so for such a sequence the ``(n, V)`` logits of the gathered rows
    alone are materialised (``n`` = generated tokens, not the prompt and its visual tokens).
    Under FSDP2 the whole computation runs as a forward of the root unit
    (``register_fsdp_forward_method``), so the root's parameters (embeddings, lm_head, norm)
    are gathered and their gradients reduced as in a normal forward.

    Callers — every log-prob in the project goes through here: the trainer's policy forward
    (``train_step`` via ``row_logprobs``), the proximal and reference passes
    (``packed_logprobs``, ``ReferencePolicy``), cold-start SFT (``paravt.sft.sft_loss``,
    targets = the loss mask) and the tests that teacher-force the HF engine's samples.
    """
    tok = torch.as_tensor(tokens, dtype=torch.long).reshape(-1).cpu()
    n_tok = tok.numel()
    mm = [0] * n_tok if mm_token_type_ids is None else torch.as_tensor(mm_token_type_ids)
    if target_mask is None:
        need = torch.ones(n_tok, dtype=torch.bool)
    else:
        if target_mask.numel() != n_tok:
            raise ValueError(
                f"target_mask has {target_mask.numel()} entries for {n_tok} tokens: pass one "
                "entry per token (the loss mask of the sequence)"
            )
        need = target_mask.detach().reshape(-1).cpu() != 0
    need[:1] = False  # position 0 has no predecessor: never a target
    pos = need.nonzero().squeeze(-1)
    return _as_root_forward(
        model, _hidden_logprobs, tok, mm, visuals, pos, float(temperature), float(top_p),
        bool(with_entropy),
    )  # fmt: skip


def _hidden_logprobs(
    model: torch.nn.Module,
    tok: torch.Tensor,
    mm: Sequence[int] | torch.Tensor,
    visuals: VisualInputs | None,
    pos: torch.Tensor,
    temperature: float,
    top_p: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sequence_logprobs`` body: backbone, gather the ``pos - 1`` rows, fused lm_head."""
    from paravt_kernels import linear_logprob

    from paravt.rollout.hf import sampling_logprobs
    from paravt.vision.preprocess import build_model_inputs

    p0 = next(model.parameters())
    merge = int(model.config.vision_config.spatial_merge_size)
    mm_list = mm.tolist() if torch.is_tensor(mm) else list(mm)
    inputs = build_model_inputs(
        tok.tolist(), mm_list, visuals, p0.device, merge_size=merge, dtype=p0.dtype
    )
    backbone = getattr(model, "model", None)
    head = model.get_output_embeddings()
    if backbone is None or head is None:
        raise TypeError(
            f"{type(model).__name__} has no .model backbone / output embeddings: "
            "sequence_logprobs needs an HF *ForConditionalGeneration (Qwen3-VL, Qwen2.5-VL)"
        )
    hidden = backbone(**inputs, use_cache=False).last_hidden_state[0]  # (L, d)
    pos = pos.to(hidden.device)
    h = hidden.index_select(0, pos - 1)  # (n, d): the rows that predict a target
    tgt = inputs["input_ids"][0].index_select(0, pos)
    t = temperature if temperature > 0 else 1.0  # greedy rows: the engine's T = 1 rule
    weight, bias = head.weight, head.bias
    if top_p < 1.0:
        # The nucleus needs the sorted distribution: logits of the gathered rows only.
        logp = sampling_logprobs(torch.nn.functional.linear(h, weight, bias), t, top_p)
        lp_n = logp.gather(-1, tgt[:, None]).squeeze(-1)
        ent_n = None
        if with_entropy:
            with torch.no_grad():
                q = logp.exp()
                # Tokens outside the nucleus have p = 0 and log p = -inf: they add 0, not NaN.
                ent_n = -torch.where(q > 0, q * logp, torch.zeros_like(logp)).sum(-1)
    elif with_entropy:
        lp_n, ent_n = linear_logprob(h, weight, tgt, temperature=t, bias=bias, return_entropy=True)
    else:
        lp_n, ent_n = linear_logprob(h, weight, tgt, temperature=t, bias=bias), None
    n_tok = tok.numel()
    lp = torch.zeros(n_tok, dtype=torch.float32, device=hidden.device).index_copy(
        0, pos, lp_n.float()
    )
    if ent_n is None:
        return lp, lp.new_zeros(0)
    ent = torch.zeros_like(lp).index_copy(0, pos, ent_n.detach().float())
    return lp, ent


# The method name under which ``sequence_logprobs`` runs as an FSDP2 root forward.
_FSDP_METHOD = "_paravt_hidden_logprobs"


def _as_root_forward(model: torch.nn.Module, fn: Callable, *args: Any) -> Any:
    """``fn(model, *args)``; for an FSDP2-sharded model, as a forward of its root unit.

    Calling ``model.model`` directly would skip the root's pre/post-forward hooks: its
    parameters (embeddings, lm_head, final norm) would stay sharded and their gradients would
    not be reduced. ``register_fsdp_forward_method`` wraps a method in exactly those hooks.
    """
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    if not isinstance(model, FSDPModule):
        return fn(model, *args)
    if _FSDP_METHOD not in model.__dict__:
        model.__dict__[_FSDP_METHOD] = types.MethodType(fn, model)
        register_fsdp_forward_method(model, _FSDP_METHOD)
    return getattr(model, _FSDP_METHOD)(*args)


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
    (``row_sampling``), ``(L_i,)``: the log-prob of each token with ``loss_mask != 0``, 0 at
    every other position (prompt, visual and tool-result tokens are never scored). The
    trainer's per-sequence policy forward (``train_step``) and every packed pass
    (``packed_logprobs``: proximal, reference) go through here."""
    cu = batch.cu_seqlens
    a, b = int(cu[i]), int(cu[i + 1])
    temperature, top_p = row_sampling(batch, i)
    mm = batch.extras["mm_token_type_ids"][a:b]
    return sequence_logprobs(
        model, batch.input_ids[a:b], mm, batch.visuals[i], temperature=temperature,
        top_p=top_p, target_mask=batch.loss_mask[a:b], with_entropy=with_entropy,
    )  # fmt: skip


def per_sequence_logprobs(
    model: torch.nn.Module, batch: PackedBatch, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Padding-free packed log-probs ``(N,)`` (and entropy) from one forward per sequence;
    0 where ``batch.loss_mask`` is 0 (``row_logprobs``)."""
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
