"""Torch reference of ``linear_policy_loss``, and the one orchestration both paths share.

``linear_policy_loss_fused`` is the row-chunk loop of the op for the torch path
(``TorchRowChunks``, the CPU path and the test oracle: ``linear_policy_loss_torch``, run by
``ops.linear_policy_loss_op`` with ``impl="torch"``) and for the Triton path
(``linear_policy_loss_triton.TritonRowChunks``). It reuses the tile steps of
``linear_logprob_reference`` and the token maths of ``policy_loss_reference``.
"""

from __future__ import annotations

import dataclasses

import torch

from . import linear_logprob_reference
from .linear_logprob_reference import (
    _dlogits,
    _rows,
    _tile_logits,
    inverse_temperature,
    row_stats,
    zero_nonfinite_dead_rows,
)
from .options import PolicyLossOptions, PolicyTokens
from .packing import seq_ids_from_cu_seqlens
from .policy_loss_reference import (
    POLICY_STAT_NAMES,
    covered_tokens,
    policy_loss_fused_torch,
    policy_token_terms,
    seq_coefficients,
)

__all__ = [
    "LINEAR_POLICY_STAT_NAMES",
    "LPL_CHUNK_BYTES_CPU",
    "TorchRowChunks",
    "linear_policy_loss_fused",
    "linear_policy_loss_schema_args",
    "linear_policy_loss_torch",
    "lpl_row_chunk",
    "policy_token_grad",
    "policy_token_scale",
]

# linear_policy_loss: POLICY_STAT_NAMES plus the mean entropy over the final mask.
LINEAR_POLICY_STAT_NAMES = (*POLICY_STAT_NAMES, "entropy")
# Budget of the (rows, V) fp32 logits buffer of one row chunk of linear_policy_loss on CPU
# (torch path and the Triton interpreter): 64 MiB, i.e. 110 rows at V = 151936, 512 rows at
# V = 32768. Read at every call (tests shrink it to force many chunks).
LPL_CHUNK_BYTES_CPU = 64 << 20


