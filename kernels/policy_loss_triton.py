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
* ``_policy_loss_finalize_kernel`` (one program) turns the partials into per-sequence
  aggregation coefficients ``coef_s`` (token-mean | seq-mean-token-mean |
  seq-mean-token-sum, see ``policy_loss_reference.seq_coefficients``), the loss and the
  statistics, without host syncs (it replaced ~36 small torch ops on the partials).
* ``_policy_loss_grad_kernel`` (the autograd backward) writes
  ``dloss/dlogprob_t = grad_loss * coef_s gbuf_t`` in the log-prob dtype: the gradient is
  written once in the forward and read once in the backward.

Without ``cu_seqlens`` the kernels take the whole batch as one sequence (``HAS_CU=False``),
so no ``[0, N]`` tensor is copied to the device.

Launches per call (forward + backward): 3, and no torch kernel (``profiling.count_launches``;
the code before made 2 Triton launches and 36 torch ops, 3 of them autograd filling zero
gradients for the outputs other than the loss). ``cu_seqlens`` is read on the device only.
Bytes the kernels must move: ``policy_loss_bytes`` (36 per token in fp32 with ref and prox).

The maths is ``policy_loss_reference.policy_token_terms`` /
``policy_loss_reference.policy_loss_fused_torch``.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._triton_utils import lazy_jit, next_pow2, num_sms
from .dispatch import interpreting
from .options import PolicyLossOptions, PolicyTokens
from .policy_loss_reference import K3_KL_CLAMP, K3_LOG_RATIO_CLAMP, LOG_RATIO_CLAMP

# Partial-sum slots written per (sequence, slice) program.
# constexpr: a compiled kernel may only read globals that are (the interpreter reads any, so
# only a compile for sm_90, ``profiling.sm90_registers``, showed it)
_P_LOSS, _P_MASS, _P_KL, _P_LOW, _P_HIGH, _P_DUAL, _P_ANY, _P_RATIO = map(tl.constexpr, range(8))
_P_RMIN, _P_RMAX, _P_CAPPED, _P_MASKED_IN = map(tl.constexpr, range(8, 12))
_NUM_PARTIALS = 12
_KL_CODE = {"k1": 1, "k2": 2, "k3": 3}
_AGG_CODE = {"token-mean": 0, "seq-mean-token-mean": 1, "seq-mean-token-sum": 2}
_NUM_STATS = 11  # len(policy_loss_reference.POLICY_STAT_NAMES), in that order
# GPU: 512 tokens per iteration over 8 warps = 2 fp32 per thread and stream. ptxas (sm_90,
# every HAS_* flag on, ``profiling.sm90_registers``) gives 59 registers per thread, so 4
# programs (32 warps) fit on an SM; the 1024-token block over 4 warps of before needed 210
# (2 programs, 8 warps per SM). ``bench/gpu_kernels.py`` sweeps these two on the device.
_GPU_BLOCK = 512
_FWD_WARPS = 8


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


