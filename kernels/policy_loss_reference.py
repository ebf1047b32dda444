"""Torch reference of ``policy_loss``: the CPU path and the test oracle of
``policy_loss_triton.py`` (``ops.policy_loss_op`` / ``policy_loss_grad_op`` with
``impl="torch"``), plus the element-wise maths (``policy_token_terms``, ``seq_coefficients``)
that ``linear_policy_loss_reference`` reuses.

``policy_loss_torch`` is the autograd formulation (the oracle); ``policy_loss_fused_torch`` /
``policy_loss_grad_torch`` the fused forward with an analytic gradient, as the Triton kernels.
Per-token tensors are packed ``(N,)`` over ``cu_seqlens`` (``packing.py``); results are
float32; no host synchronisation on the hot path.
"""

from __future__ import annotations

import functools

import torch

from .options import AGG_MODES, KL_TYPES, PolicyLossOptions, PolicyTokens
from .packing import seq_ids_from_cu_seqlens

__all__ = [
    "K3_KL_CLAMP",
    "K3_LOG_RATIO_CLAMP",
    "LOG_RATIO_CLAMP",
    "POLICY_STAT_NAMES",
    "POLICY_TOKEN_CHUNK",
    "aggregation_weights",
    "covered_tokens",
    "kl_penalty",
    "policy_loss_fused_torch",
    "policy_loss_grad_torch",
    "policy_loss_torch",
    "policy_token_terms",
    "seq_coefficients",
]

