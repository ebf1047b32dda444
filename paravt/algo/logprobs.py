"""The per-token log-probs of a packed batch: THE entry point is ``packed_logprobs``.

``packed_logprobs`` fills a ``PackedBatch``'s ``(N,)`` layout with ``log p_θ(x_t | x_<t)``
under each row's sampling distribution, for the trained tokens (``loss_mask != 0``) only, 0
elsewhere: the model's backbone gives hidden states (``paravt.models.forward``), only the
rows that predict a trained token (``paravt.algo.packing.trained_rows``) meet the lm_head
weight, inside ``paravt_kernels`` (temperature inside the kernel): no ``(tokens, vocab)``
logits for the prompt, the visual tokens or anything else (``top_p < 1`` materialises the
logits of the gathered rows only). The "gathered rows -> log-probs" step is one function,
``_gathered_logprobs`` (``gathered_logprobs`` groups rows by sampling setting), shared by
every path; the policy loss takes the same gathered rows into the fused
``linear_policy_loss`` instead (``paravt.algo.loss.policy_part_loss``).

Paths (``LOGPROB_PATHS``, same values):

* **packed** (the trainer: proximal and reference passes through ``packed_logprobs``, the
  policy update through ``paravt.algo.loss.policy_minibatch_backward``; cold-start SFT
  through ``packed_logprob_rows`` in ``paravt.sft.sft_loss``): sequences are grouped into
  micro-batches of at most ``algo.max_tokens_per_microbatch`` tokens
  (``paravt.algo.packing.microbatches``, first-fit decreasing; a longer sequence runs alone)
  and each micro-batch is ONE backbone forward over the row ``(1, sum L_i)``
  (``paravt.models.forward.packed_hidden``; why it is exact is in that module);
* **per-sequence** (``sequence_logprobs``, ``row_logprobs``): one forward per sequence, for
  callers holding one sequence (tests teacher-forcing the engine's samples) and as the
  reference the packed paths are tested against.

Under FSDP2 every micro-batch is a root forward (``paravt.models.forward.as_root_forward``);
in the policy update ranks run the same number of micro-batches (the trainer takes the max
over ranks and pads with zero-weight forwards). Before that, whole units (a main row and its
sub-agent rows, with their visual inputs) move between ranks so that each rank's share of
every minibatch has about the same number of tokens (``paravt.distributed.balance_buckets``,
``algo.balance_ranks``).

Alignment: ``logprob[t]`` is the log-prob of token ``t`` given tokens ``< t`` (position 0 of
each sequence is 0, never trained). ``Trajectory.loss_mask``/``logprobs`` use the same
alignment, so no shifting happens anywhere else.

Sampling parameters: the engine's behaviour log-probs are of ``softmax(top_p(logits / T))``
(``paravt.models.sampling.sampling_logprobs``) with the ``T``/``top_p`` of *that row's*
request (main agents ``rollout.temperature``, sub-agents ``rollout.sub_temperature``). The
trainer's log-probs must be of the same distribution for the PPO ratio to be 1 at step start,
so each row carries its own (``Trajectory.temperature``/``top_p`` ->
``PackedBatch.temperatures``/``top_ps``) and every pass here (policy, proximal, reference)
reads them from the batch; no caller passes a temperature. Scoring a ``T = 0.3`` sub-agent
row at the main ``T = 0.7`` put its ratios at 0.5-1.9 before any update.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from paravt.algo.packing import microbatches, select_sequences, trained_rows
from paravt.config import AlgoConfig
from paravt.models.forward import as_root_forward, backbone_and_head, packed_hidden_rows
from paravt.models.sampling import sampling_logprobs
from paravt.types import PackedBatch, VisualInputs
from paravt.vision.preprocess import build_model_inputs

# (model, batch, with_entropy, max_tokens) -> (logprob (N,), entropy (N,) or empty); each
# sequence under its own ``batch.temperatures[i]`` / ``batch.top_ps[i]``; ``max_tokens`` the
# micro-batch token budget of a packed path (None: its default).
LogprobFn = Callable[
    [torch.nn.Module, PackedBatch, bool, "int | None"], tuple[torch.Tensor, torch.Tensor]
]


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
    (``paravt.models.sampling.sampling_logprobs``; ``T <= 0``, greedy, counts as ``T = 1``) at every
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
    return as_root_forward(
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

    p0 = next(model.parameters())
    merge = int(model.config.vision_config.spatial_merge_size)
    mm_list = mm.tolist() if torch.is_tensor(mm) else list(mm)
    inputs = build_model_inputs(
        tok.tolist(), mm_list, visuals, p0.device, merge_size=merge, dtype=p0.dtype
    )
    backbone, head = backbone_and_head(model)
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
    # lazy: looked up per call, so a swapped paravt_kernels op is the one used
    from paravt_kernels import linear_logprob

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
    mm = batch.token_types()[a:b]
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


def packed_logprob_rows(
    model: torch.nn.Module, batch: PackedBatch, seqs: list[int], with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One packed forward over ``seqs``; returns ``(index, lp, ent)``: the positions in the
    whole batch's ``(N,)`` layout of the trained tokens of ``seqs`` (``trained_rows``) and
    their log-probs / entropies (``gathered_logprobs``)."""
    _, head = backbone_and_head(model)
    rows, index = trained_rows(select_sequences(batch, seqs))
    h = packed_hidden_rows(model, batch, seqs, index - 1)  # row t - 1 predicts token t
    dev = h.device
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
        max_tokens = AlgoConfig().max_tokens_per_microbatch
    n = batch.input_ids.numel()
    lp = ent = None
    for seqs in microbatches(batch, max_tokens):
        index, lp_n, ent_n = as_root_forward(
            model, packed_logprob_rows, batch, seqs, bool(with_entropy)
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
