"""Padding-free batches and the per-token log-probs the loss needs.

``pack_units`` concatenates the token ids of every trajectory (main rows, each followed by its
sub-agent rows) into one ``(N,)`` layout with ``cu_seqlens (B+1,)``: there is no pad token
anywhere, so no compute and no normalisation is spent on padding.

``packed_logprobs`` fills that layout with ``log p_θ(x_t | x_<t)`` under each row's sampling
distribution, for the trained tokens (``loss_mask != 0``) only, 0 elsewhere: the model's
backbone gives hidden states, only the rows that predict a trained token
(``trained_rows``) meet the lm_head weight, inside ``paravt_kernels`` (temperature inside
the kernel): no ``(tokens, vocab)`` logits for the prompt, the visual tokens or anything else
(``top_p < 1`` materialises the logits of the gathered rows only). The "gathered rows ->
log-probs" step is one function, ``_gathered_logprobs`` (``gathered_logprobs`` groups rows
by sampling setting), shared by every path; the policy loss takes the same gathered rows
into the fused ``linear_policy_loss`` instead (``paravt.algo.loss.policy_part_loss``).

Forwards:

* **packed** (the trainer: proximal and reference passes through ``packed_logprobs``, the
  policy update through ``paravt.algo.loss.policy_minibatch_backward``; cold-start SFT
  through ``_packed_logprob_rows`` in ``paravt.sft.sft_loss``): sequences are
  grouped into micro-batches of at most ``algo.max_tokens_per_microbatch`` tokens
  (``microbatches``, first-fit decreasing; a longer sequence runs alone) and each
  micro-batch is ONE backbone forward over the row ``(1, sum L_i)`` (``_packed_hidden``);
* **per-sequence** (``sequence_logprobs``, ``row_logprobs``): one forward per sequence, for
  callers holding one sequence (tests teacher-forcing the engine's samples) and as the
  reference the packed paths are tested against.

A packed forward is exact because nothing of one sequence reaches another
(``_packed_inputs``, ``packed_attention_kwargs``):

* attention: SDPA runs ``varlen_sdpa_attention`` (one causal SDPA per sequence, boundaries
  ``cu_seq_lens_q``; the language model is switched to it for good by
  ``_varlen_language_model``, so gradient checkpointing recomputes the same path);
  flash_attention_2/3 gets the same ``cu_seq_lens_q/k`` + ``max_length_q/k``, which
  transformers' flash integration hands to ``flash_attn_varlen_func``; eager (debugging)
  gets an additive 4-D block-diagonal mask. Neither SDPA nor flash holds anything
  ``N x N``: attention costs ``sum L_i^2``. The CUDA flash branch is written but untested
  here (no GPU in CI, no flash-attn in the GPU image).
* positions: Qwen3-VL's mrope ids from ``get_rope_index`` on each sequence ALONE (cheap, host
  side), concatenated along the token axis. transformers reads a 4-row position tensor as
  ``text_position_ids`` + 3 mrope rows (the rotary embedding uses the mrope rows only); row 0
  is each sequence's text position ``0..L_i-1``. The SDPA path passes the 3 mrope rows only,
  so that ``create_causal_mask`` sees no packed sequences and builds no mask.
* visuals: the sequences' pixels and grids concatenated in sequence order and encoded in ONE
  vision-tower call (its attention is per frame: ``cu_seqlens`` from ``grid_thw``; the
  ``use_packed_vision`` override is per segment too), passed as ``mm_encoder_outputs``; the
  backbone scatters the features, and the deepstack features, into the placeholders in
  order, which is sequence order. Computing them outside the backbone call also keeps the
  ``cu_seq_lens`` kwargs away from the vision tower (its attention passes its own).

Verified on transformers 5.19 / Qwen3-VL, fp32 CPU (tests/test_algo_packed_forward.py, real
scripted batches: main rows with video, sub-agent rows with crop clips, a text-only row):
packed hidden states equal per-sequence ones to <= 1e-6; log-probs, entropy (also with
``top_p < 1``) and parameter gradients (also under gradient checkpointing) equal the
per-sequence path's; the same packed row WITHOUT the separation (plain causal) is off by O(1)
after the first sequence. Pinned too, not relied on: transformers' own packed-sequence
detection (``attention_mask=None`` with the restarting text row) builds a correct
block-diagonal mask for Qwen3-VL. Qwen2.5-VL has the same ``get_rope_index`` /
``mm_encoder_outputs`` API but is not tested packed.

Under FSDP2 every micro-batch is a root forward (``_as_root_forward``); in the policy update
ranks run the same number of micro-batches (the trainer takes the max over ranks and pads
with zero-weight forwards). Before that, whole units (a main row and its sub-agent rows,
with their visual inputs) move between ranks so that each rank's share of every minibatch
has about the same number of tokens (``paravt.distributed.balance_buckets``,
``algo.balance_ranks``).

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

# (model, batch, with_entropy, max_tokens) -> (logprob (N,), entropy (N,) or empty); each
# sequence under its own ``batch.temperatures[i]`` / ``batch.top_ps[i]``; ``max_tokens`` the
# micro-batch token budget of a packed path (None: its default).
LogprobFn = Callable[
    [torch.nn.Module, PackedBatch, bool, "int | None"], tuple[torch.Tensor, torch.Tensor]
]


def pack_units(units: Sequence[SequenceUnit]) -> PackedBatch:
    """Pack units (main + sub rows) into one padding-free batch.

    Per-token advantages come from ``paravt_kernels.broadcast_to_tokens``: a main row spreads
    its own group advantage, a sub row (``parent_index >= 0``) its parent's. ``seq_weights`` is
    1 for main rows and ``1/num_sub`` for sub rows. ``temperatures``/``top_ps`` are each row's
    own sampling parameters (a sub-agent's may differ from its parent's).
    """
    from paravt_kernels import broadcast_to_tokens

    from paravt.vision.preprocess import mm_token_types

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
    mm = [
        x
        for t in seqs
        for x in mm_token_types(
            t.extras.get("mm_token_type_ids"), t.tokens, who=f"trajectory {t.uid}"
        )
    ]
    return PackedBatch(
        input_ids=torch.tensor(cat_i, dtype=torch.int64),
        cu_seqlens=cu,
        loss_mask=_loss_mask(seqs),
        old_logprobs=torch.tensor([x for t in seqs for x in t.logprobs], dtype=torch.float32),
        advantages=adv.float(),
        seq_weights=torch.tensor(weights, dtype=torch.float32),
        temperatures=torch.tensor([t.temperature for t in seqs], dtype=torch.float32),
        top_ps=torch.tensor([t.top_p for t in seqs], dtype=torch.float32),
        uids=[t.uid for t in seqs],
        visuals=[t.visuals for t in seqs],
        extras={
            "mm_token_type_ids": torch.tensor(mm, dtype=torch.int64),
            "parent_index": torch.tensor(parents, dtype=torch.int64),
            "roles": [t.role for t in seqs],
        },
    )


def _loss_mask(seqs: Sequence[Trajectory]) -> torch.Tensor:
    """The packed loss mask, with each sequence's first token forced to 0: it has no
    predecessor, so no forward can score it (``trained_rows`` skips it); left in the mask it
    would count in the loss's normaliser with a log-prob of 0."""
    parts = []
    for t in seqs:
        m = torch.tensor(list(t.loss_mask), dtype=torch.float32)
        m[:1] = 0.0
        parts.append(m)
    return torch.cat(parts) if parts else torch.zeros(0)


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

    Callers: the per-sequence reference path of the packed passes
    (``per_sequence_logprobs``) and the tests that teacher-force the HF engine's samples (and
    the reference of the packed SFT loss). The trainer's passes and cold-start SFT run packed
    forwards of several sequences (``packed_logprobs``; the policy update through
    ``paravt.algo.loss.policy_part_loss``; ``paravt.sft.sft_loss``) and share the
    gathered-rows step (``_gathered_logprobs``) with this function.
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
    from paravt.vision.preprocess import build_model_inputs

    p0 = next(model.parameters())
    merge = int(model.config.vision_config.spatial_merge_size)
    mm_list = mm.tolist() if torch.is_tensor(mm) else list(mm)
    inputs = build_model_inputs(
        tok.tolist(), mm_list, visuals, p0.device, merge_size=merge, dtype=p0.dtype
    )
    backbone, head = _backbone_and_head(model)
    hidden = backbone(**inputs, use_cache=False).last_hidden_state[0]  # (L, d)
    pos = pos.to(hidden.device)
    h = hidden.index_select(0, pos - 1)  # (n, d): the rows that predict a target
    tgt = inputs["input_ids"][0].index_select(0, pos)
    lp_n, ent_n = _gathered_logprobs(head, h, tgt, temperature, top_p, with_entropy)
    n_tok = tok.numel()
    lp = torch.zeros(n_tok, dtype=torch.float32, device=hidden.device).index_copy(
        0, pos, lp_n.float()
    )
    if ent_n is None:
        return lp, lp.new_zeros(0)
    ent = torch.zeros_like(lp).index_copy(0, pos, ent_n.detach().float())
    return lp, ent