# Order of the packed statistics vector returned by the registered policy-loss op.
POLICY_STAT_NAMES = (
    "clip_frac_low",
    "clip_frac_high",
    "clip_frac_dual",
    "clip_frac",
    "kl_mean",
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "n_tokens",
    "n_masked",
    "n_capped",
)
# The k3 estimator exponentiates (ref - logprob); beyond +-20 the estimate is dominated by
# numerical blow-up (exp(20) ~ 5e8), so the log-ratio is clamped there, as verl does.
K3_LOG_RATIO_CLAMP = 20.0
# ... and the estimate itself is clamped to +-10, as verl's low_var_kl: k3 = r - log r - 1
# (r = pi_ref/pi) reaches 10 at r ~ 12.6 (or r ~ e^-11), where one token's penalty already
# equals ~1000 typical ones (k3 ~ 0.01) and its gradient 1 - r keeps growing with r. Beyond
# the clamp the token's KL gradient is 0 (torch.clamp's, as in verl).
K3_KL_CLAMP = 10.0
# The importance ratio exp(logprob - base) and the behaviour weight exp(prox - old) are
# exponentiated from a log-ratio clamped to +-20 (verl clamps its log-ratio at +-20 too).
# Ordinary tokens never get near it: the trust region is 1 +- 0.3 (dual clip ~3, behaviour cap
# ~2-10) while exp(20) ~ 4.9e8; but an old log-prob of -1e4 (a masked pad, a -inf from
# top-p sampling) would give exp(1e4) = inf, and inf * 0 = NaN in any product that follows,
# autograd's backward included. Outside the clamp the ratio's derivative is 0 (as
# torch.clamp's).
LOG_RATIO_CLAMP = 20.0


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimators (Schulman, "Approximating KL divergence").

    ``k1 = lp - ref``; ``k2 = (lp - ref)^2 / 2``;
    ``k3 = clamp(e^d - d - 1, -10, 10)`` with ``d = clamp(ref - lp, -20, 20)``: exactly verl's
    ``low_var_kl``, value and gradient (0 where a clamp binds). The clamp to 10 keeps one
    outlier token (``pi_ref/pi > ~12.6``, or ``< e^-11``) from dominating the loss with a
    penalty, and a gradient ``1 - pi_ref/pi``, that grow without bound (``K3_KL_CLAMP``).
    TRL's k3 is not clamped: identical where ``k3 <= 10``.
    """
    if kl_type == "k1":
        return logprob - ref_logprob
    if kl_type == "k2":
        return 0.5 * (logprob - ref_logprob) ** 2
    if kl_type == "k3":
        d = (ref_logprob - logprob).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
        return (torch.exp(d) - d - 1.0).clamp(-K3_KL_CLAMP, K3_KL_CLAMP)
    raise ValueError(f"kl_type='{kl_type}' is not one of {'|'.join(KL_TYPES)}")


def aggregation_weights(
    mask: torch.Tensor,
    agg: str,
    cu_seqlens: torch.Tensor | None,
    seq_weights: torch.Tensor | None,
) -> torch.Tensor:
    """Per-token coefficients ``c_t`` such that ``loss = sum_t c_t * l_t``, ``(N,)`` float32.

    With ``m_t`` the (float) mask, ``w_s`` the sequence weight (1 if absent), ``M_s`` the
    mask mass of sequence ``s`` and ``S = sum_s w_s [M_s > 0]`` the weighted count of
    sequences with at least one trained token:

    * ``token-mean``:           ``c_t = w_s m_t / sum_t' w_s' m_t'``
    * ``seq-mean-token-mean``:  ``c_t = w_s m_t / (M_s S)``
    * ``seq-mean-token-sum``:   ``c_t = w_s m_t / S``

    A weight therefore acts as a fractional count of its sequence (or of each of its tokens)
    in both numerator and denominator. Empty denominators give 0 (no NaN). Tokens outside
    ``[cu_seqlens[0], cu_seqlens[-1])`` belong to no sequence: ``c_t = 0``.
    """
    n = mask.numel()
    if cu_seqlens is None:
        if agg != "token-mean":
            raise ValueError(f"agg='{agg}' needs cu_seqlens (B+1,) to find sequence boundaries")
        if seq_weights is not None:
            raise ValueError("seq_weights needs cu_seqlens (B+1,) to map tokens to sequences")
        return mask / mask.sum().clamp_min(1e-30) * (mask.sum() > 0)
    sid = seq_ids_from_cu_seqlens(cu_seqlens, n)  # id nseq: no sequence
    nseq = cu_seqlens.numel() - 1
    f32 = {"dtype": torch.float32, "device": mask.device}
    w_seq = seq_weights.float() if seq_weights is not None else torch.ones(nseq, **f32)
    w_tok = torch.cat([w_seq, torch.zeros(1, **f32)])[sid]
    if agg == "token-mean":
        den = (w_tok * mask).sum()
        return torch.where(den > 0, w_tok * mask / den.clamp_min(1e-30), 0.0)
    m_seq = torch.zeros(nseq + 1, **f32).index_add_(0, sid, mask)[:nseq]
    nonempty = (m_seq > 0).float()
    s_den = (w_seq * nonempty).sum()
    inv_s = torch.where(s_den > 0, 1.0 / s_den.clamp_min(1e-30), 0.0)
    if agg == "seq-mean-token-mean":
        per_seq = torch.where(m_seq > 0, w_seq / m_seq.clamp_min(1e-30), 0.0) * inv_s
    elif agg == "seq-mean-token-sum":
        per_seq = w_seq * inv_s
    else:
        raise ValueError(f"agg='{agg}' is not one of {'|'.join(AGG_MODES)}")
    return torch.cat([per_seq, torch.zeros(1, **f32)])[sid] * mask


def covered_tokens(cu_seqlens: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    """``(N,)`` bool: token lies in ``[cu_seqlens[0], cu_seqlens[-1])`` (all True without it)."""
    if cu_seqlens is None:
        return torch.ones(n, dtype=torch.bool, device=device)
    return seq_ids_from_cu_seqlens(cu_seqlens, n) < cu_seqlens.numel() - 1


def _exp_log_ratio(d: torch.Tensor) -> torch.Tensor:
    """``exp(clamp(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))``: finite for any finite-or-inf ``d``."""
    return torch.exp(d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def policy_loss_torch(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    ref_logprob: torch.Tensor | None = None,
    prox_logprob: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    seq_weights: torch.Tensor | None = None,
    options: PolicyLossOptions | None = None,
    **knobs: float | str | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate + KL, aggregated; differentiable w.r.t. ``logprob`` via autograd.

    The loss options are a ``PolicyLossOptions`` (``options``) and/or its fields by keyword
    (``clip_low=0.2, agg="seq-mean-token-mean"``), as in ``api.policy_loss``.

    Per token (all ``(N,)``), with ``base = prox_logprob`` if given else ``old_logprob``:

    * ``r = exp(logprob - base)``, ``l_pg = max(-A r, -A clip(r, 1-clip_low, 1+clip_high))``;
      dual clip ``c`` (> 1): where ``A < 0``, ``l_pg = min(l_pg, -A c)``.
    * decoupled objective (``prox_logprob`` given): ``l_pg *= w_b`` with behaviour weight
      ``w_b = exp(prox - old)``; tokens with ``w_b > behav_cap`` are dropped from the mask.
    * ``l = l_pg + kl_coef * KL_k(logprob, ref)`` (``kl_penalty``), aggregated with
      ``aggregation_weights`` (token-mean | seq-mean-token-mean | seq-mean-token-sum, optional
      per-sequence ``seq_weights`` ``(B,)``).

    Both log-ratios are clamped to ``+-LOG_RATIO_CLAMP`` before ``exp``. Masked tokens and
    tokens outside ``[cu_seqlens[0], cu_seqlens[-1])`` may hold any value (-inf, NaN): they are
    replaced by 0 before the maths and selected away after it, so they change nothing.

    Returns ``(loss (), stats)``; stats are 0-d float32 tensors (token means over the final
    mask): ``POLICY_STAT_NAMES``.
    """
    o = PolicyLossOptions.build("policy_loss_torch", options, knobs)
    clip_low, clip_high, dual_clip, behav_cap = o.clip_low, o.clip_high, o.dual_clip, o.behav_cap
    covered = covered_tokens(cu_seqlens, logprob.numel(), logprob.device)
    mask = torch.where(covered, loss_mask.float(), 0.0)
    n_masked_in = (covered & (mask <= 0)).float().sum()
    keep = mask > 0

    # double `where`: the backward of `where(keep, f(x), 0)` still multiplies 0 by f'(x), which
    # is NaN where f'(x) is inf or NaN; stand-ins make f'(x) finite at ignored tokens.
    def safe(x: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, x.float(), 0.0)

    lp = safe(logprob)
    adv = safe(advantages)
    old = safe(old_logprob)
    if prox_logprob is not None:
        base = safe(prox_logprob)
        behav = _exp_log_ratio(base - old)
        if behav_cap is not None:
            capped = (behav > behav_cap) & keep
            mask = torch.where(capped, 0.0, mask)
            behav = behav.clamp_max(behav_cap)
        else:
            capped = torch.zeros_like(keep)
    else:
        base = old
        behav = None
        capped = torch.zeros_like(keep)
    ratio = _exp_log_ratio(lp - base)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg1, pg2)
    dual_hit = torch.zeros_like(keep)
    if dual_clip is not None:
        pg3 = -adv * dual_clip
        dual_hit = (adv < 0) & (pg3 < pg)
        pg = torch.where(adv < 0, torch.minimum(pg, pg3), pg)
    if behav is not None:
        pg = pg * behav
    loss_tok = pg
    kl = None
    if ref_logprob is not None:
        kl = kl_penalty(lp, safe(ref_logprob), o.kl_type)
        if o.kl_coef != 0.0:
            loss_tok = loss_tok + o.kl_coef * kl
    on = mask > 0
    coef = aggregation_weights(mask, o.agg, cu_seqlens, seq_weights)
    loss = torch.where(on, coef * loss_tok, 0.0).sum()

    with torch.no_grad():

        def msum(x: torch.Tensor) -> torch.Tensor:  # sum over the final mask, by selection
            return torch.where(on, x.float() * mask, 0.0).sum()

        n_tok = mask.sum()
        den = n_tok.clamp_min(1e-30)
        low = (ratio < 1.0 - clip_low) & (adv < 0)
        high = (ratio > 1.0 + clip_high) & (adv > 0)
        r_det = ratio.detach()
        stats = {
            "clip_frac_low": msum(low) / den,
            "clip_frac_high": msum(high) / den,
            "clip_frac_dual": msum(dual_hit) / den,
            "clip_frac": msum(low | high) / den,
            "kl_mean": msum(kl.detach()) / den
            if kl is not None
            else torch.zeros((), device=mask.device),
            "ratio_mean": msum(r_det) / den,
            "ratio_min": _masked_extreme(r_det, on, "min"),
            "ratio_max": _masked_extreme(r_det, on, "max"),
            "n_tokens": n_tok,
            "n_masked": n_masked_in + capped.float().sum(),
            "n_capped": capped.float().sum(),
        }
    return loss, stats


