"""Torch reference of ``group_advantage``: the CPU path and the test oracle of
``group_advantage_triton.py`` (``ops.group_advantage_op`` with ``impl="torch"``).

Written from the published formula with plain, vectorised torch ops and no host
synchronisation; the result is float32 (statistics in float64, see the body).
"""

from __future__ import annotations

import torch

__all__ = ["group_advantage_torch"]


def group_advantage_torch(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    scale: float = 1.0,
    bias: float = 0.0,
) -> torch.Tensor:
    """Group-relative advantages, ``(B,)`` float32.

    ``A_i = (r_i - mean_g) / (std_g + eps) * scale + bias`` (or ``(r_i - mean_g) * scale + bias``
    when ``normalize_std=False``, Dr. GRPO), where ``g = group_index[i]`` and ``std_g`` is the
    **unbiased** (n-1) standard deviation, as ``torch.std`` in TRL's GRPO. A group of size 1
    has no relative signal and an undefined unbiased std: its advantage is exactly 0 (neither
    ``scale`` nor ``bias`` is applied). Groups may be ragged and interleaved in any order;
    ``group_index`` holds arbitrary int ids (only equality matters).
    """
    # group statistics in float64: B is small, and an fp32 sum of rewards with a large common
    # offset loses the low bits that the centred values are made of.
    r = rewards.double()
    # unique's inverse maps arbitrary ids to 0..G-1 (sorted ids; order of rows is irrelevant).
    _, inv = torch.unique(group_index, return_inverse=True)
    num = r.numel()  # an upper bound on the number of groups: no host sync for G
    count = torch.zeros(num, dtype=r.dtype, device=r.device).index_add_(0, inv, torch.ones_like(r))
    total = torch.zeros(num, dtype=r.dtype, device=r.device).index_add_(0, inv, r)
    n = count[inv]
    mean = total[inv] / n
    centred = r - mean
    if normalize_std:
        # two-pass variance (sum of squared deviations) is stable for large reward offsets.
        ssd = torch.zeros(num, dtype=r.dtype, device=r.device).index_add_(0, inv, centred * centred)
        std = torch.sqrt(ssd[inv] / (n - 1).clamp_min(1.0))
        adv = centred / (std + eps) * scale + bias
    else:
        adv = centred * scale + bias
    return torch.where(n > 1, adv, torch.zeros_like(adv)).float()
