"""Fused PPO policy loss (Triton): one pass forms per-token loss, gradient and statistics.

Kernels (grid ``(B, SPLIT)``: program ``(s, k)`` walks the k-th slice of sequence ``s``):

* ``_policy_loss_fwd_kernel`` reads logprob, old, advantages, mask (+ ref, prox) once, writes
  the un-normalised per-token gradient ``m_t dl_t/dlogprob`` and per-(sequence, slice) partial
  sums (loss, mask mass, KL, clip counts, ratio sum/min/max, masked/capped counts). Partials
  are written to distinct slots (no atomics), so results are deterministic.
* a few ``(B,)``-sized torch ops turn the partials into per-sequence aggregation
  coefficients ``coef_s`` (token-mean | seq-mean-token-mean | seq-mean-token-sum, see
  ``reference.aggregation_weights``), the loss and the statistics, without host syncs.
* ``_policy_loss_scale_kernel`` multiplies the gradient by ``coef_s`` in place, so the
  autograd backward is a single multiply by the incoming scalar.

The maths is ``reference.policy_token_terms`` / ``reference.policy_loss_fused_torch``.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._triton_utils import lazy_jit, next_pow2, num_sms
from .dispatch import interpreting
from .reference import K3_LOG_RATIO_CLAMP, seq_coefficients

# Partial-sum slots written per (sequence, slice) program.
_P_LOSS, _P_MASS, _P_KL, _P_LOW, _P_HIGH, _P_DUAL, _P_ANY, _P_RATIO = range(8)
_P_RMIN, _P_RMAX, _P_CAPPED, _P_MASKED_IN = range(8, 12)
_NUM_PARTIALS = 12
_KL_CODE = {"k1": 1, "k2": 2, "k3": 3}
# 1024 fp32 lanes x ~6 streams per iteration keeps enough bytes in flight per SM on Hopper.
_GPU_BLOCK = 1024


@lazy_jit
def _policy_loss_fwd_kernel(
    lp_ptr, old_ptr, adv_ptr, mask_ptr, ref_ptr, prox_ptr, cu_ptr, gbuf_ptr, part_ptr,
    n_slots, clip_low, clip_high, dual_clip, behav_cap, kl_coef, k3_clamp,
    SPLIT: tl.constexpr, BLOCK: tl.constexpr, HAS_REF: tl.constexpr, HAS_PROX: tl.constexpr,
    HAS_DUAL: tl.constexpr, HAS_CAP: tl.constexpr, KL_TYPE: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    k = tl.program_id(1)
    start = tl.load(cu_ptr + s).to(tl.int64)
    end = tl.load(cu_ptr + s + 1).to(tl.int64)
    per = (end - start + SPLIT - 1) // SPLIT
    lo = start + k * per
    hi = tl.minimum(lo + per, end)

    a_loss = tl.zeros([BLOCK], tl.float32)
    a_mass = tl.zeros([BLOCK], tl.float32)
    a_kl = tl.zeros([BLOCK], tl.float32)
    a_low = tl.zeros([BLOCK], tl.float32)
    a_high = tl.zeros([BLOCK], tl.float32)
    a_dual = tl.zeros([BLOCK], tl.float32)
    a_any = tl.zeros([BLOCK], tl.float32)
    a_ratio = tl.zeros([BLOCK], tl.float32)
    a_rmin = tl.full([BLOCK], float("inf"), tl.float32)
    a_rmax = tl.full([BLOCK], float("-inf"), tl.float32)
    a_capped = tl.zeros([BLOCK], tl.float32)
    a_masked = tl.zeros([BLOCK], tl.float32)
    for off in range(lo, hi, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        inb = idx < hi
        m = tl.load(mask_ptr + idx, mask=inb, other=0.0).to(tl.float32)
        lp = tl.load(lp_ptr + idx, mask=inb, other=0.0).to(tl.float32)
        old = tl.load(old_ptr + idx, mask=inb, other=0.0).to(tl.float32)
        adv = tl.load(adv_ptr + idx, mask=inb, other=0.0).to(tl.float32)
        capped = m < 0.0  # all-false, typed like a comparison
        if HAS_PROX:
            base = tl.load(prox_ptr + idx, mask=inb, other=0.0).to(tl.float32)
            behav = tl.exp(base - old)
            if HAS_CAP:
                capped = (behav > behav_cap) & (m > 0.0)
                behav = tl.minimum(behav, behav_cap)
        else:
            base = old
            behav = tl.full([BLOCK], 1.0, tl.float32)
        ratio = tl.exp(lp - base)
        pg1 = -adv * ratio
        pg2 = -adv * tl.minimum(tl.maximum(ratio, 1.0 - clip_low), 1.0 + clip_high)
        pg = tl.maximum(pg1, pg2)
        dpg = tl.where(pg1 >= pg2, pg1, 0.0)
        dual = m < 0.0
        if HAS_DUAL:
            pg3 = -adv * dual_clip
            dual = (adv < 0.0) & (pg3 < pg)
            pg = tl.where(dual, pg3, pg)
            dpg = tl.where(dual, 0.0, dpg)
        loss = pg * behav
        dloss = dpg * behav
        kl = tl.zeros([BLOCK], tl.float32)
        if HAS_REF:
            ref = tl.load(ref_ptr + idx, mask=inb, other=0.0).to(tl.float32)
            if KL_TYPE == 1:
                kl = lp - ref
                dkl = tl.full([BLOCK], 1.0, tl.float32)
            elif KL_TYPE == 2:
                kl = 0.5 * (lp - ref) * (lp - ref)
                dkl = lp - ref
            else:
                d = ref - lp
                dc = tl.minimum(tl.maximum(d, -k3_clamp), k3_clamp)
                e = tl.exp(dc)
                kl = e - dc - 1.0
                dkl = tl.where((d >= -k3_clamp) & (d <= k3_clamp), 1.0 - e, 0.0)
            loss = loss + kl_coef * kl
            dloss = dloss + kl_coef * dkl
        m_eff = tl.where(capped, 0.0, m)
        tl.store(gbuf_ptr + idx, m_eff * dloss, mask=inb)
        low = ((ratio < 1.0 - clip_low) & (adv < 0.0)).to(tl.float32)
        high = ((ratio > 1.0 + clip_high) & (adv > 0.0)).to(tl.float32)
        on = m_eff > 0.0
        a_loss += m_eff * loss
        a_mass += m_eff
        a_kl += m_eff * kl
        a_low += m_eff * low
        a_high += m_eff * high
        a_dual += m_eff * dual.to(tl.float32)
        a_any += m_eff * tl.maximum(low, high)
        a_ratio += m_eff * ratio
        a_rmin = tl.minimum(a_rmin, tl.where(on, ratio, float("inf")))
        a_rmax = tl.maximum(a_rmax, tl.where(on, ratio, float("-inf")))
        a_capped += capped.to(tl.float32)
        a_masked += (inb & (m <= 0.0)).to(tl.float32)

    slot = s * SPLIT + k
    tl.store(part_ptr + 0 * n_slots + slot, tl.sum(a_loss, 0))
    tl.store(part_ptr + 1 * n_slots + slot, tl.sum(a_mass, 0))
    tl.store(part_ptr + 2 * n_slots + slot, tl.sum(a_kl, 0))
    tl.store(part_ptr + 3 * n_slots + slot, tl.sum(a_low, 0))
    tl.store(part_ptr + 4 * n_slots + slot, tl.sum(a_high, 0))
    tl.store(part_ptr + 5 * n_slots + slot, tl.sum(a_dual, 0))
    tl.store(part_ptr + 6 * n_slots + slot, tl.sum(a_any, 0))
    tl.store(part_ptr + 7 * n_slots + slot, tl.sum(a_ratio, 0))
    tl.store(part_ptr + 8 * n_slots + slot, tl.min(a_rmin, 0))
    tl.store(part_ptr + 9 * n_slots + slot, tl.max(a_rmax, 0))
    tl.store(part_ptr + 10 * n_slots + slot, tl.sum(a_capped, 0))
    tl.store(part_ptr + 11 * n_slots + slot, tl.sum(a_masked, 0))


@lazy_jit
def _policy_loss_scale_kernel(gbuf_ptr, coef_ptr, cu_ptr, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.program_id(0)
    k = tl.program_id(1)
    start = tl.load(cu_ptr + s).to(tl.int64)
    end = tl.load(cu_ptr + s + 1).to(tl.int64)
    per = (end - start + SPLIT - 1) // SPLIT
    lo = start + k * per
    hi = tl.minimum(lo + per, end)
    c = tl.load(coef_ptr + s)
    for off in range(lo, hi, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        inb = idx < hi
        g = tl.load(gbuf_ptr + idx, mask=inb, other=0.0)
        tl.store(gbuf_ptr + idx, g * c, mask=inb)


def _launch_shape(n_tokens: int, n_seq: int, device: torch.device) -> tuple[int, int]:
    """(SPLIT, BLOCK). Interpreter: one program per sequence with one big block (programs run
    serially there). GPU: enough (sequence, slice) programs to fill every SM several times."""
    if interpreting() or device.type != "cuda":
        return 1, min(next_pow2(max(n_tokens // max(n_seq, 1), 1)), 4096)
    target = 8 * num_sms(device)
    split = max(1, min(64, target // max(n_seq, 1)))
    return split, _GPU_BLOCK


def policy_loss_fused_triton(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    ref_logprob: torch.Tensor | None,
    prox_logprob: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    seq_weights: torch.Tensor | None,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    behav_cap: float | None,
    kl_coef: float,
    kl_type: str,
    agg: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of ``reference.policy_loss_fused_torch``: ``(loss, grad (N,), stats (11,))``."""
    dev = logprob.device
    n = logprob.numel()
    if cu_seqlens is None:
        cu = torch.tensor([0, n], dtype=torch.int64, device=dev)
    else:
        cu = cu_seqlens.to(torch.int64)
    n_seq = cu.numel() - 1
    split, block = _launch_shape(n, n_seq, dev)
    n_slots = n_seq * split
    grad = torch.empty(n, dtype=torch.float32, device=dev)
    part = torch.empty(_NUM_PARTIALS * n_slots, dtype=torch.float32, device=dev)
    dummy = logprob  # never read when the matching HAS_* flag is off
    grid = (n_seq, split)
    if n_seq > 0:
        _policy_loss_fwd_kernel[grid](
            logprob, old_logprob, advantages, loss_mask,
            dummy if ref_logprob is None else ref_logprob,
            dummy if prox_logprob is None else prox_logprob,
            cu, grad, part, n_slots, float(clip_low), float(clip_high),
            float(dual_clip or 0.0), float(behav_cap or 0.0), float(kl_coef),
            float(K3_LOG_RATIO_CLAMP),
            SPLIT=split, BLOCK=block, HAS_REF=ref_logprob is not None,
            HAS_PROX=prox_logprob is not None, HAS_DUAL=dual_clip is not None,
            HAS_CAP=behav_cap is not None and prox_logprob is not None,
            KL_TYPE=_KL_CODE[kl_type],
        )  # fmt: skip
    p = part.view(_NUM_PARTIALS, n_seq, split)
    sums = p.sum(dim=2)
    loss_s, mass_s = sums[_P_LOSS], sums[_P_MASS]
    w = (
        seq_weights.float()
        if seq_weights is not None
        else torch.ones(n_seq, dtype=torch.float32, device=dev)
    )
    coef = seq_coefficients(mass_s, w, agg)
    coef = coef.contiguous()
    loss = (coef * loss_s).sum()
    if n_seq > 0:
        _policy_loss_scale_kernel[grid](grad, coef, cu, SPLIT=split, BLOCK=block)
    tot = sums.sum(dim=1)
    n_tok = tot[_P_MASS]
    den = n_tok.clamp_min(1e-30)
    any_on = n_tok > 0
    rmin = p[_P_RMIN].amin() if n_slots else torch.zeros((), device=dev)
    rmax = p[_P_RMAX].amax() if n_slots else torch.zeros((), device=dev)
    stats = torch.stack(
        [
            tot[_P_LOW] / den,
            tot[_P_HIGH] / den,
            tot[_P_DUAL] / den,
            tot[_P_ANY] / den,
            tot[_P_KL] / den,
            tot[_P_RATIO] / den,
            torch.where(any_on, rmin, 0.0),
            torch.where(any_on, rmax, 0.0),
            n_tok,
            tot[_P_MASKED_IN] + tot[_P_CAPPED],
            tot[_P_CAPPED],
        ]
    )
    return loss, grad, stats