def _masked_extreme(x: torch.Tensor, on: torch.Tensor, kind: str) -> torch.Tensor:
    """min/max of ``x`` over ``on``; 0 when nothing is selected (a loggable value, not inf)."""
    fill = float("inf") if kind == "min" else float("-inf")
    y = torch.where(on, x, fill)
    if y.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    v = y.amin() if kind == "min" else y.amax()
    return torch.where(on.any(), v, 0.0)


def policy_token_terms(
    logprob: torch.Tensor, tok: PolicyTokens, opts: PolicyLossOptions
) -> dict[str, torch.Tensor]:
    """Per-token loss ``l``, its analytic derivative ``dl/dlogprob`` and the stat indicators.

    This is the element-wise half of the fused op (the Triton kernel computes the same
    quantities); derivative of each term, with ``r = e^{clamp(lp - base)}``:
    ``d(-A r)/dlp = -A r`` (zero where the clipped branch wins, the dual bound binds or the
    log-ratio is clamped), ``dk1 = 1``, ``dk2 = lp - ref``, ``dk3 = 1 - e^{ref - lp}`` (zero
    where either k3 clamp binds, as verl's low_var_kl). Values at masked tokens may be inf
    or NaN: callers select them away (``on``), never multiply them by the mask. ``opts.agg``
    plays no part here (it is the aggregation, ``seq_coefficients``).
    """
    clip_low, clip_high, dual_clip, behav_cap = (
        opts.clip_low, opts.clip_high, opts.dual_clip, opts.behav_cap
    )  # fmt: skip
    kl_coef, kl_type = opts.kl_coef, opts.kl_type
    ref_logprob, prox_logprob = tok.ref_logprob, tok.prox_logprob
    mask = tok.loss_mask.float()
    lp = logprob.float()
    adv = tok.advantages.float()
    old = tok.old_logprob.float()
    capped = torch.zeros_like(mask, dtype=torch.bool)
    if prox_logprob is not None:
        base = prox_logprob.float()
        behav = _exp_log_ratio(base - old)
        if behav_cap is not None:
            capped = (behav > behav_cap) & (mask > 0)
            behav = behav.clamp_max(behav_cap)
    else:
        base = old
        behav = torch.ones_like(mask)
    d = lp - base
    ratio = _exp_log_ratio(d)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    unclipped = (pg1 >= pg2) & (d >= -LOG_RATIO_CLAMP) & (d <= LOG_RATIO_CLAMP)
    pg = torch.maximum(pg1, pg2)
    dpg = torch.where(unclipped, pg1, 0.0)
    dual_hit = torch.zeros_like(capped)
    if dual_clip is not None:
        pg3 = -adv * dual_clip
        dual_hit = (adv < 0) & (pg3 < pg)
        pg = torch.where(dual_hit, pg3, pg)
        dpg = torch.where(dual_hit, 0.0, dpg)
    loss = pg * behav
    dloss = dpg * behav
    kl = torch.zeros_like(mask)
    if ref_logprob is not None:
        ref = ref_logprob.float()
        kl = kl_penalty(lp, ref, kl_type)
        if kl_type == "k1":
            dkl = torch.ones_like(lp)
        elif kl_type == "k2":
            dkl = lp - ref
        else:
            dr = ref - lp
            dc = dr.clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
            e = torch.exp(dc)
            raw = e - dc - 1.0  # k3 before its clamp to +-K3_KL_CLAMP
            # 0 where either clamp binds (torch.clamp's derivative, as verl's autograd gives)
            inside = (dr >= -K3_LOG_RATIO_CLAMP) & (dr <= K3_LOG_RATIO_CLAMP)
            inside &= (raw >= -K3_KL_CLAMP) & (raw <= K3_KL_CLAMP)
            dkl = torch.where(inside, 1.0 - e, 0.0)
        if kl_coef != 0.0:
            loss = loss + kl_coef * kl
            dloss = dloss + kl_coef * dkl
    m_eff = torch.where(capped, 0.0, mask)
    return {
        "mask": m_eff,
        "on": m_eff > 0,
        "loss": loss,
        "dloss": dloss,
        "ratio": ratio,
        "kl": kl,
        "low": (ratio < 1.0 - clip_low) & (adv < 0),
        "high": (ratio > 1.0 + clip_high) & (adv > 0),
        "dual": dual_hit,
        "capped": capped,
        "masked_in": mask <= 0,
    }


