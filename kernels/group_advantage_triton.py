"""Group-relative advantage (Triton): segmented mean/std over arbitrary group ids, no syncs.

``_group_advantage_kernel``: program ``p`` owns sequences ``[p*BLOCK_I, (p+1)*BLOCK_I)`` and
sweeps all ``B`` sequences in ``BLOCK_J`` tiles, comparing group ids (``[BLOCK_I, BLOCK_J]``
equality tile) to accumulate its rows' group count and sum, then, in a second sweep, the sum
of squared deviations from the group mean (two-pass variance, float64 accumulation: stable
when rewards carry a large common offset). The ``O(B^2)`` comparisons are free at RL batch sizes (B = 1024:
1M compares) and buy three things: ids in any order, ragged groups, and no host sync to
learn the number of groups (``torch.unique`` would need one on CUDA).

Maths: ``group_advantage_reference.group_advantage_torch``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import lazy_jit, next_pow2
from .dispatch import interpreting


@lazy_jit
def _group_advantage_kernel(
    r_ptr, g_ptr, out_ptr, n, eps, scale, bias,
    NORMALIZE: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    i = pid * BLOCK_I + tl.arange(0, BLOCK_I)
    mi = i < n
    gi = tl.load(g_ptr + i, mask=mi, other=0)
    ri = tl.load(r_ptr + i, mask=mi, other=0.0).to(tl.float64)
    cnt = tl.zeros([BLOCK_I], tl.float64)
    tot = tl.zeros([BLOCK_I], tl.float64)
    for j0 in range(0, n, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        mj = j < n
        gj = tl.load(g_ptr + j, mask=mj, other=0)
        rj = tl.load(r_ptr + j, mask=mj, other=0.0).to(tl.float64)
        eq = (gi[:, None] == gj[None, :]) & mj[None, :]
        cnt += tl.sum(eq.to(tl.float64), 1)
        tot += tl.sum(tl.where(eq, rj[None, :], 0.0), 1)
    mean = tot / tl.maximum(cnt, 1.0)
    centred = ri - mean
    if NORMALIZE:
        ssd = tl.zeros([BLOCK_I], tl.float64)
        for j0 in range(0, n, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            mj = j < n
            gj = tl.load(g_ptr + j, mask=mj, other=0)
            rj = tl.load(r_ptr + j, mask=mj, other=0.0).to(tl.float64)
            eq = (gi[:, None] == gj[None, :]) & mj[None, :]
            dev = rj[None, :] - mean[:, None]
            ssd += tl.sum(tl.where(eq, dev * dev, 0.0), 1)
        std = tl.sqrt(ssd / tl.maximum(cnt - 1.0, 1.0))
        adv = centred / (std + eps) * scale + bias
    else:
        adv = centred * scale + bias
    adv = tl.where(cnt > 1.0, adv, 0.0)
    tl.store(out_ptr + i, adv.to(tl.float32), mask=mi)


def group_advantage_triton(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    normalize_std: bool,
    eps: float,
    scale: float,
    bias: float,
) -> torch.Tensor:
    """Triton twin of ``group_advantage_reference.group_advantage_torch``: ``(B,)`` float32."""
    n = rewards.numel()
    out = torch.empty(n, dtype=torch.float32, device=rewards.device)
    if n == 0:
        return out
    if interpreting():
        # the interpreter runs programs one by one: one program, one sweep where possible.
        bi = bj = min(next_pow2(n), 1024)
    else:
        # 64 rows x 128 columns: 8K-element equality tile per iteration, B/64 programs.
        bi, bj = 64, 128
    grid = (triton.cdiv(n, bi),)
    _group_advantage_kernel[grid](
        rewards, group_index, out, n, float(eps), float(scale), float(bias),
        NORMALIZE=bool(normalize_std), BLOCK_I=bi, BLOCK_J=bj,
    )  # fmt: skip
    return out
