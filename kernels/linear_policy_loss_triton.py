"""Triton path of ``linear_policy_loss``: lm-head log-prob + PPO loss, row chunk by row chunk,
three GEMM-equivalents and no recompute.

The orchestration is ``linear_policy_loss_reference.linear_policy_loss_fused`` (shared with
the torch path, which also holds all the PPO maths: ``policy_token_scale`` /
``policy_token_grad``); this module supplies its per-chunk steps, ``TritonRowChunks``:

* GEMM 1: the chunk's full-vocabulary logits ``(c, V)`` in fp32 from one cuBLAS matmul
  (``torch.mm(..., out_dtype=torch.float32)`` for bf16/fp16 operands; an error instead of
  bf16 logits when torch refuses it, see ``linear_logprob_triton._mm_lowp_out_f32``);
* sweep 1, ``_llp_fwd_tile_kernel`` over the whole row (grid: row blocks, online over vocab
  blocks): ``lse``, target logit, entropy -> ``logprob``; then ``g = dloss/dlogprob`` of the
  chunk's rows (``policy_token_grad``, O(c) element-wise);
* sweep 2, ``_llp_bwd_tile_kernel``: ``dlogits = g (onehot - p) / T``, written in place in
  the fp32 buffer (fp32 operands) or into a ``(c, V)`` buffer of the operand dtype (bf16 on
  GPU: the tensor-core operand of the next two matmuls);
* GEMM 2 ``dH[chunk] = dlogits W`` and GEMM 3 ``dW += dlogits^T H[chunk]`` (cuBLAS with fp32
  output, accumulated in an fp32 ``(V, d)`` buffer), ``db += sum dlogits``.

Chunk rows: ``_GPU_CHUNK_BYTES`` (2 GiB of fp32 logits: 3533 rows at V = 151936) on GPU,
``linear_policy_loss_reference.LPL_CHUNK_BYTES_CPU`` in the interpreter.
"""

from __future__ import annotations

import torch

from . import linear_policy_loss_reference as lplr
from .dispatch import interpreting
from .linear_logprob_reference import row_stats
from .linear_logprob_triton import addmm_f32, bwd_tile, fwd_tile, mm_f32
from .policy_loss_triton import policy_loss_fused_triton

# (c, V) fp32 logits of one row chunk on GPU; bf16 operands add a (c, V) bf16 dlogits buffer.
_GPU_CHUNK_BYTES = 2 << 30


class TritonRowChunks:
    """Triton steps of ``linear_policy_loss_reference.linear_policy_loss_fused`` (see the module
    docstring)."""

    def __init__(self, hidden, weight, bias, inv_t):
        self.weight, self.bias, self.inv_t = weight, bias, inv_t
        gpu = hidden.is_cuda and not interpreting()
        budget = _GPU_CHUNK_BYTES if gpu else lplr.LPL_CHUNK_BYTES_CPU
        self.rows = lplr.lpl_row_chunk(weight.shape[0], budget)
        if gpu:  # equal chunks: no small last chunk whose GEMMs run below the tensor-core peak
            n, k = hidden.shape[0], -(-hidden.shape[0] // self.rows)
            self.rows = max(1, -(-n // max(k, 1)))
        # dlogits feed two matmuls: the operand dtype on GPU (tensor cores), fp32 on CPU.
        self.dz_dtype = hidden.dtype if hidden.is_cuda else torch.float32
        self.w_op = weight if weight.is_cuda else weight.float()

    def _it(self, r0: int, r1: int):
        return self.inv_t[r0:r1] if isinstance(self.inv_t, torch.Tensor) else self.inv_t

    def forward(self, h: torch.Tensor, r0: int, r1: int, t: torch.Tensor, valid: torch.Tensor):
        z = mm_f32(h, self.weight.T)  # GEMM 1, (c, V) fp32
        f32 = {"dtype": torch.float32, "device": z.device}
        m = torch.full((r1 - r0,), float("-inf"), **f32)
        s, u, zt = (torch.zeros(r1 - r0, **f32) for _ in range(3))
        fwd_tile(z, 0, self.bias, t, m, s, u, zt, self._it(r0, r1))
        logprob, entropy, lse = row_stats(m, s, u, zt, valid)
        return z, logprob, entropy, lse

    def backward(self, z, h, r0, r1, t, lse, g, grad_h, grad_w, grad_b) -> None:
        dz = z if self.dz_dtype == torch.float32 else torch.empty_like(z, dtype=self.dz_dtype)
        bwd_tile(z, dz, 0, self.bias, t, lse.contiguous(), g.contiguous(), None, None,
                 self._it(r0, r1))  # fmt: skip
        grad_h[r0:r1] = mm_f32(dz, self.w_op)  # GEMM 2
        addmm_f32(grad_w, dz.T, h if h.is_cuda else h.float())  # GEMM 3
        if grad_b is not None:
            grad_b += dz.sum(dim=0, dtype=torch.float32)


def linear_policy_loss_triton(*args) -> tuple[torch.Tensor, ...]:
    """``linear_policy_loss_reference.linear_policy_loss_fused`` with the Triton steps;
    ``args``: the op's flat arguments
    (``linear_policy_loss_reference.linear_policy_loss_schema_args``)."""
    return lplr.linear_policy_loss_fused(
        TritonRowChunks, policy_loss_fused_triton, *lplr.linear_policy_loss_schema_args(args)
    )
