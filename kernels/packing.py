"""Packed-batch helpers shared by the paravt_kernels ops (torch; every path uses them).

Per-token tensors are packed 1-D ``(N,)`` over a batch of ``B`` sequences whose boundaries are
``cu_seqlens`` ``(B+1,)`` int (``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == N``). Used by the
torch references of ``policy_loss`` and ``linear_policy_loss`` (sequence id of each token) and
by the public ``broadcast_to_tokens`` (``api``, after ``group_advantage`` in the trainer's
advantage step). No host synchronisation on the hot path.
"""

from __future__ import annotations

import torch

__all__ = ["broadcast_to_tokens", "seq_ids_from_cu_seqlens"]


def seq_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Sequence id of every token, ``(N,)`` int64, from ``cu_seqlens`` ``(B+1,)`` (no host sync).

    Tokens outside ``[cu_seqlens[0], cu_seqlens[-1])`` (padding of a fixed-size buffer) belong
    to no sequence and get id ``B``: size per-sequence buffers ``B + 1`` and drop the last slot.
    """
    cu = cu_seqlens.long()
    nseq = cu.numel() - 1
    # one extra "sequence" B takes the head [0, cu[0]) and one the tail [cu[-1], N)
    lengths = torch.cat([cu[:1], cu[1:] - cu[:-1], total_tokens - cu[-1:]])
    ids = torch.arange(-1, nseq + 1, device=cu.device)
    ids[0] = nseq
    return torch.repeat_interleave(ids, lengths, output_size=total_tokens)


def broadcast_to_tokens(
    seq_values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    parent_index: torch.Tensor | None = None,
    total_tokens: int | None = None,
) -> torch.Tensor:
    """Spread one value per sequence over that sequence's tokens in a packed batch.

    ``seq_values`` ``(B,)``, ``cu_seqlens`` ``(B+1,)`` -> ``(N,)`` with ``N = cu_seqlens[-1]``.
    ``parent_index`` ``(B,)`` int: ``parent_index[i] >= 0`` makes sub-agent sequence ``i`` take
    the value of main sequence ``parent_index[i]``; ``-1`` marks a main sequence (own value).
    Pass ``total_tokens`` (= N) to avoid the one host read of ``cu_seqlens[-1]``.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() != seq_values.numel() + 1:
        raise ValueError(
            f"cu_seqlens has shape {tuple(cu_seqlens.shape)} but seq_values has "
            f"{seq_values.numel()} sequences: cu_seqlens must be (B+1,) = ({seq_values.numel() + 1},)"
        )
    values = seq_values
    if parent_index is not None:
        if parent_index.shape != seq_values.shape:
            raise ValueError(
                f"parent_index has shape {tuple(parent_index.shape)}, expected "
                f"{tuple(seq_values.shape)} (one parent per sequence, -1 for main sequences)"
            )
        pi = parent_index.long()
        values = torch.where(pi >= 0, seq_values[pi.clamp_min(0)], seq_values)
    if total_tokens is None:
        total_tokens = int(cu_seqlens[-1])
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(values, lengths, output_size=total_tokens)
