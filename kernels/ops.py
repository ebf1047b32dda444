"""``torch.library`` registration of the paravt ops (``paravt::<op>``) with fake kernels and
autograd, so that ``torch.compile`` traces them and ``opcheck`` validates them.

Each op takes its resolved implementation (``impl``: ``"torch"`` | ``"triton"``, see
``dispatch.py``) as a schema argument: the choice is made once, outside the op, and is a
constant for tracing. Triton modules are imported lazily, so the package imports without Triton.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import (
    group_advantage_reference,
    linear_logprob_reference,
    linear_policy_loss_reference,
    policy_loss_reference,
)
from .options import PolicyLossOptions, PolicyTokens

__all__ = [
    "group_advantage_op",
    "linear_logprob_bwd_op",
    "linear_logprob_fwd_op",
    "linear_policy_loss_op",
    "policy_loss_grad_op",
    "policy_loss_op",
]


def _triton_module(name: str):
    """Import a Triton kernel module on first use (keeps ``import paravt_kernels`` Triton-free)."""
    import importlib

    return importlib.import_module(f"{__package__}.{name}")


# --------------------------------------------------------------------------------------------
# group_advantage
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("paravt::group_advantage", mutates_args=())
def group_advantage_op(
    rewards: Tensor,
    group_index: Tensor,
    normalize_std: bool,
    eps: float,
    scale: float,
    bias: float,
    impl: str,
) -> Tensor:
    if impl == "triton":
        return _triton_module("group_advantage_triton").group_advantage_triton(
            rewards, group_index, normalize_std, eps, scale, bias
        )
    return group_advantage_reference.group_advantage_torch(
        rewards, group_index, normalize_std=normalize_std, eps=eps, scale=scale, bias=bias
    )


@group_advantage_op.register_fake
def _(rewards, group_index, normalize_std, eps, scale, bias, impl):
    return torch.empty(rewards.shape, dtype=torch.float32, device=rewards.device)


# --------------------------------------------------------------------------------------------
# linear_logprob
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("paravt::linear_logprob_fwd", mutates_args=())
def linear_logprob_fwd_op(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    temperature: float,
    return_entropy: bool,
    ignore_index: int,
    impl: str,
) -> tuple[Tensor, Tensor, Tensor]:
    if impl == "triton":
        return _triton_module("linear_logprob_triton").linear_logprob_fwd_triton(
            hidden, weight, targets, bias, temperature, return_entropy, ignore_index
        )
    return linear_logprob_reference.linear_logprob_forward_torch(
        hidden, weight, targets, bias, temperature, return_entropy, ignore_index
    )


@linear_logprob_fwd_op.register_fake
def _(hidden, weight, targets, bias, temperature, return_entropy, ignore_index, impl):
    n = hidden.shape[0]
    f32 = {"dtype": torch.float32, "device": hidden.device}
    return (
        torch.empty(n, **f32),
        torch.empty(n if return_entropy else 0, **f32),
        torch.empty(n, **f32),
    )


@torch.library.custom_op("paravt::linear_logprob_bwd", mutates_args=())
def linear_logprob_bwd_op(
    grad_logprob: Tensor,
    grad_entropy: Tensor | None,
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    lse: Tensor,
    entropy: Tensor,
    temperature: float,
    ignore_index: int,
    impl: str,
) -> tuple[Tensor, Tensor, Tensor]:
    if impl == "triton":
        gh, gw, gb = _triton_module("linear_logprob_triton").linear_logprob_bwd_triton(
            grad_logprob, grad_entropy, hidden, weight, targets, bias, lse, entropy,
            temperature, ignore_index,
        )  # fmt: skip
    else:
        gh, gw, gb = linear_logprob_reference.linear_logprob_backward_torch(
            grad_logprob, grad_entropy, hidden, weight, targets, bias, lse, entropy,
            temperature, ignore_index,
        )  # fmt: skip
    if gb is None:
        gb = torch.empty(0, dtype=weight.dtype, device=weight.device)
    return (
        gh.to(hidden.dtype),
        gw.to(weight.dtype),
        gb.to(weight.dtype if bias is None else bias.dtype),
    )


@linear_logprob_bwd_op.register_fake
def _(grad_logprob, grad_entropy, hidden, weight, targets, bias, lse, entropy, temperature,
      ignore_index, impl):  # fmt: skip
    gb_shape = (0,) if bias is None else tuple(bias.shape)
    gb_dtype = weight.dtype if bias is None else bias.dtype
    return (
        torch.empty_like(hidden),
        torch.empty_like(weight),
        torch.empty(gb_shape, dtype=gb_dtype, device=weight.device),
    )


def _llp_setup_context(ctx, inputs, output):
    hidden, weight, targets, bias, temperature, return_entropy, ignore_index, impl = inputs
    _, entropy, lse = output
    ctx.save_for_backward(hidden, weight, targets, bias, lse, entropy)
    ctx.temperature = temperature
    ctx.ignore_index = ignore_index
    ctx.return_entropy = return_entropy
    ctx.impl = impl
    ctx.has_bias = bias is not None


def _llp_backward(ctx, grad_logprob, grad_entropy, _grad_lse):
    hidden, weight, targets, bias, lse, entropy = ctx.saved_tensors
    if grad_logprob is None:
        grad_logprob = torch.zeros_like(lse)
    if not ctx.return_entropy:
        grad_entropy = None
    gh, gw, gb = linear_logprob_bwd_op(
        grad_logprob.contiguous(),
        None if grad_entropy is None else grad_entropy.contiguous(),
        hidden, weight, targets, bias, lse, entropy, ctx.temperature, ctx.ignore_index, ctx.impl,
    )  # fmt: skip
    return gh, gw, None, (gb if ctx.has_bias else None), None, None, None, None


linear_logprob_fwd_op.register_autograd(_llp_backward, setup_context=_llp_setup_context)


# --------------------------------------------------------------------------------------------
# policy_loss
# --------------------------------------------------------------------------------------------
# Schema: logprob, the PolicyTokens fields, cu_seqlens, seq_weights, the PolicyLossOptions
# fields (``PolicyLossOptions.SCHEMA``), impl.
_PL_SCHEMA = (
    "(Tensor logprob, Tensor old_logprob, Tensor advantages, Tensor loss_mask, "
    "Tensor? ref_logprob, Tensor? prox_logprob, Tensor? cu_seqlens, Tensor? seq_weights, "
    f"{PolicyLossOptions.SCHEMA}, str impl) -> (Tensor, Tensor, Tensor, Tensor)"
)
_N_OPTS = PolicyLossOptions.n_schema_args()


def _policy_loss_args(args: tuple) -> tuple:
    """``(logprob, PolicyTokens, cu_seqlens, seq_weights, PolicyLossOptions, impl)`` from the
    op's flat arguments."""
    lp, old, adv, mask, ref_lp, prox, cu, sw = args[:8]
    opts = PolicyLossOptions.from_schema_args(args[8 : 8 + _N_OPTS])
    return lp, PolicyTokens(old, adv, mask, ref_lp, prox), cu, sw, opts, args[8 + _N_OPTS]