@lazy_jit
def _policy_loss_finalize_kernel(
    part_ptr, w_ptr, coef_ptr, loss_ptr, stats_ptr, n_seq, n_slots,
    SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr, BLOCK_S: tl.constexpr, HAS_W: tl.constexpr,
    AGG: tl.constexpr,
):  # fmt: skip
    """One program: partials -> ``coef (B,)``, ``loss ()``, ``stats (11,)`` (replaces ~36 small
    torch ops). Pass 1 sums each sequence's slices and the batch totals; pass 2 forms
    ``coef_s`` (``policy_loss_reference.seq_coefficients``) and
    ``loss = sum_s coef_s loss_s``. Fixed summation order: deterministic."""
    cols = tl.arange(0, SPLIT_P2)
    cmask = cols < SPLIT
    t_mass = tl.zeros([BLOCK_S], tl.float32)
    t_kl = tl.zeros([BLOCK_S], tl.float32)
    t_low = tl.zeros([BLOCK_S], tl.float32)
    t_high = tl.zeros([BLOCK_S], tl.float32)
    t_dual = tl.zeros([BLOCK_S], tl.float32)
    t_any = tl.zeros([BLOCK_S], tl.float32)
    t_ratio = tl.zeros([BLOCK_S], tl.float32)
    t_capped = tl.zeros([BLOCK_S], tl.float32)
    t_masked = tl.zeros([BLOCK_S], tl.float32)
    t_wm = tl.zeros([BLOCK_S], tl.float32)  # sum_s w_s M_s (token-mean denominator)
    t_wn = tl.zeros([BLOCK_S], tl.float32)  # sum_s w_s [M_s > 0] (sequence count)
    t_rmin = tl.full([BLOCK_S], float("inf"), tl.float32)
    t_rmax = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, n_seq, BLOCK_S):
        rows = s0 + tl.arange(0, BLOCK_S)
        rmask = rows < n_seq
        off = rows[:, None] * SPLIT + cols[None, :]
        io = rmask[:, None] & cmask[None, :]
        mass = tl.sum(tl.load(part_ptr + _P_MASS * n_slots + off, mask=io, other=0.0), 1)
        if HAS_W:
            w = tl.load(w_ptr + rows, mask=rmask, other=0.0)
        else:
            w = tl.where(rmask, 1.0, 0.0)
        t_mass += mass
        t_wm += w * mass
        t_wn += tl.where(mass > 0.0, w, 0.0)
        t_kl += tl.sum(tl.load(part_ptr + _P_KL * n_slots + off, mask=io, other=0.0), 1)
        t_low += tl.sum(tl.load(part_ptr + _P_LOW * n_slots + off, mask=io, other=0.0), 1)
        t_high += tl.sum(tl.load(part_ptr + _P_HIGH * n_slots + off, mask=io, other=0.0), 1)
        t_dual += tl.sum(tl.load(part_ptr + _P_DUAL * n_slots + off, mask=io, other=0.0), 1)
        t_any += tl.sum(tl.load(part_ptr + _P_ANY * n_slots + off, mask=io, other=0.0), 1)
        t_ratio += tl.sum(tl.load(part_ptr + _P_RATIO * n_slots + off, mask=io, other=0.0), 1)
        t_capped += tl.sum(tl.load(part_ptr + _P_CAPPED * n_slots + off, mask=io, other=0.0), 1)
        t_masked += tl.sum(tl.load(part_ptr + _P_MASKED_IN * n_slots + off, mask=io, other=0.0), 1)
        rmin = tl.load(part_ptr + _P_RMIN * n_slots + off, mask=io, other=float("inf"))
        rmax = tl.load(part_ptr + _P_RMAX * n_slots + off, mask=io, other=float("-inf"))
        t_rmin = tl.minimum(t_rmin, tl.min(rmin, 1))
        t_rmax = tl.maximum(t_rmax, tl.max(rmax, 1))
    wm = tl.sum(t_wm, 0)
    wn = tl.sum(t_wn, 0)
    inv_s = tl.where(wn > 0.0, 1.0 / tl.maximum(wn, 1e-30), 0.0)
    loss = tl.zeros([BLOCK_S], tl.float32)
    for s0 in range(0, n_seq, BLOCK_S):
        rows = s0 + tl.arange(0, BLOCK_S)
        rmask = rows < n_seq
        off = rows[:, None] * SPLIT + cols[None, :]
        io = rmask[:, None] & cmask[None, :]
        mass = tl.sum(tl.load(part_ptr + _P_MASS * n_slots + off, mask=io, other=0.0), 1)
        loss_s = tl.sum(tl.load(part_ptr + _P_LOSS * n_slots + off, mask=io, other=0.0), 1)
        if HAS_W:
            w = tl.load(w_ptr + rows, mask=rmask, other=0.0)
        else:
            w = tl.where(rmask, 1.0, 0.0)
        if AGG == 0:  # token-mean
            coef = tl.where(wm > 0.0, w / tl.maximum(wm, 1e-30), 0.0)
        elif AGG == 1:  # seq-mean-token-mean
            coef = tl.where(mass > 0.0, w / tl.maximum(mass, 1e-30), 0.0) * inv_s
        else:  # seq-mean-token-sum
            coef = w * inv_s
        tl.store(coef_ptr + rows, coef, mask=rmask)
        loss += tl.where(rmask, coef * loss_s, 0.0)
    tl.store(loss_ptr, tl.sum(loss, 0))
    n_tok = tl.sum(t_mass, 0)
    den = tl.maximum(n_tok, 1e-30)
    any_on = n_tok > 0.0
    tl.store(stats_ptr + 0, tl.sum(t_low, 0) / den)
    tl.store(stats_ptr + 1, tl.sum(t_high, 0) / den)
    tl.store(stats_ptr + 2, tl.sum(t_dual, 0) / den)
    tl.store(stats_ptr + 3, tl.sum(t_any, 0) / den)
    tl.store(stats_ptr + 4, tl.sum(t_kl, 0) / den)
    tl.store(stats_ptr + 5, tl.sum(t_ratio, 0) / den)
    tl.store(stats_ptr + 6, tl.where(any_on, tl.min(t_rmin, 0), 0.0))
    tl.store(stats_ptr + 7, tl.where(any_on, tl.max(t_rmax, 0), 0.0))
    tl.store(stats_ptr + 8, n_tok)
    capped = tl.sum(t_capped, 0)
    tl.store(stats_ptr + 9, tl.sum(t_masked, 0) + capped)
    tl.store(stats_ptr + 10, capped)


