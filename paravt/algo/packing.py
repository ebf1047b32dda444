"""Padding-free batches: units of trajectories into ``PackedBatch`` es, and micro-batches.

``pack_units`` concatenates the token ids of every trajectory (main rows, each followed by its
sub-agent rows) into one ``(N,)`` layout with ``cu_seqlens (B+1,)``: there is no pad token
anywhere, so no compute and no normalisation is spent on padding. ``split_units`` cuts the
units of a step into minibatches (between units, never inside one); ``microbatches`` groups a
batch's sequences into the packed forwards of at most ``algo.max_tokens_per_microbatch``
tokens that the log-prob passes (``paravt.algo.logprobs``) and the policy update
(``paravt.algo.loss``) run; ``select_sequences`` / ``trained_rows`` / ``concat_packed`` cut
and join packed batches, every per-token and per-sequence field along.

The model forward over a packed batch is ``paravt.models.forward``; the log-probs it gives
are ``paravt.algo.logprobs.packed_logprobs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from paravt.distributed import balance_buckets
from paravt.models.prefix import prefix_groups, shared_cost, shared_rows
from paravt.types import PackedBatch, SequenceUnit, Trajectory
from paravt.vision.preprocess import mm_token_types


def pack_units(units: Sequence[SequenceUnit], share_prefix: bool = False) -> PackedBatch:
    """Pack units (main + sub rows) into one padding-free batch.

    ``share_prefix`` (``algo.share_prefix``) fills ``group_ids``: each main row's
    ``Trajectory.group_id`` (sub rows -1: a sub-agent's prompt holds its own crop), so that
    the packed forwards encode a group's common prompt once (``paravt.models.prefix``).

    Per-token advantages come from ``paravt_kernels.broadcast_to_tokens``: a main row spreads
    its own group advantage, a sub row (``parent_index >= 0``) its parent's. ``seq_weights`` is
    1 for main rows and ``1/num_sub`` for sub rows. ``temperatures``/``top_ps`` are each row's
    own sampling parameters (a sub-agent's may differ from its parent's).
    """
    # lazy: looked up per call, so a swapped paravt_kernels op is the one used
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
        mm_token_type_ids=torch.tensor(mm, dtype=torch.int64),
        parent_index=torch.tensor(parents, dtype=torch.int64),
        roles=[t.role for t in seqs],
        versions=(
            torch.tensor([v for t in seqs for v in t.versions], dtype=torch.int64)
            if seqs and all(t.versions for t in seqs)
            else None
        ),
        group_ids=_group_ids(seqs) if share_prefix else None,
    )


def _group_ids(seqs: Sequence[Trajectory]) -> torch.Tensor:
    """``PackedBatch.group_ids``: one id per (``group_id``, ``sample_id``) of the main rows,
    numbered in order of appearance; sub rows -1. The sample id is part of the key because
    ranks number their groups alike and rank balancing moves groups between them."""
    ids: dict[tuple[int, str], int] = {}
    out = [
        ids.setdefault((t.group_id, t.sample_id), len(ids)) if t.role == "main" else -1
        for t in seqs
    ]
    return torch.tensor(out, dtype=torch.int64)


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


def balance_units(
    buckets: list[list[SequenceUnit]], ctx: Any, share_prefix: bool
) -> tuple[list[list[SequenceUnit]], dict[str, float]]:
    """``paravt.distributed.balance_buckets`` over the trainer's minibatches of units
    (``algo.balance_ranks``; ``paravt.train``). With ``share_prefix`` the item that moves is a
    prompt group (the units of one ``group_id``, in order), so a group's prompt stays encoded
    once (``paravt.models.prefix``), at the rows its shared forward holds
    (``shared_rows``: the common prompt counted once); else one unit, at its token count."""

    if not share_prefix:
        return balance_buckets(
            buckets, lambda u: u.num_tokens, ctx, portable=lambda u: u.portable()
        )
    grouped: list[list[list[SequenceUnit]]] = []
    for b in buckets:
        by_id: dict[int, list[SequenceUnit]] = {}
        for u in b:
            by_id.setdefault(u.group_id, []).append(u)
        grouped.append(list(by_id.values()))

    def cost(g: list[SequenceUnit]) -> float:
        b = pack_units(g, share_prefix=True)
        return float(shared_rows(b, range(len(b.uids))))

    out, stats = balance_buckets(grouped, cost, ctx, portable=_portable_group)
    return [[u for g in b for u in g] for b in out], stats


def _portable_group(group: list[SequenceUnit]) -> list[SequenceUnit]:
    """``SequenceUnit.portable`` of each unit of a group, with a clip the group's rows share
    (the overview: one object) compacted once and shared again by the copies: one pickle
    sends its pixels once, not G times, and the receiving rank's ``prefix_groups`` finds the
    same object (no pixel comparison)."""
    memo: dict[int, Any] = {}
    out = []
    for u in group:
        p = u.portable()
        for orig, new in zip(u.sequences, p.sequences):
            if orig.visuals is not None:
                new.visuals = memo.setdefault(id(orig.visuals), new.visuals)
        out.append(p)
    return out


def select_sequences(batch: PackedBatch, seqs: Sequence[int]) -> PackedBatch:
    """Sequences ``seqs`` of a packed batch, in that order, as a packed batch of their own
    (per-token and per-sequence fields sliced, ``cu_seqlens`` rebuilt; ``parent_index`` is
    dropped: the parents need not be among ``seqs``)."""
    cu = batch.cu_seqlens.tolist()
    idx = (
        torch.cat([torch.arange(cu[i], cu[i + 1]) for i in seqs])
        if seqs
        else torch.zeros(0, dtype=torch.long)
    )
    lengths = torch.tensor([cu[i + 1] - cu[i] for i in seqs], dtype=torch.int64)
    new_cu = torch.zeros(len(seqs) + 1, dtype=batch.cu_seqlens.dtype)
    new_cu[1:] = torch.cumsum(lengths, 0)
    s = torch.tensor(list(seqs), dtype=torch.long)
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
        mm_token_type_ids=_take(batch.mm_token_type_ids, idx),
        roles=[batch.roles[i] for i in seqs] if batch.roles else [],
        ref_logprobs=_take(batch.ref_logprobs, idx),
        prox_logprobs=_take(batch.prox_logprobs, idx),
        versions=_take(batch.versions, idx),
        group_ids=None if batch.group_ids is None else batch.group_ids[s],
    )


def trained_rows(batch: PackedBatch) -> tuple[PackedBatch, torch.Tensor]:
    """The trained tokens of ``batch`` only: ``(rows, index)`` with ``index`` ``(n,)`` the
    positions ``t`` (``loss_mask[t] != 0``, never a sequence's first token) and ``rows`` a
    packed batch over those ``n`` tokens (``input_ids`` = the targets, per-token fields
    gathered, per-sequence ones kept except ``parent_index`` / ``roles`` (dropped),
    ``cu_seqlens`` counting each sequence's trained tokens; a sequence with none is an empty
    segment). The hidden state that predicts ``rows`` token ``j`` is row
    ``index[j] - 1`` of the sequence-concatenated forward."""
    cu = batch.cu_seqlens.long()
    need = batch.loss_mask.detach().cpu() != 0
    need[cu[:-1][cu[:-1] < cu[1:]]] = False  # a sequence's first token has no predecessor
    index = need.nonzero().squeeze(-1)
    counts = torch.zeros(cu.numel() - 1, dtype=torch.int64)
    if index.numel():
        sid = torch.bucketize(index, cu[1:], right=True)
        counts = torch.bincount(sid, minlength=cu.numel() - 1)
    new_cu = torch.zeros(cu.numel(), dtype=batch.cu_seqlens.dtype)
    new_cu[1:] = torch.cumsum(counts, 0)
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
        mm_token_type_ids=_take(batch.mm_token_type_ids, index),
        ref_logprobs=_take(batch.ref_logprobs, index),
        prox_logprobs=_take(batch.prox_logprobs, index),
        versions=_take(batch.versions, index),
    )
    return rows, index


def microbatches(batch: PackedBatch | Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group the sequences of ``batch`` (or a list of sequence lengths) into micro-batches of
    at most ``max_tokens`` rows each; a sequence longer than that goes alone.

    First-fit decreasing over items: items by cost, largest first (ties: lower first index),
    each into the first micro-batch it fits in, else a new one. An item is one sequence (cost:
    its length) or, for a batch that shares prompts (``PackedBatch.group_ids``,
    ``algo.share_prefix``), a prompt group (``paravt.models.prefix.prefix_groups``) kept
    together at the rows its shared forward holds, ``prompt + sum of suffixes``
    (``shared_cost``); a group over the budget is cut into parts that each fit (each part
    holds the prompt again: recomputed, not carried between forwards), members in order.
    Deterministic; every sequence in exactly one micro-batch; indices ascending inside a
    micro-batch, micro-batches in order of creation (the costliest item's first). Main and
    sub-agent rows are not kept together: each row is scored on its own, so their grouping
    does not change any value; neither does a group's (the shared forward is exact).
    """

    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be >= 1")
    groups = []
    if isinstance(batch, PackedBatch):
        lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
        groups = prefix_groups(batch, range(len(lengths)))
    else:
        lengths = [int(n) for n in batch]
    items: list[tuple[list[int], int]] = []
    grouped: set[int] = set()
    for g in groups:
        part: list[int] = []
        for i in g.members:
            cost = shared_cost([lengths[j] for j in [*part, i]], g.prefix_len)
            if part and cost > max_tokens:
                items.append((part, shared_cost([lengths[j] for j in part], g.prefix_len)))
                part = []
            part.append(i)
        items.append((part, shared_cost([lengths[j] for j in part], g.prefix_len)))
        grouped.update(g.members)
    items += [([i], n) for i, n in enumerate(lengths) if i not in grouped]
    items.sort(key=lambda it: (-it[1], it[0][0]))
    bins: list[list[int]] = []
    loads: list[int] = []
    for members, cost in items:
        for k, load in enumerate(loads):
            if load + cost <= max_tokens:
                bins[k].extend(members)
                loads[k] += cost
                break
        else:
            bins.append(list(members))
            loads.append(cost)
    return [sorted(b) for b in bins]


def concat_packed(batches: Sequence[PackedBatch]) -> PackedBatch:
    """Concatenate packed batches (e.g. every rank's share of a step) into one."""
    cus, off = [torch.zeros(1, dtype=torch.int32)], 0
    for b in batches:
        cus.append(b.cu_seqlens[1:].to(torch.int32) + off)
        off += int(b.cu_seqlens[-1])
    n = off
    parents: list[torch.Tensor | None] = []  # sequence-level: re-based onto the merged rows
    base = 0
    for b in batches:
        v = b.parent_index
        parents.append(None if v is None else torch.where(v >= 0, v + base, v))
        base += b.cu_seqlens.numel() - 1
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
        mm_token_type_ids=_cat_optional([b.mm_token_type_ids for b in batches]),
        parent_index=_cat_optional(parents),
        roles=[r for b in batches for r in b.roles],
        ref_logprobs=_cat_optional([b.ref_logprobs for b in batches]),
        prox_logprobs=_cat_optional([b.prox_logprobs for b in batches]),
        versions=_cat_optional([b.versions for b in batches]),
        group_ids=_cat_optional(_distinct_groups([b.group_ids for b in batches])),
    )
    assert out.input_ids.numel() == n
    return out


def _distinct_groups(parts: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Each batch's group ids moved past the previous batches' (batches number them alike)."""
    out: list[torch.Tensor | None] = []
    base = 0
    for g in parts:
        if g is None:
            out.append(None)
            continue
        out.append(torch.where(g >= 0, g + base, g))
        base += int(g.max()) + 1 if g.numel() else 0
    return out


def _cat_optional(parts: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    return None if any(p is None for p in parts) else torch.cat(parts)  # type: ignore[arg-type]


def _take(v: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    """A per-token field ``(N,)`` at ``index``; None stays None."""
    return None if v is None else v[index]