def _policy_loss(*args) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(loss (), gbuf (N,), coef (B,), stats (len(POLICY_STAT_NAMES),))``.

    ``gbuf`` is the unscaled per-token gradient ``m_t dl_t/dlogprob`` and ``coef`` the
    per-sequence aggregation coefficients (``B = 1`` without ``cu_seqlens``); the backward
    (``policy_loss_grad_op``) forms ``dloss/dlogprob = grad_loss * coef_s * gbuf`` in one pass.
    """
    lp, tok, cu, sw, opts, impl = _policy_loss_args(args)
    fn = (
        _triton_module("policy_loss_triton").policy_loss_fused_triton
        if impl == "triton"
        else policy_loss_reference.policy_loss_fused_torch
    )
    return fn(lp, tok, cu, sw, opts)


policy_loss_op = torch.library.custom_op(
    "paravt::policy_loss", _policy_loss, mutates_args=(), schema=_PL_SCHEMA
)


@policy_loss_op.register_fake
def _policy_loss_fake(*args):
    logprob, cu_seqlens = args[0], args[6]
    f32 = {"dtype": torch.float32, "device": logprob.device}
    n_seq = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (
        torch.empty((), **f32),
        torch.empty(logprob.shape, **f32),
        torch.empty(n_seq, **f32),
        torch.empty(len(policy_loss_reference.POLICY_STAT_NAMES), **f32),
    )


@torch.library.custom_op("paravt::policy_loss_grad", mutates_args=())
def policy_loss_grad_op(
    gbuf: Tensor,
    coef: Tensor,
    cu_seqlens: Tensor | None,
    grad_loss: Tensor,
    dtype: torch.dtype,
    impl: str,
) -> Tensor:
    """``dloss/dlogprob (N,)`` in ``dtype``: ``grad_loss * coef_s(t) * gbuf_t``, 0 outside
    ``[cu_seqlens[0], cu_seqlens[-1])``; one read of ``gbuf``, one write, no host sync."""
    if impl == "triton":
        return _triton_module("policy_loss_triton").policy_loss_grad_triton(
            gbuf, coef, cu_seqlens, grad_loss, dtype
        )
    return policy_loss_reference.policy_loss_grad_torch(gbuf, coef, cu_seqlens, grad_loss, dtype)


@policy_loss_grad_op.register_fake
def _(gbuf, coef, cu_seqlens, grad_loss, dtype, impl):
    return torch.empty(gbuf.shape, dtype=dtype, device=gbuf.device)


def _pl_setup_context(ctx, inputs, output):
    # only the loss has a gradient: no zero tensors for gbuf/coef/stats (3 fills per backward)
    ctx.set_materialize_grads(False)
    _, gbuf, coef, _ = output
    cu_seqlens = inputs[6]
    ctx.save_for_backward(gbuf, coef, cu_seqlens)
    ctx.lp_dtype = inputs[0].dtype
    ctx.impl = inputs[-1]


def _pl_backward(ctx, grad_loss, _grad_gbuf, _grad_coef, _grad_stats):
    gbuf, coef, cu_seqlens = ctx.saved_tensors
    n_args = 9 + _N_OPTS
    if grad_loss is None:
        return (None,) * n_args
    g = policy_loss_grad_op(gbuf, coef, cu_seqlens, grad_loss, ctx.lp_dtype, ctx.impl)
    return (g,) + (None,) * (n_args - 1)


policy_loss_op.register_autograd(_pl_backward, setup_context=_pl_setup_context)


# --------------------------------------------------------------------------------------------
# linear_policy_loss
# --------------------------------------------------------------------------------------------
# Schema: hidden, weight, targets, the required PolicyTokens fields, bias, the per-row
# temperature, the optional PolicyTokens fields, cu_seqlens, seq_weights, the float
# temperature, the PolicyLossOptions fields, impl.
_LPL_SCHEMA = (
    "(Tensor hidden, Tensor weight, Tensor targets, Tensor old_logprob, Tensor advantages, "
    "Tensor loss_mask, Tensor? bias, Tensor? row_temperature, Tensor? ref_logprob, "
    "Tensor? prox_logprob, Tensor? cu_seqlens, Tensor? seq_weights, float temperature, "
    f"{PolicyLossOptions.SCHEMA}, str impl) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
    "Tensor)"
)


def _linear_policy_loss(*args) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(loss (), stats (12,), logprob (n,), entropy (n,), d hidden, d weight,
    d bias or (0,))``: the gradients of ``loss`` are formed in the forward, the backward only
    scales them. ``row_temperature`` ``(n,)``, when given, replaces ``temperature``."""
    *flat, temperature = args[:13]
    row_t = flat[7]
    flat[7] = temperature if row_t is None else row_t
    fn = (
        _triton_module("linear_policy_loss_triton").linear_policy_loss_triton
        if args[-1] == "triton"
        else linear_policy_loss_reference.linear_policy_loss_torch
    )
    return fn(*flat, *args[13:-1])


