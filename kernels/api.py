"""The public functions of ``paravt_kernels``: input checks, then one ``paravt::`` op each."""

from __future__ import annotations

import torch

from . import ops as _ops
from .dispatch import resolve_impl
from .linear_policy_loss_reference import LINEAR_POLICY_STAT_NAMES
from .options import AGG_MODES, KL_TYPES, PolicyLossOptions
from .packing import broadcast_to_tokens
from .policy_loss_reference import POLICY_STAT_NAMES

__all__ = [
    "AGG_MODES",
    "KL_TYPES",
    "LINEAR_POLICY_STAT_NAMES",
    "POLICY_STAT_NAMES",
    "PolicyLossOptions",
    "broadcast_to_tokens",
    "group_advantage",
    "linear_logprob",
    "linear_policy_loss",
    "policy_loss",
    "resolve_impl",
]


def _check_1d(name: str, t: torch.Tensor, n: int | None = None, like: str = "") -> None:
    if t.dim() != 1:
        raise ValueError(f"{name} has shape {tuple(t.shape)}: expected a packed 1-D tensor (N,)")
    if n is not None and t.numel() != n:
        raise ValueError(
            f"{name} has {t.numel()} elements but {like} has {n}: all per-token inputs must be "
            "packed over the same tokens"
        )


def _check_lm_head(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    """hidden ``(n, d)`` and an lm_head weight ``(V, d)``."""
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be 2-D: "
            "hidden (tokens, d), weight (vocab, d); flatten packed/batched hidden states first"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden has d={hidden.shape[1]} but weight has d={weight.shape[1]}: weight must be "
            "(vocab, d) as nn.Linear stores it (not its transpose)"
        )


def group_advantage(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    scale: float = 1.0,
    bias: float = 0.0,
) -> torch.Tensor:
    """Group-relative advantages ``(B,)`` float32 from scalar rewards ``(B,)``.

    ``A_i = (r_i - mean_g) / (std_g + eps) * scale + bias`` with ``g = group_index[i]`` (ids in
    any order, ragged groups) and ``std_g`` the unbiased (n-1) std, as ``torch.std`` in TRL's
    GRPO; ``normalize_std=False`` drops the division (Dr. GRPO). Groups of size 1 get exactly 0.
    No host synchronisation.
    """
    _check_1d("rewards", rewards)
    _check_1d("group_index", group_index, rewards.numel(), "rewards")
    if not rewards.is_floating_point():
        raise TypeError(f"rewards has dtype {rewards.dtype}: expected a floating tensor")
    if group_index.is_floating_point() or group_index.dtype == torch.bool:
        raise TypeError(f"group_index has dtype {group_index.dtype}: expected an integer tensor")
    if group_index.device != rewards.device:
        raise ValueError(
            f"group_index is on {group_index.device} but rewards on {rewards.device}: "
            "move both to one device"
        )
    impl = resolve_impl(rewards.device, "group_advantage")
    return _ops.group_advantage_op(
        rewards.contiguous(), group_index.long().contiguous(), bool(normalize_std),
        float(eps), float(scale), float(bias), impl,
    )  # fmt: skip