def _backbone_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    backbone = getattr(model, "model", None)
    head = model.get_output_embeddings()
    if backbone is None or head is None:
        raise TypeError(
            f"{type(model).__name__} has no .model backbone / output embeddings: "
            "sequence_logprobs needs an HF *ForConditionalGeneration (Qwen3-VL, Qwen2.5-VL)"
        )
    return backbone, head


def _gathered_logprobs(
    head: torch.nn.Module,
    h: torch.Tensor,
    tgt: torch.Tensor,
    temperature: float,
    top_p: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gathered hidden rows ``h (n, d)`` -> ``(n,)`` log-probs of ``tgt`` (and the ``(n,)``
    detached entropy, else None) under ``log_softmax(top_p(logits / T))``, through the
    lm_head weight inside ``paravt_kernels.linear_logprob``. ``top_p < 1`` materialises the
    ``(n, V)`` logits of these rows only. Every log-prob path (per-sequence, packed) ends here.
    """
    from paravt_kernels import linear_logprob

    from paravt.rollout.hf import sampling_logprobs

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
        return lp_n, ent_n
    if with_entropy:
        return linear_logprob(h, weight, tgt, temperature=t, bias=bias, return_entropy=True)
    return linear_logprob(h, weight, tgt, temperature=t, bias=bias), None


def _as_root_forward(model: torch.nn.Module, fn: Callable, *args: Any) -> Any:
    """``fn(model, *args)``; for an FSDP2-sharded model, as a forward of its root unit.

    Calling ``model.model`` directly would skip the root's pre/post-forward hooks: its
    parameters (embeddings, lm_head, final norm) would stay sharded and their gradients would
    not be reduced. ``register_fsdp_forward_method`` wraps a method in exactly those hooks;
    each ``fn`` is registered once, under its own name (``_paravt_<fn name>``).

    A no-grad root forward (the proximal and reference passes) is followed by
    ``model.reshard()``: FSDP2 keeps the ROOT unit's parameters unsharded after its forward
    (``reshard_after_forward`` is off for the root), and the next forward WITH grad then reuses
    those no-grad tensors, so the root's gradients (embeddings, lm_head, final norm) are not
    reduced across ranks as they should be. Measured on torch 2.13 / gloo, two ranks: the
    step's gradient norm 0.163 against 0.344 recomputed in one process
    (tests/test_train_distributed.py, whose proximal pass runs on the sharded policy).
    """
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    if not isinstance(model, FSDPModule):
        return fn(model, *args)
    method = f"_paravt{fn.__name__}" if fn.__name__.startswith("_") else f"_paravt_{fn.__name__}"
    if method not in model.__dict__:
        model.__dict__[method] = types.MethodType(fn, model)
        register_fsdp_forward_method(model, method)
    out = getattr(model, method)(*args)
    if not torch.is_grad_enabled():
        model.reshard()
    return out


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
    per-sequence path (``per_sequence_logprobs``) goes through here."""
    cu = batch.cu_seqlens
    a, b = int(cu[i]), int(cu[i + 1])
    temperature, top_p = row_sampling(batch, i)
    mm = batch.extras["mm_token_type_ids"][a:b]
    return sequence_logprobs(
        model, batch.input_ids[a:b], mm, batch.visuals[i], temperature=temperature,
        top_p=top_p, target_mask=batch.loss_mask[a:b], with_entropy=with_entropy,
    )  # fmt: skip


def per_sequence_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    with_entropy: bool = False,
    max_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Padding-free packed log-probs ``(N,)`` (and entropy) from one forward per sequence;
    0 where ``batch.loss_mask`` is 0 (``row_logprobs``). ``max_tokens`` is ignored (the
    ``LogprobFn`` signature; every forward is one sequence)."""
    lps, ents = [], []
    for i in range(batch.cu_seqlens.numel() - 1):
        lp, ent = row_logprobs(model, batch, i, with_entropy)
        lps.append(lp)
        ents.append(ent)
    # Results stay on the model's device (the loss runs there too).
    empty = torch.zeros(0)
    return (torch.cat(lps) if lps else empty), (torch.cat(ents) if with_entropy else empty)


# --------------------------------------------------------------- packed multi-sequence forwards

# Keys of ``build_model_inputs`` that carry one sequence's visual inputs, concatenated in
# sequence order when several sequences share one forward.
_VISUAL_KEYS = (
    "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
    "second_per_grid_ts",
)  # fmt: skip
_ROPE_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")


def packed_attention_kwargs(
    lengths: Sequence[int], attn_impl: str, device: torch.device, dtype: torch.dtype
) -> dict[str, Any]:
    """The ONE argument that keeps sequences of a packed row ``(1, sum L_i)`` apart.

    * ``flash_attention_2``/``_3`` (CUDA) and ``sdpa``: no mask; ``cu_seq_lens_q/k`` +
      ``max_length_q/k`` go through the language model's ``**kwargs`` to its attention
      function. flash-attn: transformers' integration calls ``flash_attn_varlen_func`` over
      those boundaries. SDPA: the language model runs ``VARLEN_SDPA``
      (``_varlen_language_model``; ``varlen_sdpa_attention``: one causal SDPA per sequence).
      Neither holds anything ``N x N``, and attention costs ``sum L_i^2``, not ``N^2``.
    * ``eager`` (debugging): a 4-D additive block-diagonal causal mask ``(1, 1, N, N)``
      (0 / dtype min), as eager attention adds it; ``create_causal_mask`` returns a 4-D mask
      as is.

    Everything else of the packed forward (token ids, visual features, mrope position ids)
    is the same for every implementation.
    """
    n = int(sum(lengths))
    if attn_impl.startswith("flash_attention") or attn_impl in ("sdpa", VARLEN_SDPA):
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.as_tensor(list(lengths), dtype=torch.int32), 0)
        if attn_impl.startswith("flash_attention"):  # the kernel reads them on the device;
            cu = cu.to(device)  # varlen SDPA slices on the host (no sync per layer)
        longest = int(max(lengths))
        return {
            "attention_mask": None, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
            "max_length_q": longest, "max_length_k": longest,
        }  # fmt: skip
    if attn_impl != "eager":
        raise NotImplementedError(
            f"packed forward: attn_implementation '{attn_impl}' (sdpa, eager and "
            "flash_attention_2/3 are supported)"
        )
    seq_id = torch.repeat_interleave(
        torch.arange(len(lengths), device=device),
        torch.as_tensor(list(lengths), device=device),
    )
    idx = torch.arange(n, device=device)
    allowed = (seq_id[:, None] == seq_id[None, :]) & (idx[None, :] <= idx[:, None])
    mask = torch.zeros(n, n, dtype=dtype, device=device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )
    return {"attention_mask": mask[None, None]}


# The attention implementation the language model runs under for a packed SDPA forward.
VARLEN_SDPA = "paravt_varlen_sdpa"


def varlen_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function: one causal ``scaled_dot_product_attention`` per
    sequence of a packed row (boundaries ``cu_seq_lens_q``), the CPU/SDPA twin of
    flash-attn varlen. ``query`` ``(1, H, N, D)``, ``key``/``value`` ``(1, H_kv, N, D)``
    (grouped-query heads broadcast by SDPA) -> ``(1, N, H, D)``. Without ``cu_seq_lens_q`` (not a
    packed forward) it is transformers' own SDPA attention."""
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # Grouped-query heads: SDPA broadcasts them (enable_gqa) instead of a repeated K/V copy
    # of the whole row that the backward would keep.
    gqa = {"enable_gqa": True} if query.shape[1] != key.shape[1] else {}
    bounds = cu_seq_lens_q.tolist()  # a host tensor (packed_attention_kwargs): no sync
    outs = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, a:b],
            key[:, :, a:b],
            value[:, :, a:b],
            dropout_p=dropout,
            is_causal=True,
            scale=scaling,
            **gqa,
        )
        for a, b in zip(bounds[:-1], bounds[1:])
        if b > a
    ]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def _varlen_language_model(backbone: torch.nn.Module) -> str:
    """The language model's attention implementation for packed forwards; an ``sdpa`` one is
    switched to ``VARLEN_SDPA`` for good (registered with transformers on first use, with
    SDPA's own mask function). The switch is permanent, not scoped to the packed forward:
    gradient checkpointing re-runs each layer during the backward, and the re-run must take
    the same attention path. Every call without ``cu_seq_lens_q`` (generation, padded
    batches, single sequences) is transformers' SDPA, mask and all, so nothing else changes.
    The vision tower keeps its own implementation (its own config)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    cfg = getattr(backbone, "language_model", backbone).config
    impl = str(getattr(cfg, "_attn_implementation", None) or "sdpa")
    if impl != "sdpa":
        return impl
    if VARLEN_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
        AttentionMaskInterface.register(VARLEN_SDPA, sdpa_mask)
    cfg._attn_implementation = VARLEN_SDPA
    return VARLEN_SDPA


def _packed_inputs(
    model: torch.nn.Module, batch: PackedBatch, seqs: Sequence[int]
) -> tuple[dict[str, Any], list[int]]:
    """Backbone keyword arguments for ONE forward over sequences ``seqs`` of ``batch``, and
    their lengths. Token ids and ``mm_token_type_ids`` are concatenated into ``(1, N)``; the
    visual features of all sequences come from ONE vision-tower call over their concatenated
    pixels / grids (attention there is per frame, so a grid never sees another's patches), in
    sequence order, which is the order of the placeholders in the packed row (the backbone
    scatters them, and their deepstack features, by placeholder order). Position ids are
    ``(4, 1, N)``: rows 1-3 the mrope ids of ``get_rope_index`` on each sequence ALONE (each
    restarts at 0), row 0 the per-sequence text position ``0..L_i-1`` (what transformers
    reads as ``text_position_ids``; the rotary embedding uses rows 1-3 only).
    """
    from paravt.vision.preprocess import build_model_inputs

    backbone, _ = _backbone_and_head(model)
    p0 = next(model.parameters())
    dev = p0.device
    merge = int(model.config.vision_config.spatial_merge_size)
    mm_all = batch.extras["mm_token_type_ids"]
    cu = batch.cu_seqlens
    per, lengths = [], []
    for i in seqs:
        a, b = int(cu[i]), int(cu[i + 1])
        per.append(
            build_model_inputs(
                batch.input_ids[a:b].tolist(), mm_all[a:b].tolist(), batch.visuals[i], dev,
                merge_size=merge, dtype=p0.dtype,
            )
        )  # fmt: skip
        lengths.append(b - a)
    positions = []
    for inp, n_i in zip(per, lengths):
        rope = {k: inp[k] for k in _ROPE_KEYS if k in inp}
        mrope, _ = backbone.get_rope_index(
            inp["input_ids"], mm_token_type_ids=inp["mm_token_type_ids"], **rope
        )  # (3, 1, L_i)
        text = torch.arange(n_i, device=mrope.device, dtype=mrope.dtype).view(1, 1, -1)
        positions.append(torch.cat([text, mrope], 0))
    visual = {}
    for k in _VISUAL_KEYS:
        parts = [inp[k] for inp in per if k in inp]
        if parts:
            visual[k] = torch.cat(parts)
    encoded: dict[str, Any] = {}
    if "pixel_values" in visual:
        encoded["image"] = backbone.get_image_features(
            visual["pixel_values"], visual["image_grid_thw"], return_dict=True
        )
    if "pixel_values_videos" in visual:
        encoded["video"] = backbone.get_video_features(
            visual["pixel_values_videos"], visual["video_grid_thw"], return_dict=True
        )
    kwargs = {
        "input_ids": torch.cat([inp["input_ids"] for inp in per], 1),
        "mm_token_type_ids": torch.cat([inp["mm_token_type_ids"] for inp in per], 1),
        "position_ids": torch.cat(positions, 2),
        "mm_encoder_outputs": encoded or None,
        "use_cache": False,
    }
    return kwargs, lengths


def _packed_hidden(
    model: torch.nn.Module, batch: PackedBatch, seqs: Sequence[int], isolate: bool = True
) -> torch.Tensor:
    """``packed_hidden_states`` body (no FSDP root wrapping). ``isolate=False`` drops the
    sequence-separating argument (plain causal attention over the whole row): only the tests
    use it, to show the mask is what makes the packed forward exact."""
    backbone, _ = _backbone_and_head(model)
    kwargs, lengths = _packed_inputs(model, batch, seqs)
    if not isolate:  # 3 mrope rows only: no text row, so transformers sees one causal sequence
        kwargs["position_ids"] = kwargs["position_ids"][1:]
        return backbone(**kwargs).last_hidden_state[0]
    impl = _varlen_language_model(backbone)
    kwargs.update(
        packed_attention_kwargs(
            lengths, impl, kwargs["input_ids"].device, next(model.parameters()).dtype
        )
    )
    if impl == VARLEN_SDPA:  # no text row: no N x N packed-sequence mask is built
        kwargs["position_ids"] = kwargs["position_ids"][1:]
    return backbone(**kwargs).last_hidden_state[0]


def packed_hidden_states(
    model: torch.nn.Module, batch: PackedBatch, seqs: Sequence[int]
) -> torch.Tensor:
    """Last hidden states ``(sum L_i, d)`` of sequences ``seqs`` of ``batch`` (in that order,
    each sequence's rows contiguous) from ONE backbone forward over the packed row
    ``(1, sum L_i)``; equal to running each sequence alone (fp32: to ~1e-5; tested).

    No attention crosses a sequence boundary (``packed_attention_kwargs``: per-sequence
    attention for SDPA, flash-attn varlen ``cu_seqlens`` for flash_attention_2, an additive
    block-diagonal mask for eager); each sequence keeps its own mrope positions and visual
    features (``_packed_inputs``). For callers outside the trainer (which runs
    ``_packed_hidden`` inside its own root forwards).
    Differentiable; runs as an FSDP2 root forward (``_as_root_forward``), like
    ``sequence_logprobs``. Under FSDP2 the root's parameters (lm_head included) are resharded
    when this returns: a caller that applies the lm_head to these rows must do it inside its
    own root forward, ``_as_root_forward(model, fn, ...)`` with ``fn`` calling
    ``_packed_hidden`` (as ``packed_sequence_logprobs`` and
    ``paravt.algo.loss.policy_part_loss`` do).
    """
    return _as_root_forward(model, _packed_hidden, batch, list(seqs))


def _packed_logprob_rows(
    model: torch.nn.Module, batch: PackedBatch, seqs: list[int], with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One packed forward over ``seqs``; returns ``(index, lp, ent)``: the positions in the
    whole batch's ``(N,)`` layout of the trained tokens of ``seqs`` (``trained_rows``) and
    their log-probs / entropies (``gathered_logprobs``)."""
    _, head = _backbone_and_head(model)
    hidden = _packed_hidden(model, batch, seqs)
    dev = hidden.device
    rows, index = trained_rows(select_sequences(batch, seqs))
    h = hidden.index_select(0, (index - 1).to(dev))  # row t - 1 predicts token t
    lp_n, ent_n = gathered_logprobs(head, h, rows, with_entropy)
    cu = batch.cu_seqlens.tolist()
    glob = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in seqs])[index]
    return glob.to(dev), lp_n.float(), (ent_n.detach().float() if with_entropy else None)


