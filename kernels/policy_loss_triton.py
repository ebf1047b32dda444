"""Fused PPO policy loss (Triton): one pass forms per-token loss, gradient and statistics.

Kernels (grid ``(B, SPLIT)``: program ``(s, k)`` walks the k-th slice of sequence ``s``; the
first and last sequences' walks also take the rows before ``cu[0]`` and from ``cu[-1]`` on,
which belong to no sequence, so every row of an output is written, with 0 there):

* ``_policy_loss_fwd_kernel`` reads logprob, old, advantages, mask (+ ref, prox) once, writes
  the un-normalised per-token gradient ``gbuf_t = m_t dl_t/dlogprob`` and per-(sequence,
  slice) partial sums (loss, mask mass, KL, clip counts, ratio sum/min/max, masked/capped
  counts). Partials are written to distinct slots (no atomics), so results are deterministic.
  Masked tokens are selected away (``where``), never multiplied by 0: their inputs may be
  -inf or NaN (``0 * inf = NaN``).
* a few ``(B,)``-sized torch ops turn the partials into per-sequence aggregation
  coefficients ``coef_s`` (token-mean | seq-mean-token-mean | seq-mean-token-sum, see
  ``reference.aggregation_weights``), the loss and the statistics, without host syncs.
* ``_policy_loss_grad_kernel`` (the autograd backward) writes
  ``dloss/dlogprob_t = grad_loss * coef_s gbuf_t`` in the log-prob dtype: the gradient is
  written once in the forward and read once in the backward.

Without ``cu_seqlens`` the kernels take the whole batch as one sequence (``HAS_CU=False``),
so no ``[0, N]`` tensor is copied to the device.

The maths is ``reference.policy_token_terms`` / ``reference.policy_loss_fused_torch``.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._triton_utils import lazy_jit, next_pow2, num_sms
from .dispatch import interpreting
from .options import PolicyLossOptions, PolicyTokens
from .reference import K3_KL_CLAMP, K3_LOG_RATIO_CLAMP, LOG_RATIO_CLAMP, seq_coefficients

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
    n_slots, n_seq, n_total, clip_low, clip_high, dual_clip, behav_cap, kl_coef, k3_clamp,
    k3_kl_clamp, lr_clamp,
    SPLIT: tl.constexpr, BLOCK: tl.constexpr, HAS_CU: tl.constexpr, HAS_REF: tl.constexpr,
    HAS_PROX: tl.constexpr, HAS_DUAL: tl.constexpr, HAS_CAP: tl.constexpr,
    KL_TYPE: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    k = tl.program_id(1)
    # sequence [start, end); walk [w_lo, w_hi): see the module docstring
    if HAS_CU:
        start = tl.load(cu_ptr + s).to(tl.int64)
        end = tl.load(cu_ptr + s + 1).to(tl.int64)
    else:
        start = tl.zeros([], tl.int64)
        end = start + n_total
    w_lo = tl.where(s == 0, 0, start)
    w_hi = tl.where(s == n_seq - 1, n_total, end)
    per = (w_hi - w_lo + SPLIT - 1) // SPLIT
    lo = w_lo + k * per
    hi = tl.minimum(lo + per, w_hi)

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
        seq = inb & (idx >= start) & (idx < end)  # rows of sequence s (not head/tail padding)
        m = tl.load(mask_ptr + idx, mask=inb, other=0.0).to(tl.float32)
        lp = tl.load(lp_ptr + idx, mask=inb, other=0.0).to(tl.float32)
        old = tl.load(old_ptr + idx, mask=inb, other=0.0).to(tl.float32)
        adv = tl.load(adv_ptr + idx, mask=inb, other=0.0).to(tl.float32)
        capped = m < m  # all-false, typed like a comparison
        if HAS_PROX:
            base = tl.load(prox_ptr + idx, mask=inb, other=0.0).to(tl.float32)
            behav = tl.exp(tl.minimum(tl.maximum(base - old, -lr_clamp), lr_clamp))
            if HAS_CAP:
                capped = (behav > behav_cap) & (m > 0.0) & seq
                behav = tl.minimum(behav, behav_cap)
        else:
            base = old
            behav = tl.full([BLOCK], 1.0, tl.float32)
        d = lp - base
        ratio = tl.exp(tl.minimum(tl.maximum(d, -lr_clamp), lr_clamp))
        pg1 = -adv * ratio
        pg2 = -adv * tl.minimum(tl.maximum(ratio, 1.0 - clip_low), 1.0 + clip_high)
        pg = tl.maximum(pg1, pg2)
        # the ratio's derivative is 0 where the log-ratio is clamped (as torch.clamp's)
        dpg = tl.where((pg1 >= pg2) & (d >= -lr_clamp) & (d <= lr_clamp), pg1, 0.0)
        dual = m < m
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
                dr = ref - lp
                dc = tl.minimum(tl.maximum(dr, -k3_clamp), k3_clamp)
                e = tl.exp(dc)
                raw = e - dc - 1.0
                kl = tl.minimum(tl.maximum(raw, -k3_kl_clamp), k3_kl_clamp)  # verl low_var_kl
                inside = (dr >= -k3_clamp) & (dr <= k3_clamp)
                inside = inside & (raw >= -k3_kl_clamp) & (raw <= k3_kl_clamp)
                dkl = tl.where(inside, 1.0 - e, 0.0)
            loss = loss + kl_coef * kl
            dloss = dloss + kl_coef * dkl
        # select, never multiply by the mask: values at masked tokens may be inf or NaN
        on = seq & (m > 0.0) & (capped == 0)
        m_on = tl.where(on, m, 0.0)
        tl.store(gbuf_ptr + idx, tl.where(on, m * dloss, 0.0), mask=inb)
        low = (ratio < 1.0 - clip_low) & (adv < 0.0)
        high = (ratio > 1.0 + clip_high) & (adv > 0.0)
        a_loss += tl.where(on, m * loss, 0.0)
        a_mass += m_on
        a_kl += tl.where(on, m * kl, 0.0)
        a_low += tl.where(on & low, m, 0.0)
        a_high += tl.where(on & high, m, 0.0)
        a_dual += tl.where(on & dual, m, 0.0)
        a_any += tl.where(on & (low | high), m, 0.0)
        a_ratio += tl.where(on, m * ratio, 0.0)
        a_rmin = tl.minimum(a_rmin, tl.where(on, ratio, float("inf")))
        a_rmax = tl.maximum(a_rmax, tl.where(on, ratio, float("-inf")))
        a_capped += capped.to(tl.float32)
        a_masked += (seq & (m <= 0.0)).to(tl.float32)

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
def _policy_loss_grad_kernel(
    gbuf_ptr, coef_ptr, gl_ptr, cu_ptr, out_ptr, n_seq, n_total,
    SPLIT: tl.constexpr, BLOCK: tl.constexpr, HAS_CU: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    k = tl.program_id(1)
    if HAS_CU:
        start = tl.load(cu_ptr + s).to(tl.int64)
        end = tl.load(cu_ptr + s + 1).to(tl.int64)
    else:
        start = tl.zeros([], tl.int64)
        end = start + n_total
    w_lo = tl.where(s == 0, 0, start)
    w_hi = tl.where(s == n_seq - 1, n_total, end)
    per = (w_hi - w_lo + SPLIT - 1) // SPLIT
    lo = w_lo + k * per
    hi = tl.minimum(lo + per, w_hi)
    c = tl.load(coef_ptr + s) * tl.load(gl_ptr)  # grad_loss read on the device: no host sync
    for off in range(lo, hi, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        inb = idx < hi
        seq = inb & (idx >= start) & (idx < end)
        g = tl.load(gbuf_ptr + idx, mask=seq, other=0.0)
        g = tl.where(seq, g * c, 0.0)
        tl.store(out_ptr + idx, g.to(out_ptr.dtype.element_ty), mask=inb)


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
    tok: PolicyTokens,
    cu_seqlens: torch.Tensor | None,
    seq_weights: torch.Tensor | None,
    opts: PolicyLossOptions,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of ``reference.policy_loss_fused_torch``:
    ``(loss (), gbuf (N,), coef (B,), stats (11,))``."""
    ref_logprob, prox_logprob = tok.ref_logprob, tok.prox_logprob
    dual_clip, behav_cap = opts.dual_clip, opts.behav_cap
    dev = logprob.device
    n = logprob.numel()
    has_cu = cu_seqlens is not None
    n_seq = cu_seqlens.numel() - 1 if has_cu else 1
    cu = cu_seqlens.to(torch.int64) if has_cu else logprob  # never read without cu_seqlens
    split, block = _launch_shape(n, n_seq, dev)
    n_slots = n_seq * split
    gbuf = torch.empty(n, dtype=torch.float32, device=dev)
    part = torch.empty(_NUM_PARTIALS * n_slots, dtype=torch.float32, device=dev)
    dummy = logprob  # never read when the matching HAS_* flag is off
    if n_seq > 0:
        _policy_loss_fwd_kernel[(n_seq, split)](
            logprob, tok.old_logprob, tok.advantages, tok.loss_mask,
            dummy if ref_logprob is None else ref_logprob,
            dummy if prox_logprob is None else prox_logprob,
            cu, gbuf, part, n_slots, n_seq, n, opts.clip_low, opts.clip_high,
            float(dual_clip or 0.0), float(behav_cap or 0.0), opts.kl_coef,
            float(K3_LOG_RATIO_CLAMP), float(K3_KL_CLAMP), float(LOG_RATIO_CLAMP),
            SPLIT=split, BLOCK=block, HAS_CU=has_cu, HAS_REF=ref_logprob is not None,
            HAS_PROX=prox_logprob is not None, HAS_DUAL=dual_clip is not None,
            HAS_CAP=behav_cap is not None and prox_logprob is not None,
            KL_TYPE=_KL_CODE[opts.kl_type],
        )  # fmt: skip
    else:  # cu_seqlens == [c]: no sequence, every row is padding
        gbuf.zero_()
    p = part.view(_NUM_PARTIALS, n_seq, split)
    sums = p.sum(dim=2)
    loss_s, mass_s = sums[_P_LOSS], sums[_P_MASS]
    w = (
        seq_weights.float()
        if seq_weights is not None
        else torch.ones(n_seq, dtype=torch.float32, device=dev)
    )
    coef = seq_coefficients(mass_s, w, opts.agg).contiguous()
    loss = (coef * loss_s).sum()
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
    return loss, gbuf, coef, stats


def policy_loss_grad_triton(
    gbuf: torch.Tensor,
    coef: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    grad_loss: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Triton twin of ``reference.policy_loss_grad_torch``: ``(N,)`` in ``dtype``."""
    n = gbuf.numel()
    has_cu = cu_seqlens is not None
    n_seq = cu_seqlens.numel() - 1 if has_cu else 1
    if n_seq == 0:
        return torch.zeros(n, dtype=dtype, device=gbuf.device)
    out = torch.empty(n, dtype=dtype, device=gbuf.device)
    split, block = _launch_shape(n, n_seq, gbuf.device)
    gl = grad_loss.to(torch.float32).reshape(1)
    cu = cu_seqlens.to(torch.int64) if has_cu else gbuf  # never read without cu_seqlens
    _policy_loss_grad_kernel[(n_seq, split)](
        gbuf, coef.float().contiguous(), gl, cu, out, n_seq, n,
        SPLIT=split, BLOCK=block, HAS_CU=has_cu,
    )  # fmt: skip
    return out