def linear_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    return_entropy: bool = False,
    ignore_index: int = -100,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-prob of ``targets`` under ``softmax((hidden @ weight.T + bias) / T)``.

    hidden ``(N, d)``, weight ``(V, d)`` (the lm_head), targets ``(N,)`` int, bias ``(V,)``
    -> logprob ``(N,)`` float32, always <= 0 (and the entropy of the same distribution,
    ``(N,)`` float32, if ``return_entropy``). The ``(N, V)`` logits are never held in memory:
    the vocabulary is walked tile by tile with an online log-sum-exp and the backward
    recomputes each tile. Differentiable w.r.t. hidden, weight and bias. Tokens whose target
    is ``ignore_index`` get logprob 0, entropy 0 and no gradient. A row whose incoming
    gradients are 0 (a token the loss masks) contributes nothing even when its hidden state
    holds NaN/inf (zeroed in the backward; else ``0 * NaN`` reaches every row of dW).
    """
    _check_lm_head(hidden, weight)
    _check_1d("targets", targets, hidden.shape[0], "hidden")
    if targets.is_floating_point():
        raise TypeError(f"targets has dtype {targets.dtype}: expected token ids (int)")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({weight.shape[0]},)")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if hidden.dtype != weight.dtype:
        raise TypeError(
            f"hidden is {hidden.dtype} but weight is {weight.dtype}: cast one so both match"
        )
    impl = resolve_impl(hidden.device, "linear_logprob")
    logprob, entropy, _ = _ops.linear_logprob_fwd_op(
        hidden.contiguous(), weight.contiguous(), targets.long().contiguous(),
        None if bias is None else bias.contiguous(), float(temperature), bool(return_entropy),
        int(ignore_index), impl,
    )  # fmt: skip
    return (logprob, entropy) if return_entropy else logprob


def _check_policy_inputs(
    fn: str,
    n: int,
    like: str,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    ref_logprob: torch.Tensor | None,
    prox_logprob: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    seq_weights: torch.Tensor | None,
    options: PolicyLossOptions | None,
    knobs: dict,
) -> PolicyLossOptions:
    """The checks shared by ``policy_loss`` and ``linear_policy_loss`` (``like``: the input
    whose length ``n`` the per-token inputs must match); returns the call's options record
    (``options`` with the fields named in ``knobs`` replaced, checked on construction)."""
    for name, t in (
        ("old_logprob", old_logprob),
        ("advantages", advantages),
        ("loss_mask", loss_mask),
    ):
        _check_1d(name, t, n, like)
    for name, t in (("ref_logprob", ref_logprob), ("prox_logprob", prox_logprob)):
        if t is not None:
            _check_1d(name, t, n, like)
    opts = PolicyLossOptions.build(fn, options, knobs)
    if opts.behav_cap is not None and prox_logprob is None:
        raise ValueError(
            f"behav_cap={opts.behav_cap} caps the behaviour weight exp(prox - old) of the "
            "decoupled objective: pass prox_logprob (N,) or set behav_cap=None"
        )
    if opts.kl_coef != 0.0 and ref_logprob is None:
        raise ValueError(f"kl_coef={opts.kl_coef} needs ref_logprob (N,); pass it or set kl_coef=0")
    if cu_seqlens is None and (opts.agg != "token-mean" or seq_weights is not None):
        raise ValueError(
            f"agg='{opts.agg}'{' with seq_weights' if seq_weights is not None else ''} needs "
            "cu_seqlens (B+1,) to find sequence boundaries"
        )
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"cu_seqlens has shape {tuple(cu_seqlens.shape)}: expected (B+1,)")
        if seq_weights is not None and seq_weights.numel() != cu_seqlens.numel() - 1:
            raise ValueError(
                f"seq_weights has {seq_weights.numel()} entries but cu_seqlens describes "
                f"{cu_seqlens.numel() - 1} sequences"
            )
    return opts


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def policy_loss(
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
    """PPO clipped surrogate + KL to a reference, fused forward and backward.

    The loss options are the fields of ``PolicyLossOptions``, passed by keyword (``clip_low=0.2,
    clip_high=0.2, dual_clip=None, behav_cap=None, kl_coef=0.0, kl_type="k3",
    agg="token-mean"``: the defaults), as a record (``options=``), or both (the keywords
    replace the record's fields). All per-token inputs are packed ``(N,)``; ``loss_mask`` is
    float (a weight) or bool.
    With ``base = prox_logprob`` if given else ``old_logprob`` and ``r = exp(logprob - base)``:

        l_t = w_b * max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))   [dual clip: where A < 0,
              min(., -A * dual_clip)]  + kl_coef * KL_k(logprob, ref_logprob)

    Decoupled objective: ``w_b = exp(prox - old)`` (1 without ``prox_logprob``); tokens with
    ``w_b > behav_cap`` are removed from the mask (counted in ``stats["n_capped"]``).
    KL: k1 ``lp - ref``, k2 ``(lp - ref)^2 / 2``, k3 ``e^{ref-lp} - (ref-lp) - 1`` with the
    log-ratio clamped to +-20 and the result to +-10, exactly verl's ``low_var_kl`` (a token
    with ``pi_ref/pi > ~12.6`` gets 10 and no KL gradient, instead of a penalty that grows
    without bound; TRL's unclamped k3 is identical below 10). Aggregation over the final
    mask ``m`` with per-sequence weights ``seq_weights`` ``(B,)`` (default 1; e.g. 1/num_sub
    for sub-agent sequences), each weight counting as a fractional sequence (or token) in
    numerator and denominator alike:

        token-mean            sum_t w m l / sum_t w m                    (TRL bnpo/dapo)
        seq-mean-token-mean   sum_s w_s (sum_t m l / sum_t m) / sum_s w_s  (TRL grpo)
        seq-mean-token-sum    sum_s w_s (sum_t m l) / sum_s w_s            (Dr.GRPO x max_len)

    where the sequence sums only count sequences with at least one unmasked token (a fully
    masked sequence contributes nothing, no NaN). ``cu_seqlens`` ``(B+1,)`` is needed for the
    seq modes and for ``seq_weights``. Returns ``(loss, stats)``; ``stats`` maps each name in
    ``POLICY_STAT_NAMES`` to a 0-d float32 tensor (no host syncs): clip fractions low/high/
    dual/any, mean KL, ratio mean/min/max over unmasked tokens, n_tokens (mask mass),
    n_masked (tokens excluded, capped included), n_capped.
    """
    n = logprob.numel()
    _check_1d("logprob", logprob)
    opts = _check_policy_inputs(
        "policy_loss", n, "logprob", old_logprob, advantages, loss_mask, ref_logprob,
        prox_logprob, cu_seqlens, seq_weights, options, knobs,
    )  # fmt: skip
    mask = loss_mask.float() if loss_mask.dtype == torch.bool else loss_mask
    impl = resolve_impl(logprob.device, "policy_loss")
    c = _contiguous
    loss, _, _, stats = _ops.policy_loss_op(
        logprob.contiguous(), c(old_logprob), c(advantages), c(mask), c(ref_logprob),
        c(prox_logprob), None if cu_seqlens is None else cu_seqlens.long().contiguous(),
        None if seq_weights is None else seq_weights.float().contiguous(),
        *opts.schema_args(), impl,
    )  # fmt: skip
    return loss, dict(zip(POLICY_STAT_NAMES, stats.detach().unbind(0)))


def linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    bias: torch.Tensor | None = None,
    ref_logprob: torch.Tensor | None = None,
    prox_logprob: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    seq_weights: torch.Tensor | None = None,
    options: PolicyLossOptions | None = None,
    **knobs: float | str | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """PPO/GRPO policy loss straight from hidden rows and the lm_head weight.

    hidden ``(n, d)`` and weight ``(V, d)`` (same dtype), targets ``(n,)`` int, bias ``(V,)``;
    ``logprob = log_softmax((hidden @ weight.T + bias) / T)[targets]`` with ``temperature`` a
    float or a ``(n,)`` tensor (one ``T > 0`` per row, e.g. main and sub-agent rows), then
    exactly ``policy_loss(logprob, old_logprob, advantages, loss_mask, ...)`` (same arguments,
    the loss options as keywords or ``options=``, same semantics: clip, dual clip, decoupled behaviour weight and ``behav_cap``, KL k1/k2/k3,
    ``agg`` with ``cu_seqlens``/``seq_weights``; masked tokens selected away, sequences of
    ``cu_seqlens`` may be empty).

    Returns ``(loss (), stats, logprob (n,), entropy (n,))``: ``stats`` maps each name in
    ``LINEAR_POLICY_STAT_NAMES`` (``POLICY_STAT_NAMES`` + ``"entropy"``, the mean entropy of the
    tempered distribution over the final mask, 0 if it is empty) to a 0-d float32 tensor;
    ``logprob`` and ``entropy`` are float32 and detached (the entropy gets no gradient).

    The ``(n, V)`` logits are never held. The gradient w.r.t. hidden, weight and bias is
    formed in the FORWARD, row chunk by row chunk: the final mask and the per-sequence
    aggregation coefficients need no logits, so ``dloss/dlogprob`` is token-local; each
    chunk's full-vocabulary fp32 logits (a bounded ``(c, V)`` buffer) give ``logprob``, the
    per-token gradient and ``dlogits`` in place, then ``dH``, ``dW``, ``db``: three
    GEMM-equivalents (``6 n d V`` FLOP), nothing recomputed. The backward only scales the saved gradients by the incoming one, so
    the forward holds a weight-sized gradient until then. Targets equal to -100 give
    logprob 0 and no gradient (mask those rows). Masked rows contribute exactly nothing,
    even with a NaN/inf hidden state (zeroed before the GEMMs; their ``logprob`` and
    ``entropy`` are then NaN); a NaN in an unmasked row still makes the loss NaN.
    """
    _check_lm_head(hidden, weight)
    if hidden.dtype != weight.dtype:
        raise TypeError(
            f"hidden is {hidden.dtype} but weight is {weight.dtype}: cast one so both match"
        )
    n = hidden.shape[0]
    _check_1d("targets", targets, n, "hidden")
    if targets.is_floating_point() or targets.dtype == torch.bool:
        raise TypeError(f"targets has dtype {targets.dtype}: expected token ids (int)")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"bias has shape {tuple(bias.shape)}, expected ({weight.shape[0]},): one per vocab row"
        )
    row_t = None
    if isinstance(temperature, torch.Tensor):
        if temperature.dim() == 0:
            temperature = float(temperature)
        else:
            _check_1d("temperature", temperature, n, "hidden")
            msg = "temperature has entries <= 0 (or NaN): every row's temperature must be > 0"
            if temperature.device.type == "cpu":
                if not bool((temperature > 0).all()):
                    raise ValueError(msg)
            else:  # checked on the device, without a host sync before the loss GEMMs
                torch._assert_async((temperature > 0).all(), msg)
            row_t = temperature.to(device=hidden.device, dtype=torch.float32).contiguous()
    if row_t is None and not float(temperature) > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    opts = _check_policy_inputs(
        "linear_policy_loss", n, "hidden", old_logprob, advantages, loss_mask, ref_logprob,
        prox_logprob, cu_seqlens, seq_weights, options, knobs,
    )  # fmt: skip
    mask = loss_mask.float() if loss_mask.dtype == torch.bool else loss_mask
    impl = resolve_impl(hidden.device, "linear_policy_loss")
    c = _contiguous
    loss, stats, logprob, entropy, _, _, _ = _ops.linear_policy_loss_op(
        hidden.contiguous(), weight.contiguous(), targets.long().contiguous(), c(old_logprob),
        c(advantages), c(mask), c(bias), row_t, c(ref_logprob), c(prox_logprob),
        None if cu_seqlens is None else cu_seqlens.long().contiguous(),
        None if seq_weights is None else seq_weights.float().contiguous(),
        1.0 if row_t is not None else float(temperature), *opts.schema_args(), impl,
    )  # fmt: skip
    stats_d = dict(zip(LINEAR_POLICY_STAT_NAMES, stats.detach().unbind(0)))
    return loss, stats_d, logprob.detach(), entropy.detach()