def gathered_logprobs(
    head: torch.nn.Module, h: torch.Tensor, rows: PackedBatch, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``(n,)`` (and detached entropies, else None) of the trained tokens ``rows``
    (``trained_rows``) from the hidden rows ``h`` ``(n, d)`` that predict them, each row
    under its sequence's own ``(T, top_p)``: one ``_gathered_logprobs`` call per distinct
    sampling setting. The packed log-prob passes and the policy loss's ``top_p < 1``
    fallback (``paravt.algo.loss.policy_part_loss``) use it."""
    cu = rows.cu_seqlens.tolist()
    groups: dict[tuple[float, float], list[torch.Tensor]] = {}
    for i in range(len(cu) - 1):
        if cu[i + 1] > cu[i]:
            groups.setdefault(row_sampling(rows, i), []).append(torch.arange(cu[i], cu[i + 1]))
    n = h.shape[0]
    lp = torch.zeros(n, dtype=torch.float32, device=h.device)
    ent = torch.zeros(n if with_entropy else 0, dtype=torch.float32, device=h.device)
    tgt = rows.input_ids.to(h.device)
    for (temperature, top_p), parts in groups.items():
        sel = torch.cat(parts).to(h.device)
        lp_g, ent_g = _gathered_logprobs(
            head, h.index_select(0, sel), tgt.index_select(0, sel), temperature, top_p,
            with_entropy,
        )  # fmt: skip
        lp = lp.index_copy(0, sel, lp_g.float())
        if ent_g is not None:
            ent = ent.index_copy(0, sel, ent_g.detach().float())
    return lp, (ent if with_entropy else None)


def select_sequences(batch: PackedBatch, seqs: Sequence[int]) -> PackedBatch:
    """Sequences ``seqs`` of a packed batch, in that order, as a packed batch of their own
    (per-token tensors and per-token ``extras`` sliced, ``cu_seqlens`` rebuilt)."""
    cu = batch.cu_seqlens.tolist()
    n_tok = batch.input_ids.numel()
    idx = (
        torch.cat([torch.arange(cu[i], cu[i + 1]) for i in seqs])
        if seqs
        else torch.zeros(0, dtype=torch.long)
    )
    lengths = torch.tensor([cu[i + 1] - cu[i] for i in seqs], dtype=torch.int64)
    new_cu = torch.zeros(len(seqs) + 1, dtype=batch.cu_seqlens.dtype)
    new_cu[1:] = torch.cumsum(lengths, 0)
    s = torch.tensor(list(seqs), dtype=torch.long)
    extras: dict = {}
    for k, v in batch.extras.items():
        if torch.is_tensor(v) and v.dim() == 1 and v.numel() == n_tok:
            extras[k] = v[idx]
        elif k == "roles":
            extras[k] = [v[i] for i in seqs]
    return PackedBatch(
        input_ids=batch.input_ids[idx],
        cu_seqlens=new_cu,
        loss_mask=batch.loss_mask[idx],
        old_logprobs=batch.old_logprobs[idx],
        advantages=batch.advantages[idx],
        seq_weights=batch.seq_weights[s],
        temperatures=None if batch.temperatures is None else batch.temperatures[s],
        top_ps=None if batch.top_ps is None else batch.top_ps[s],
        uids=[batch.uids[i] for i in seqs],
        visuals=[batch.visuals[i] for i in seqs],
        extras=extras,
    )


def trained_rows(batch: PackedBatch) -> tuple[PackedBatch, torch.Tensor]:
    """The trained tokens of ``batch`` only: ``(rows, index)`` with ``index`` ``(n,)`` the
    positions ``t`` (``loss_mask[t] != 0``, never a sequence's first token) and ``rows`` a
    packed batch over those ``n`` tokens (``input_ids`` = the targets, per-token fields and
    extras gathered, ``cu_seqlens`` counting each sequence's trained tokens; a sequence with
    none is an empty segment). The hidden state that predicts ``rows`` token ``j`` is row
    ``index[j] - 1`` of the sequence-concatenated forward."""
    cu = batch.cu_seqlens.long()
    n_tok = batch.input_ids.numel()
    need = batch.loss_mask.detach().cpu() != 0
    need[cu[:-1][cu[:-1] < cu[1:]]] = False  # a sequence's first token has no predecessor
    index = need.nonzero().squeeze(-1)
    counts = torch.zeros(cu.numel() - 1, dtype=torch.int64)
    if index.numel():
        sid = torch.bucketize(index, cu[1:], right=True)
        counts = torch.bincount(sid, minlength=cu.numel() - 1)
    new_cu = torch.zeros(cu.numel(), dtype=batch.cu_seqlens.dtype)
    new_cu[1:] = torch.cumsum(counts, 0)
    extras = {
        k: v[index]
        for k, v in batch.extras.items()
        if torch.is_tensor(v) and v.dim() == 1 and v.numel() == n_tok
    }
    rows = PackedBatch(
        input_ids=batch.input_ids[index],
        cu_seqlens=new_cu,
        loss_mask=batch.loss_mask[index],
        old_logprobs=batch.old_logprobs[index],
        advantages=batch.advantages[index],
        seq_weights=batch.seq_weights,
        temperatures=batch.temperatures,
        top_ps=batch.top_ps,
        uids=list(batch.uids),
        visuals=[],
        extras=extras,
    )
    return rows, index


def microbatches(batch: PackedBatch | Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group the sequences of ``batch`` (or a list of sequence lengths) into micro-batches of
    at most ``max_tokens`` tokens each; a sequence longer than that goes alone.

    First-fit decreasing: sequences by length, longest first (ties: lower index first), each
    into the first micro-batch it fits in, else a new one. Deterministic; every sequence in
    exactly one micro-batch; indices ascending inside a micro-batch, micro-batches in order of
    creation (the longest sequence's first). Main and sub-agent rows are not kept together:
    each row is scored on its own, so their grouping does not change any value.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be >= 1")
    if isinstance(batch, PackedBatch):
        lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    else:
        lengths = [int(n) for n in batch]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for k, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[k].append(i)
                loads[k] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def packed_sequence_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    with_entropy: bool = False,
    max_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same ``(N,)`` log-probs (and entropy) as ``per_sequence_logprobs`` from packed forwards:
    one backbone forward per micro-batch of at most ``max_tokens`` tokens (``microbatches``;
    None: ``AlgoConfig``'s default), the trained rows gathered and scored under each row's
    own ``T`` / ``top_p`` (``_gathered_logprobs``). Each micro-batch runs as one FSDP2 root
    forward. Differentiable (no ``no_grad`` inside)."""
    if max_tokens is None:
        from paravt.config import AlgoConfig

        max_tokens = AlgoConfig().max_tokens_per_microbatch
    n = batch.input_ids.numel()
    lp = ent = None
    for seqs in microbatches(batch, max_tokens):
        index, lp_n, ent_n = _as_root_forward(
            model, _packed_logprob_rows, batch, seqs, bool(with_entropy)
        )
        if lp is None:
            lp = torch.zeros(n, dtype=torch.float32, device=lp_n.device)
            ent = torch.zeros(n if with_entropy else 0, dtype=torch.float32, device=lp_n.device)
        lp = lp.index_copy(0, index, lp_n)
        if ent_n is not None:
            ent = ent.index_copy(0, index, ent_n)
    if lp is None:  # no sequence
        return torch.zeros(0), torch.zeros(0)
    return lp, ent


# The log-prob paths (same values; see the module docstring). "packed" is the default.
LOGPROB_PATHS: dict[str, LogprobFn] = {
    "per_sequence": per_sequence_logprobs,
    "packed": packed_sequence_logprobs,
}


def packed_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    with_entropy: bool = False,
    path: str = "packed",
    max_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to a registered ``LogprobFn`` (see the module docstring); each sequence is
    scored under its own ``batch.temperatures[i]`` / ``batch.top_ps[i]``. ``max_tokens``: the
    micro-batch token budget of the packed path (``algo.max_tokens_per_microbatch``; None: its
    default); the per-sequence path runs one forward per sequence whatever it says."""
    if path not in LOGPROB_PATHS:
        raise ValueError(f"log-prob path '{path}' is not one of {sorted(LOGPROB_PATHS)}")
    return LOGPROB_PATHS[path](model, batch, with_entropy, max_tokens)


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