def lpl_row_chunk(vocab: int, budget_bytes: int) -> int:
    """Rows per chunk so that a ``(rows, vocab)`` fp32 buffer fits in ``budget_bytes``."""
    return max(1, int(budget_bytes) // (4 * max(int(vocab), 1)))


def policy_token_scale(
    tok: PolicyTokens,
    cu_seqlens: torch.Tensor | None,
    seq_weights: torch.Tensor | None,
    opts: PolicyLossOptions,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(on (N,) bool, m (N,), scale (N,))`` before any log-prob is known.

    The final mask (``loss_mask`` less the behaviour-capped tokens, which depend on
    ``prox``/``old`` only, less the rows outside ``cu_seqlens``) and the per-sequence
    aggregation coefficients (``seq_coefficients`` of the mask mass and ``seq_weights``) do
    not depend on the new log-prob, so ``dloss/dlogprob_t = scale_t dl_t/dlogprob_t`` with
    ``scale_t = m_t coef_s(t)`` is token-local once they are known. The mask is the one
    ``policy_token_terms`` computes (called on ``old`` as a stand-in log-prob: its mask
    ignores the log-prob, so no reference, dual clip or KL term is needed for it). ``m`` is
    the final mask weight (0 off ``on``).
    """
    n = tok.old_logprob.numel()
    dev = tok.old_logprob.device
    t = policy_token_terms(
        tok.old_logprob,
        dataclasses.replace(tok, ref_logprob=None),
        dataclasses.replace(opts, dual_clip=None, kl_coef=0.0),
    )
    on = t["on"] & covered_tokens(cu_seqlens, n, dev)
    m = torch.where(on, t["mask"], 0.0)
    agg = opts.agg
    if cu_seqlens is None:
        if agg != "token-mean" or seq_weights is not None:
            raise ValueError(f"agg='{agg}' / seq_weights need cu_seqlens (B+1,)")
        n_seq, sid = 1, torch.zeros(n, dtype=torch.long, device=dev)
    else:
        n_seq = cu_seqlens.numel() - 1
        sid = seq_ids_from_cu_seqlens(cu_seqlens, n)  # id n_seq: outside every sequence
    mass = torch.zeros(n_seq + 1, dtype=torch.float32, device=dev).index_add_(0, sid, m)
    w = seq_weights.float() if seq_weights is not None else torch.ones_like(mass[:n_seq])
    coef = seq_coefficients(mass[:n_seq], w, agg)
    coef_tok = torch.cat([coef, coef.new_zeros(1)])[sid]
    return on, m, torch.where(on, m * coef_tok, 0.0)


def policy_token_grad(
    logprob: torch.Tensor,
    tok: PolicyTokens,
    on: torch.Tensor,
    scale: torch.Tensor,
    opts: PolicyLossOptions,
) -> torch.Tensor:
    """``dloss/dlogprob`` of a slice of tokens: ``scale_t dl_t/dlogprob_t`` where ``on``, exactly
    0 elsewhere (``dl`` from ``policy_token_terms``; ``on``, ``scale`` from
    ``policy_token_scale``)."""
    t = policy_token_terms(logprob, tok, opts)
    return torch.where(on, scale * t["dloss"], 0.0)


class TorchRowChunks:
    """Torch steps of ``linear_policy_loss_fused`` for one call: the three GEMMs of a row chunk.

    fp32 weights: one matmul each over the whole vocabulary. bf16/fp16 weights (CPU matmuls
    need matching dtypes): the same matmuls over ``TORCH_VOCAB_TILE`` columns of the chunk
    buffer, each weight tile upcast to fp32 (exact products) when used.
    """

    def __init__(self, hidden, weight, bias, inv_t):
        self.weight, self.bias, self.inv_t = weight, bias, inv_t
        vocab = weight.shape[0]
        self.rows = lpl_row_chunk(vocab, LPL_CHUNK_BYTES_CPU)
        n = min(self.rows, hidden.shape[0])
        self.zbuf = torch.empty(n * vocab, dtype=torch.float32, device=hidden.device)
        tile = vocab if weight.dtype == torch.float32 else linear_logprob_reference.TORCH_VOCAB_TILE
        self.tiles = [(v0, min(v0 + tile, vocab)) for v0 in range(0, vocab, tile)]

    def _w(self, v0: int, v1: int) -> torch.Tensor:
        return self.weight[v0:v1].float()  # a view when the weight is already fp32

    def forward(self, h: torch.Tensor, r0: int, r1: int, t: torch.Tensor, valid: torch.Tensor):
        """GEMM 1 of the chunk's hidden rows ``h`` (rows ``r0:r1``) into the chunk buffer, then
        the row statistics: ``(z, logprob, entropy, lse)``. The whole row is in memory, so
        no online rescaling: the row maximum ``m`` (one sweep), then ``s = sum e^{z-m}`` and ``u = sum e^{z-m} z`` over
        ``TORCH_VOCAB_TILE`` columns at a time through one reused tile-sized buffer
        (measured on 2 cores at 512 x 32768: 14x faster than the online update per tile,
        whose fresh temporaries are page-faulted on every tile)."""
        vocab = self.weight.shape[0]
        z = self.zbuf[: (r1 - r0) * vocab].view(r1 - r0, vocab)
        it = _rows(self.inv_t, r0, r1)
        hf = h.float()  # a view when hidden is fp32
        for v0, v1 in self.tiles:
            b = None if self.bias is None else self.bias[v0:v1]
            _tile_logits(hf, self._w(v0, v1), b, it, z[:, v0:v1])
        m = z.amax(dim=1)
        zt = z.gather(1, t.clamp(0, vocab - 1)[:, None]).squeeze(1)
        s = torch.zeros_like(m)
        u = torch.zeros_like(m)
        vt = linear_logprob_reference.TORCH_VOCAB_TILE  # its owner's, read at every call
        ebuf = torch.empty(z.shape[0], min(vt, vocab), dtype=z.dtype, device=z.device)
        for v0 in range(0, vocab, vt):
            zs = z[:, v0 : v0 + vt]
            e = torch.sub(zs, m[:, None], out=ebuf[:, : zs.shape[1]]).exp_()
            s += e.sum(dim=1)
            u += torch.linalg.vecdot(e, zs)
        logprob, entropy, lse = row_stats(m, s, u, zt, valid)
        return z, logprob, entropy, lse

    def backward(self, z, h, r0, r1, t, lse, g, grad_h, grad_w, grad_b) -> None:
        """``dlogits`` in place in the chunk buffer (second sweep), then GEMM 2
        (``grad_h[r0:r1] = dlogits W``) and GEMM 3 (``grad_w += dlogits^T h``, fp32)."""
        dz = _dlogits(z, t, 0, lse, g, None, None, _rows(self.inv_t, r0, r1))
        h = h.float()
        gh = grad_h[r0:r1].zero_()
        for v0, v1 in self.tiles:
            w = self._w(v0, v1)
            gh.addmm_(dz[:, v0:v1], w)
            grad_w[v0:v1].addmm_(dz[:, v0:v1].T, h)
        if grad_b is not None:
            grad_b += dz.sum(dim=0)


def linear_policy_loss_fused(
    steps: type,
    pl_fwd,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float | torch.Tensor,
    tok: PolicyTokens,
    cu_seqlens: torch.Tensor | None,
    seq_weights: torch.Tensor | None,
    opts: PolicyLossOptions,
) -> tuple[torch.Tensor, ...]:
    """The one orchestration of ``linear_policy_loss``, shared by the torch and Triton paths.

    ``steps`` is ``TorchRowChunks`` or its Triton twin (``steps(hidden, weight, bias, inv_t)``
    has ``rows``, and ``forward``/``backward`` of one chunk's hidden rows), ``pl_fwd`` the
    fused policy-loss forward (``policy_loss_fused_torch`` or ``policy_loss_fused_triton``).

    0. ``policy_token_scale``: final mask and aggregation coefficients, which need no logits;
    1. per row chunk of ``c = steps.rows`` rows: the chunk's full-vocabulary fp32 logits
       ``(c, V)`` (GEMM 1), one sweep for ``lse``/``logprob``/``entropy``, the token-local
       ``g = dloss/dlogprob`` (``policy_token_grad``), a second sweep writing
       ``dlogits = g (onehot - p) / T`` in place, then ``dH[chunk] = dlogits W`` (GEMM 2),
       ``dW += dlogits^T H[chunk]`` (GEMM 3, fp32 accumulator), ``db += sum dlogits``;
    2. loss and statistics from the ``(n,)`` log-probs with ``pl_fwd`` (O(n)); the mean
       entropy over the final mask.

    Rows off the final mask contribute exactly nothing, even with a NaN/inf hidden state:
    such rows are replaced by zeros for the three GEMMs (``zero_nonfinite_dead_rows``, per
    chunk) and their ``logprob``/``entropy`` reported as NaN, not as a zero row's values.

    Three GEMM-equivalents (``6 n d V`` FLOP, nothing recomputed) and one ``(c, V)`` fp32
    buffer; the entropy is detached (no entropy term in ``dlogits``). Returns ``(loss (),
    stats (12,), logprob (n,), entropy (n,), d hidden (n, d) in hidden's dtype, d weight
    (V, d) in weight's dtype, d bias (V,) or (0,))``, the gradients being those of ``loss``
    (scale them by the incoming gradient in the backward).
    """
    n, d = hidden.shape
    vocab = weight.shape[0]
    dev = hidden.device
    f32 = {"dtype": torch.float32, "device": dev}
    on, m, scale = policy_token_scale(tok, cu_seqlens, seq_weights, opts)
    tgt = targets.long()
    valid = tgt != -100
    logprob = torch.zeros(n, **f32)
    entropy = torch.zeros(n, **f32)
    grad_h = torch.empty(n, d, **f32)
    grad_w = torch.zeros(vocab, d, **f32)
    grad_b = None if bias is None else torch.zeros(vocab, **f32)
    run = steps(hidden, weight, bias, inverse_temperature(temperature, dev))
    for r0 in range(0, n, run.rows):
        r1 = min(r0 + run.rows, n)
        t, ok = tgt[r0:r1], valid[r0:r1]
        # g = 0 off the mask (a select below), but 0 * NaN = NaN: a NaN/inf hidden value in
        # such a row would make its dlogits row NaN and, through dW = dlogits^T H, every row
        # of dW. Zeroed for all three GEMMs (an O(c d) select, no host sync); the row's
        # reported log-prob/entropy stay NaN (ignored targets keep their 0).
        h, void = zero_nonfinite_dead_rows(hidden[r0:r1], on[r0:r1] & ok)
        z, lp, ent, lse = run.forward(h, r0, r1, t, ok)
        logprob[r0:r1] = torch.where(void & ok, float("nan"), lp)
        entropy[r0:r1] = torch.where(void & ok, float("nan"), ent)
        g = policy_token_grad(lp, tok.rows(r0, r1), on[r0:r1], scale[r0:r1], opts)
        run.backward(z, h, r0, r1, t, lse, torch.where(ok, g, 0.0), grad_h, grad_w, grad_b)
    loss, _, _, stats = pl_fwd(logprob, tok, cu_seqlens, seq_weights, opts)
    # mean entropy over the final mask (capped tokens and rows outside cu_seqlens excluded)
    ent_sum = torch.where(on, m * entropy, 0.0).sum()
    n_tok = stats[POLICY_STAT_NAMES.index("n_tokens")]
    ent_mean = torch.where(n_tok > 0, ent_sum / n_tok.clamp_min(1e-30), 0.0)
    stats = torch.cat([stats, ent_mean.reshape(1)])
    gb = torch.empty(0, **f32) if grad_b is None else grad_b
    return (
        loss,
        stats,
        logprob,
        entropy,
        grad_h.to(hidden.dtype),
        grad_w.to(weight.dtype),
        gb.to(weight.dtype if bias is None else bias.dtype),
    )


def linear_policy_loss_schema_args(
    args: tuple | list,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float | torch.Tensor,
           PolicyTokens, torch.Tensor | None, torch.Tensor | None, PolicyLossOptions]:  # fmt: skip
    """The arguments of ``linear_policy_loss_fused`` (after ``steps, pl_fwd``) from the flat
    arguments of the registered op ``paravt::linear_policy_loss`` less ``impl``:
    ``hidden, weight, targets, old_logprob, advantages, loss_mask, bias, temperature,
    ref_logprob, prox_logprob, cu_seqlens, seq_weights, *PolicyLossOptions fields`` (the op's
    ``temperature`` argument is its per-row tensor or, without one, its float)."""
    h, w, t, old, adv, mask, bias, temperature, ref, prox, cu, sw, *opt_args = args
    tok = PolicyTokens(old, adv, mask, ref, prox)
    return h, w, t, bias, temperature, tok, cu, sw, PolicyLossOptions.from_schema_args(opt_args)


def linear_policy_loss_torch(*args) -> tuple[torch.Tensor, ...]:
    """Torch path of ``linear_policy_loss`` (CPU, and the test oracle of the Triton path):
    ``linear_policy_loss_fused`` with ``TorchRowChunks`` (a ``LPL_CHUNK_BYTES_CPU`` buffer).
    ``args``: the op's flat arguments (``linear_policy_loss_schema_args``)."""
    return linear_policy_loss_fused(
        TorchRowChunks, policy_loss_fused_torch, *linear_policy_loss_schema_args(args)
    )