def seq_coefficients(mass_s: torch.Tensor, w_s: torch.Tensor, agg: str) -> torch.Tensor:
    """Per-sequence aggregation coefficient ``coef_s`` with ``c_t = coef_s m_t`` (``(B,)``).

    ``mass_s`` is the mask mass of each sequence, ``w_s`` its weight; see
    ``aggregation_weights`` for the three modes. Used by the fused torch and Triton paths.
    """
    if agg == "token-mean":
        den = (w_s * mass_s).sum()
        return torch.where(den > 0, w_s / den.clamp_min(1e-30), 0.0)
    s_den = (w_s * (mass_s > 0).float()).sum()
    inv_s = torch.where(s_den > 0, 1.0 / s_den.clamp_min(1e-30), 0.0)
    if agg == "seq-mean-token-mean":
        return torch.where(mass_s > 0, w_s / mass_s.clamp_min(1e-30), 0.0) * inv_s
    if agg == "seq-mean-token-sum":
        return w_s * inv_s
    raise ValueError(f"agg='{agg}' is not one of {'|'.join(AGG_MODES)}")


# Token chunk of the fused torch policy loss: 32K fp32 values (128 KiB) per temporary keeps
# the ~40 element-wise temporaries in cache and in malloc's reused arena; whole-batch
# temporaries (2 MiB at 512K tokens) were page-faulted afresh on every op (measured 10-20x
# slower per op on the build machine).
POLICY_TOKEN_CHUNK = 1 << 15