def _fin_block(n_seq: int, split: int) -> int:
    """Sequences per step of the finalize kernel: at most 256 (its 13 accumulators then fit
    in registers: ptxas for sm_90 spilled 400 bytes at 1024), ~2048 partial slots per load."""
    return max(16, min(256, next_pow2(max(n_seq, 1)), 2048 // next_pow2(split)))


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
    """Triton twin of ``policy_loss_reference.policy_loss_fused_torch``:
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
    f32 = {"dtype": torch.float32, "device": dev}
    # cu_seqlens == [c]: no sequence, no forward program: every row is padding (gradient 0)
    gbuf = torch.empty(n, **f32) if n_seq > 0 else torch.zeros(n, **f32)
    part = torch.empty(_NUM_PARTIALS * n_slots, **f32)
    coef = torch.empty(n_seq, **f32)
    loss = torch.empty((), **f32)
    stats = torch.empty(_NUM_STATS, **f32)
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
            KL_TYPE=_KL_CODE[opts.kl_type], num_warps=_FWD_WARPS,
        )  # fmt: skip
    has_w = seq_weights is not None
    _policy_loss_finalize_kernel[(1,)](
        part, seq_weights if has_w else part, coef, loss, stats, n_seq, n_slots,
        SPLIT=split, SPLIT_P2=next_pow2(split), BLOCK_S=_fin_block(n_seq, split),
        HAS_W=has_w, AGG=_AGG_CODE[opts.agg],
    )  # fmt: skip
    return loss, gbuf, coef, stats


def policy_loss_grad_triton(
    gbuf: torch.Tensor,
    coef: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    grad_loss: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Triton twin of ``policy_loss_reference.policy_loss_grad_torch``: ``(N,)`` in ``dtype``."""
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


def policy_loss_bytes(
    logprob: torch.Tensor,
    tok: PolicyTokens,
    cu_seqlens: torch.Tensor | None,
    seq_weights: torch.Tensor | None,
    split: int = 1,
) -> tuple[int, int]:
    """``(bytes per token, bytes per call)`` that the three kernels of one ``policy_loss``
    forward + backward must move, from the tensors' element sizes (what a bandwidth figure
    divides by; ``bench/gpu_kernels.py``).

    Per token: the forward reads logprob, old, advantages, mask (+ ref, + prox) once and
    writes the fp32 gradient buffer ``gbuf``; the backward reads ``gbuf`` and writes
    ``dloss/dlogprob`` in the log-prob dtype. fp32 everywhere with ref and prox: 6 x 4 + 4
    + 4 + 4 = 36 B (the bench had counted 44: an in-place scaling pass of ``gbuf`` that the
    fused backward no longer makes). Per call (O(B)): ``cu_seqlens`` read by the forward and
    the backward, the ``12 x B x split`` fp32 partials written and read, ``seq_weights``
    read, ``coef`` written and read, loss and stats written. Checked against the tensor
    arguments of the launches by ``tests/test_kernels_policy_loss.py::test_byte_model``."""
    streams = [logprob, tok.old_logprob, tok.advantages, tok.loss_mask]
    streams += [t for t in (tok.ref_logprob, tok.prox_logprob) if t is not None]
    per_token = sum(t.element_size() for t in streams) + 4 + 4 + logprob.element_size()
    n_seq = cu_seqlens.numel() - 1 if cu_seqlens is not None else 1
    fixed = 2 * 8 * (n_seq + 1) if cu_seqlens is not None else 0
    fixed += 2 * 4 * _NUM_PARTIALS * n_seq * split + 2 * 4 * n_seq + 4 * (1 + _NUM_STATS)
    fixed += 4 * n_seq if seq_weights is not None else 0
    return per_token, fixed