linear_policy_loss_op = torch.library.custom_op(
    "paravt::linear_policy_loss", _linear_policy_loss, mutates_args=(), schema=_LPL_SCHEMA
)


@linear_policy_loss_op.register_fake
def _(*args):
    hidden, weight, bias = args[0], args[1], args[6]
    n = hidden.shape[0]
    f32 = {"dtype": torch.float32, "device": hidden.device}
    gb_shape = (0,) if bias is None else tuple(bias.shape)
    gb_dtype = weight.dtype if bias is None else bias.dtype
    return (
        torch.empty((), **f32),
        torch.empty(len(linear_policy_loss_reference.LINEAR_POLICY_STAT_NAMES), **f32),
        torch.empty(n, **f32),
        torch.empty(n, **f32),
        torch.empty_like(hidden),
        torch.empty_like(weight),
        torch.empty(gb_shape, dtype=gb_dtype, device=weight.device),
    )


def _lpl_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*output[4:])
    ctx.has_bias = inputs[6] is not None


def _lpl_backward(ctx, grad_loss, *_unused):
    gh, gw, gb = ctx.saved_tensors
    none = [None] * (14 + _N_OPTS)
    if grad_loss is None:
        return tuple(none)
    none[0] = (grad_loss * gh).to(gh.dtype)
    none[1] = (grad_loss * gw).to(gw.dtype)
    if ctx.has_bias:
        none[6] = (grad_loss * gb).to(gb.dtype)
    return tuple(none)


linear_policy_loss_op.register_autograd(_lpl_backward, setup_context=_lpl_setup_context)