def _select_weighted(on: torch.Tensor, m: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``m * x`` where ``on``, exactly 0 elsewhere (even where ``x`` is inf or NaN)."""
    return torch.where(on, m * x.float(), 0.0)


def policy_loss_fused_torch(
    logprob: torch.Tensor,
    tok: PolicyTokens,
    cu_seqlens: torch.Tensor | None,
    seq_weights: torch.Tensor | None,
    opts: PolicyLossOptions,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused forward in torch: ``(loss (), gbuf (N,), coef (B,), stats (11,))``.

    Same maths as ``policy_loss_torch``, token chunk by token chunk with per-sequence partial
    sums, like the Triton kernel. The gradient is formed analytically but left unscaled:
    ``gbuf_t = m_t dl_t/dlogprob`` (0 at masked tokens and outside ``cu_seqlens``), and
    ``dloss/dlogprob_t = coef_s(t) gbuf_t`` is formed once, in the backward
    (``policy_loss_grad_torch``), together with the incoming gradient. Without ``cu_seqlens``
    the batch is one sequence (``B = 1``). ``stats`` is packed in the order of
    ``POLICY_STAT_NAMES``.
    """
    n = logprob.numel()
    dev = logprob.device
    f32 = {"dtype": torch.float32, "device": dev}
    if cu_seqlens is None:
        if opts.agg != "token-mean" or seq_weights is not None:
            raise ValueError(f"agg='{opts.agg}' / seq_weights need cu_seqlens (B+1,)")
        n_seq, sid = 1, None
    else:
        n_seq = cu_seqlens.numel() - 1
        sid = seq_ids_from_cu_seqlens(cu_seqlens, n)  # id n_seq: outside every sequence
    loss_s = torch.zeros(n_seq + 1, **f32)  # the last slot collects tokens of no sequence
    mass_s = torch.zeros(n_seq + 1, **f32)
    gbuf = torch.empty(n, **f32)
    acc = torch.zeros(8, **f32)  # low, high, dual, any, kl, ratio, capped, masked_in
    rmin = torch.full((), float("inf"), **f32)
    rmax = torch.full((), float("-inf"), **f32)
    for a in range(0, n, POLICY_TOKEN_CHUNK):
        b = min(a + POLICY_TOKEN_CHUNK, n)
        t = policy_token_terms(logprob[a:b], tok.rows(a, b), opts)
        covered = torch.ones_like(t["on"]) if sid is None else sid[a:b] < n_seq
        on = t["on"] & covered
        m = torch.where(on, t["mask"], 0.0)
        sel = functools.partial(_select_weighted, on, m)
        gbuf[a:b] = sel(t["dloss"])
        ml = sel(t["loss"])
        if sid is None:
            loss_s[0] += ml.sum()
            mass_s[0] += m.sum()
        else:
            loss_s.index_add_(0, sid[a:b], ml)
            mass_s.index_add_(0, sid[a:b], m)
        acc += torch.stack(
            [
                sel(t["low"]).sum(),
                sel(t["high"]).sum(),
                sel(t["dual"]).sum(),
                sel(t["low"] | t["high"]).sum(),
                sel(t["kl"]).sum(),
                sel(t["ratio"]).sum(),
                (t["capped"] & covered).float().sum(),
                (t["masked_in"] & covered).float().sum(),
            ]
        )
        rmin = torch.minimum(rmin, torch.where(on, t["ratio"], float("inf")).amin())
        rmax = torch.maximum(rmax, torch.where(on, t["ratio"], float("-inf")).amax())
    loss_s, mass_s = loss_s[:n_seq], mass_s[:n_seq]
    w = seq_weights.float() if seq_weights is not None else torch.ones(n_seq, **f32)
    coef = seq_coefficients(mass_s, w, opts.agg)
    loss = (coef * loss_s).sum()
    n_tok = mass_s.sum()
    den = n_tok.clamp_min(1e-30)
    any_on = n_tok > 0
    stats = torch.stack(
        [
            acc[0] / den,
            acc[1] / den,
            acc[2] / den,
            acc[3] / den,
            acc[4] / den,
            acc[5] / den,
            torch.where(any_on, rmin, 0.0),
            torch.where(any_on, rmax, 0.0),
            n_tok,
            acc[7] + acc[6],
            acc[6],
        ]
    )
    return loss, gbuf, coef, stats


def policy_loss_grad_torch(
    gbuf: torch.Tensor,
    coef: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    grad_loss: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``dloss/dlogprob (N,)`` in ``dtype``: ``grad_loss * coef_s(t) * gbuf_t`` in one pass.

    Tokens outside ``[cu_seqlens[0], cu_seqlens[-1])`` get exactly 0.
    """
    c = coef.float() * grad_loss.float()
    if cu_seqlens is None:
        return (gbuf * c).to(dtype)
    sid = seq_ids_from_cu_seqlens(cu_seqlens, gbuf.numel())
    c_tok = torch.cat([c, torch.zeros(1, dtype=c.dtype, device=c.device)])[sid]
    return (gbuf * c_tok).to(dtype)
