"""Shared prompts: the G rollouts of a group share their prompt, encoded once per forward.

The G main rows of a group (``Trajectory.group_id``) begin with the same tokens: the system
text, the K overview frames' placeholders and the question (and their visual inputs are the
same clip). Only what follows (generated turns, tool responses) differs. With
``algo.share_prefix`` (``paravt.algo.packing.pack_units`` fills ``PackedBatch.group_ids``) a
packed forward lays such a group out as ``[prefix; suffix_1; ...; suffix_G]``: the prefix's
tokens (and its visual segments, through the vision tower) once, then each member's own
suffix. The attention that keeps this exact (``paravt.models.forward``): prefix tokens attend
causally among themselves; each suffix attends to the whole prefix and causally to itself,
with its positions (mrope) continuing from the prefix, as in the unshared sequence.

What is shared is decided from the data, never assumed (``prefix_groups``): the members'
longest common prefix of token ids and modality types, shortened so that it never cuts a
visual segment's placeholders, and only over visual segments whose pixels are equal
(``visuals_equal``: the same object, or equal tensors after a rank move). So a wrong or
colliding ``group_id`` costs sharing, never exactness. Each member keeps at least one token of
its own suffix.

``SharedLayout`` maps the unshared layout (the sequences ``seqs`` concatenated, what every
caller indexes) onto the shared rows: ``row_of[t]`` is the shared row holding unshared
position ``t``. Callers read hidden rows through it (``paravt.models.forward.packed_hidden_rows``),
so a log-prob, a loss or a gradient is the same whichever layout ran; the prefix's gradient is
the sum over its members (autograd accumulates through the gather).

Used by every packed forward (``paravt.models.forward._packed_inputs``): the trainer's
proximal, reference and policy passes, and cold-start SFT. Micro-batching keeps a group
together (``paravt.algo.packing.microbatches``, ``shared_cost``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from paravt.types import PackedBatch, VisualInputs
from paravt.vision.preprocess import MM_TEXT


@dataclass(frozen=True)
class PrefixGroup:
    """Sequences ``members`` (batch indices, ascending) whose first ``prefix_len`` tokens are
    equal, with their first ``prefix_segments`` visual segments (all inside the prefix)."""

    members: tuple[int, ...]
    prefix_len: int
    prefix_segments: int


@dataclass
class SharedLayout:
    """Where each row of a shared forward comes from (see the module docstring).

    ``src`` ``(M,)``: the unshared position of each shared row; ``row_of`` ``(N,)``: the
    shared row of each unshared position; ``blocks``: ``(q0, q1, p0, p1)`` per attention
    block: queries ``[q0, q1)`` attend causally to themselves and fully to the prefix rows
    ``[p0, p1)`` (empty for a prefix or an ungrouped sequence); ``visuals``: ``(k, s0, s1)``,
    segments ``[s0, s1)`` of the ``k``-th sequence of ``seqs``, in the order their
    placeholders appear in the shared rows."""

    src: torch.Tensor
    row_of: torch.Tensor
    blocks: list[tuple[int, int, int, int]]
    visuals: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def shared(self) -> bool:
        """Some block reads a prefix (else the layout is the unshared one)."""
        return any(p1 > p0 for _, _, p0, p1 in self.blocks)

    @property
    def num_rows(self) -> int:
        return int(self.src.numel())


def segment_tokens(v: VisualInputs | None, placeholders: int) -> list[int]:
    """Placeholder tokens of each visual segment of ``v``, given the sequence's total
    ``placeholders``: ``t h w / merge²`` per segment, the merge read off the total (every
    segment of a model has the same), so no caller needs the model's config."""
    if v is None or not v.num_segments:
        return []
    patches = [int(x) for x in v.grid_thw.prod(-1).tolist()]
    total = sum(patches)
    if placeholders <= 0 or total % placeholders:
        raise ValueError(
            f"{placeholders} visual placeholders for {total} patches: the tokens and the visual "
            "inputs do not belong together (build them with encode_clip)"
        )
    return [n * placeholders // total for n in patches]


def split_visuals(v: VisualInputs | None, s0: int, s1: int) -> VisualInputs | None:
    """Segments ``[s0, s1)`` of ``v`` (pixels, grids and per-segment fields), None if empty."""
    if v is None or s1 <= s0:
        return None
    if s0 == 0 and s1 == v.num_segments:
        return v
    patches = v.grid_thw.prod(-1).tolist()
    a, b = sum(patches[:s0]), sum(patches[:s1])
    return VisualInputs(
        v.pixel_values[a:b],
        v.grid_thw[s0:s1],
        v.kind,
        None if v.second_per_grid_ts is None else v.second_per_grid_ts[s0:s1],
        None if v.frames is None else v.frames[s0:s1],
        None if v.timestamps is None else v.timestamps[s0:s1],
    )


def visuals_equal(a: VisualInputs | None, b: VisualInputs | None, m: int) -> int:
    """How many of the first ``m`` segments of ``a`` and ``b`` are equal (kind, grid, pixels
    and Qwen2.5-VL's seconds per grid): ``m`` when all are. The same object is equal without a
    look (a group's members carry one clip object in one process); after a rank move
    (pickled copies) the tensors are compared."""
    if m == 0:
        return 0
    if a is None or b is None:
        return 0
    if a is b:
        return m
    if a.kind != b.kind:
        return 0
    pa = a.grid_thw.prod(-1).tolist()
    pb = b.grid_thw.prod(-1).tolist()
    oa = ob = 0
    for k in range(m):
        if not torch.equal(a.grid_thw[k], b.grid_thw[k]):
            return k
        sa, sb = a.second_per_grid_ts, b.second_per_grid_ts
        if (sa is None) != (sb is None) or (sa is not None and float(sa[k]) != float(sb[k])):
            return k
        xa, xb = a.pixel_values[oa : oa + pa[k]], b.pixel_values[ob : ob + pb[k]]
        # Views of one tensor (a group's clip concatenated into each later-turn context) are
        # equal without a look at their pixels.
        same_view = xa.data_ptr() == xb.data_ptr() and xa.stride() == xb.stride()
        if not (same_view and xa.shape == xb.shape) and not torch.equal(xa, xb):
            return k
        oa, ob = oa + pa[k], ob + pb[k]
    return m


def _common_prefix(x: torch.Tensor, y: torch.Tensor) -> int:
    n = min(x.numel(), y.numel())
    diff = (x[:n] != y[:n]).nonzero()
    return int(diff[0]) if diff.numel() else n


def clean_cut(
    types: Sequence[int] | torch.Tensor, v: VisualInputs | None, p: int
) -> tuple[int, int]:
    """``(p', k)``: the largest ``p' <= p`` that cuts no visual segment's placeholders of a
    sequence with modality ``types`` and visuals ``v``, and the ``k`` segments wholly before
    it (a cut inside segment ``k`` moves to its first placeholder)."""
    pos, seg = _placeholders(types, v)
    before = sum(1 for t in pos if t < p)
    k, acc = 0, 0
    while k < len(seg) and acc + seg[k] <= before:
        acc += seg[k]
        k += 1
    if before > acc:  # inside segment k: the prefix ends before its first placeholder
        p = pos[acc]
    return p, k


def common_prefix(
    ids_a: torch.Tensor,
    types_a: torch.Tensor,
    v_a: VisualInputs | None,
    ids_b: torch.Tensor,
    types_b: torch.Tensor,
    v_b: VisualInputs | None,
    limit: int,
) -> tuple[int, int]:
    """``(p, k)``: how many leading tokens two sequences can encode once, at most ``limit``:
    their longest common prefix of token ids and modality types, cut so that no visual
    segment is split (``clean_cut``) and ending before the first segment whose pixels differ
    (``visuals_equal``); ``k`` segments lie inside. One rule for the trainer's groups
    (``prefix_groups``) and the HF engine's shared prefill (``paravt.engines.hf``)."""
    p = min(limit, _common_prefix(ids_a, ids_b), _common_prefix(types_a, types_b))
    p, k = clean_cut(types_a, v_a, p)
    same = visuals_equal(v_a, v_b, k)
    if same < k:
        p, k = _segment_start(types_a, v_a, same), same
    return p, k


def _placeholders(
    types: Sequence[int] | torch.Tensor, v: VisualInputs | None
) -> tuple[list[int], list[int]]:
    """The positions of a sequence's visual placeholders and each segment's count of them."""
    pos = (torch.as_tensor(types) != MM_TEXT).nonzero().squeeze(-1).tolist()
    return pos, segment_tokens(v, len(pos))


def _segment_start(types: torch.Tensor, v: VisualInputs | None, k: int) -> int:
    """Position of the first placeholder of segment ``k``."""
    pos, seg = _placeholders(types, v)
    return pos[sum(seg[:k])]


def prefix_groups(batch: PackedBatch, seqs: Sequence[int]) -> list[PrefixGroup]:
    """The shared-prompt groups among sequences ``seqs`` of ``batch`` (see the module
    docstring): by ``batch.group_ids`` (none without it: sharing off), each with at least two
    members and a prefix of at least one token (``common_prefix`` of its first member and
    each other, each member keeping a token of its own). Deterministic; groups ordered by
    first member."""
    if batch.group_ids is None:
        return []
    by_id: dict[int, list[int]] = {}
    for i in seqs:
        g = int(batch.group_ids[i])
        if g >= 0:
            by_id.setdefault(g, []).append(int(i))
    cu = batch.cu_seqlens.tolist()
    mm = batch.token_types()
    out = []
    for members in by_id.values():
        if len(members) < 2:
            continue
        members = sorted(members)
        a0, b0 = cu[members[0]], cu[members[0] + 1]
        first = (batch.input_ids[a0:b0], mm[a0:b0], batch.visuals[members[0]])
        p = min(cu[i + 1] - cu[i] for i in members) - 1  # each member keeps a suffix token
        for i in members[1:]:
            a, b = cu[i], cu[i + 1]
            p = common_prefix(*first, batch.input_ids[a:b], mm[a:b], batch.visuals[i], p)[0]
        if p >= 1:
            out.append(PrefixGroup(tuple(members), p, clean_cut(first[1], first[2], p)[1]))
    return sorted(out, key=lambda g: g.members[0])


def shared_cost(lengths: Sequence[int], prefix_len: int) -> int:
    """Rows a shared forward holds for members of ``lengths`` sharing ``prefix_len`` tokens."""
    return prefix_len + sum(n - prefix_len for n in lengths)


def shared_rows(batch: PackedBatch, seqs: Sequence[int]) -> int:
    """Rows of one forward over ``seqs`` with their prompt groups shared: the cost that rank
    balancing evens out (``paravt.algo.packing.balance_units``)."""
    cu = batch.cu_seqlens.tolist()
    total = sum(cu[i + 1] - cu[i] for i in seqs)
    return total - sum((len(g.members) - 1) * g.prefix_len for g in prefix_groups(batch, seqs))


def shared_layout(
    batch: PackedBatch, seqs: Sequence[int], groups: Sequence[PrefixGroup]
) -> SharedLayout:
    """The layout of one forward over ``seqs`` with ``groups`` (from ``prefix_groups`` over
    the same ``seqs``) encoded once each; ``groups=[]`` gives the unshared layout. Rows come in
    ``seqs`` order, a group's prefix and suffixes at its first member's place."""
    cu = batch.cu_seqlens.tolist()
    pos = {int(i): k for k, i in enumerate(seqs)}
    lengths = [cu[i + 1] - cu[i] for i in seqs]
    off = [0]
    for n in lengths:
        off.append(off[-1] + n)
    n_seg = [0 if batch.visuals[i] is None else batch.visuals[i].num_segments for i in seqs]
    first: dict[int, PrefixGroup] = {}
    grouped: set[int] = set()
    for g in groups:
        first[pos[g.members[0]]] = g
        grouped.update(pos[i] for i in g.members)
    src: list[torch.Tensor] = []
    row_of = torch.empty(off[-1], dtype=torch.long)
    blocks: list[tuple[int, int, int, int]] = []
    visuals: list[tuple[int, int, int]] = []
    r = 0
    for k in range(len(seqs)):
        if k in first:
            g = first[k]
            p = g.prefix_len
            a = r
            src.append(torch.arange(off[k], off[k] + p))
            blocks.append((a, a + p, 0, 0))
            visuals.append((k, 0, g.prefix_segments))
            r += p
            for i in g.members:
                j = pos[i]
                row_of[off[j] : off[j] + p] = torch.arange(a, a + p)
                n = lengths[j] - p
                src.append(torch.arange(off[j] + p, off[j + 1]))
                row_of[off[j] + p : off[j + 1]] = torch.arange(r, r + n)
                blocks.append((r, r + n, a, a + p))
                visuals.append((j, g.prefix_segments, n_seg[j]))
                r += n
        elif k not in grouped:
            n = lengths[k]
            src.append(torch.arange(off[k], off[k + 1]))
            row_of[off[k] : off[k + 1]] = torch.arange(r, r + n)
            blocks.append((r, r + n, 0, 0))
            visuals.append((k, 0, n_seg[k]))
            r += n
    src_t = torch.cat(src) if src else torch.zeros(0, dtype=torch.long)
    return SharedLayout(src_t, row_of, blocks, [v for v in visuals if v[2] > v[1]])
