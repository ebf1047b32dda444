"""Triton path of ``linear_policy_loss``: lm-head log-prob + PPO loss with the gradient formed
in the forward.

No new kernel is needed: the orchestration is ``reference.linear_policy_loss_fused`` (shared
with the torch path) and the building blocks are the Triton ones that already exist:

* pass 1: ``linear_logprob_fwd_triton`` -- per vocabulary tile a cuBLAS matmul with fp32
  output (``torch.mm(..., out_dtype=torch.float32)`` for bf16 operands, an error instead of
  bf16 logits when torch refuses it), then ``_llp_fwd_tile_kernel`` updates the online
  log-sum-exp / target logit / entropy state of each row;
* the policy loss: ``policy_loss_fused_triton`` + ``policy_loss_grad_triton`` (grad 1) give
  ``loss``, the stats and ``g = dloss/dlogprob`` (n,);
* pass 2: ``linear_logprob_bwd_triton`` -- per vocabulary tile the logits are recomputed,
  ``_llp_bwd_tile_kernel`` writes ``dZ = g (onehot - p) / T`` (bf16 on GPU), ``dW_tile =
  dZ^T H`` is written once (cuBLAS accumulates in fp32 and rounds once to the weight dtype)
  and ``dH += dZ W_tile`` accumulates in fp32.

Per-row temperatures ride along as a ``(n,)`` inverse-temperature vector read by both tile
kernels. GEMM count: four ``2 n d V`` matmuls (logits twice, dH, dW).
"""

from __future__ import annotations

import torch

from .linear_logprob_triton import linear_logprob_bwd_triton, linear_logprob_fwd_triton
from .policy_loss_triton import policy_loss_fused_triton, policy_loss_grad_triton
from .reference import linear_policy_loss_fused

TRITON_STEPS = {
    "lp_fwd": linear_logprob_fwd_triton,
    "lp_bwd": linear_logprob_bwd_triton,
    "pl_fwd": policy_loss_fused_triton,
    "pl_grad": policy_loss_grad_triton,
}


def linear_policy_loss_triton(*args, **kwargs) -> tuple[torch.Tensor, ...]:
    """``reference.linear_policy_loss_fused`` with the Triton building blocks."""
    return linear_policy_loss_fused(TRITON_STEPS, *args, **kwargs)
