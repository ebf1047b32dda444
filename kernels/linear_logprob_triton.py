"""Fused lm-head log-prob (Triton epilogues around tensor-core matmuls).

The ``(N, V)`` logits are never held: the vocabulary is walked in tiles of ``BV`` rows of the
weight. Per tile the logits ``Z_j = H W_j^T`` (``(N, BV)``, fp32 accumulate/output) come from
a matmul (cuBLAS on GPU), then:

* forward, ``_llp_fwd_tile_kernel`` (grid: token blocks): one read of ``Z_j`` updates each
  token's online log-sum-exp state (running max ``m``, ``s = sum e^{z-m}``,
  ``u = sum e^{z-m} z`` for the entropy) and picks the target logit when it lies in the tile;
  bias and ``1/T`` are applied on load.
* backward, ``_llp_bwd_tile_kernel`` (grid: token blocks x column blocks): one read of the
  recomputed ``Z_j`` writes ``dZ_j = (g (1[j=t] - p) - k p (z - lse + H)) / T`` in the
  operand dtype, then ``dW_j = dZ_j^T H`` is written ONCE per vocabulary tile and
  ``dH += dZ_j W_j`` accumulates in fp32.

Memory: one ``(N, BV)`` fp32 tile (+ one ``dZ`` tile in backward) instead of ``(N, V)``
logits, log-softmax and their gradient. FLOPs: ``8 N d V`` (the forward matmul is recomputed
in backward) against ``6 N d V`` for the naive path.
Maths: ``linear_logprob_reference.linear_logprob_forward_torch`` /
``linear_logprob_backward_torch``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import lazy_jit, next_pow2
from .dispatch import interpreting
from .linear_logprob_reference import inverse_temperature, row_stats

# GPU tile of the vocabulary: LOGITS_TILE_BYTES of fp32 logits per tile (read at every call;
# the bench sweeps it). 64 MiB = 2^24 logits: 2048 vocabulary rows at N = 8192, a
# (8192 x 4096) x (4096 x 2048) matmul, still large for the tensor cores; the 256 MiB tile of
# before held 4x the memory (plus a bf16 dZ tile of half its size).
LOGITS_TILE_BYTES = 64 << 20
# Columns of hidden per dW GEMM (the select that zeroes dead NaN rows makes an (N, cols)
# operand, not a copy of hidden): LOGITS_TILE_BYTES // 4 // N rounded to 128, at most d.
# None: that rule; an int: fixed (tests force several chunks).
DW_COLS: int | None = None
# Interpreter (CPU) vocabulary tile; None: the whole vocabulary up to 8192, else 4096.
CPU_VOCAB_TILE: int | None = None
_GPU_FWD = {"BLOCK_M": 16, "BLOCK_N": 512, "num_warps": 4}
_GPU_BWD = {"BLOCK_M": 16, "BLOCK_N": 512, "num_warps": 4}


@lazy_jit
def _llp_fwd_tile_kernel(
    z_ptr, stride_z, bias_ptr, tgt_ptr, m_ptr, s_ptr, u_ptr, zt_ptr, invt_ptr,
    n_rows, n_cols, v0, inv_t,
    HAS_BIAS: tl.constexpr, ENTROPY: tl.constexpr, ROW_T: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < n_rows
    rows64 = rows.to(tl.int64)
    if ROW_T:  # one inverse temperature per row
        it = tl.load(invt_ptr + rows, mask=rmask, other=1.0)
    else:
        it = tl.full((BLOCK_M,), 1.0, tl.float32) * inv_t
    m = tl.load(m_ptr + rows, mask=rmask, other=float("-inf"))
    s = tl.load(s_ptr + rows, mask=rmask, other=0.0)
    if ENTROPY:
        u = tl.load(u_ptr + rows, mask=rmask, other=0.0)
    for c0 in range(0, n_cols, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        cmask = cols < n_cols
        z = tl.load(
            z_ptr + rows64[:, None] * stride_z + cols[None, :],
            mask=rmask[:, None] & cmask[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(bias_ptr + v0 + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        z = tl.where(cmask[None, :], z * it[:, None], float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 1))
        # rows past the end stay at -inf; shift by 0 there so no (-inf) - (-inf) NaN appears.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - shift)
        e = tl.exp(z - shift[:, None])
        s = s * alpha + tl.sum(e, 1)
        if ENTROPY:
            u = u * alpha + tl.sum(e * tl.where(cmask[None, :], z, 0.0), 1)  # no 0 * -inf
        m = m_new
    tl.store(m_ptr + rows, m, mask=rmask)
    tl.store(s_ptr + rows, s, mask=rmask)
    if ENTROPY:
        tl.store(u_ptr + rows, u, mask=rmask)
    t = tl.load(tgt_ptr + rows, mask=rmask, other=-1)
    inside = rmask & (t >= v0) & (t < v0 + n_cols)
    zt = tl.load(z_ptr + rows64 * stride_z + (t - v0), mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        zt += tl.load(bias_ptr + t, mask=inside, other=0.0).to(tl.float32)
    tl.store(zt_ptr + rows, zt * it, mask=inside)


@lazy_jit
def _llp_bwd_tile_kernel(
    z_ptr, stride_z, dz_ptr, stride_dz, bias_ptr, tgt_ptr, lse_ptr, g_ptr, k_ptr, ent_ptr,
    invt_ptr, void_ptr, n_rows, n_cols, v0, inv_t,
    HAS_BIAS: tl.constexpr, ENTROPY: tl.constexpr, ROW_T: tl.constexpr, HAS_VOID: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < n_rows
    cmask = cols < n_cols
    rows64 = rows.to(tl.int64)
    io_mask = rmask[:, None] & cmask[None, :]
    z = tl.load(z_ptr + rows64[:, None] * stride_z + cols[None, :], mask=io_mask, other=0.0)
    z = z.to(tl.float32)
    if HAS_BIAS:
        z += tl.load(bias_ptr + v0 + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if ROW_T:  # one inverse temperature per row
        it = tl.load(invt_ptr + rows, mask=rmask, other=1.0)
    else:
        it = tl.full((BLOCK_M,), 1.0, tl.float32) * inv_t
    z = z * it[:, None]
    lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
    g = tl.load(g_ptr + rows, mask=rmask, other=0.0)
    p = tl.exp(z - lse[:, None])
    if ENTROPY:
        k = tl.load(k_ptr + rows, mask=rmask, other=0.0)
        h = tl.load(ent_ptr + rows, mask=rmask, other=0.0)
        dz = -p * (g[:, None] + k[:, None] * (z - lse[:, None] + h[:, None]))
    else:
        dz = -p * g[:, None]
    t = tl.load(tgt_ptr + rows, mask=rmask, other=-1)
    dz += tl.where((cols[None, :] + v0) == t[:, None], g[:, None], 0.0)
    dz = dz * it[:, None]
    if HAS_VOID:  # dead rows with a NaN/inf hidden state: exactly 0 (their z, lse are NaN)
        void = tl.load(void_ptr + rows, mask=rmask, other=0)
        dz = tl.where(void[:, None] != 0, 0.0, dz)
    tl.store(
        dz_ptr + rows64[:, None] * stride_dz + cols[None, :],
        dz.to(dz_ptr.dtype.element_ty),
        mask=io_mask,
    )


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with an fp32 result. Low-precision CUDA operands use the tensor cores with an
    fp32 output (no rounding of the logits to bf16); on CPU they are upcast first."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        return _mm_lowp_out_f32(a, b)
    return a.float() @ b.float()


def _mm_lowp_out_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.mm(a, b, out_dtype=torch.float32)`` for bf16/fp16 operands, or a clear error.

    There is deliberately no fallback to ``(a @ b).float()``: logits rounded to bf16 (8 bits
    of mantissa, spacing 0.0625 at |z| ~ 10) put an error of ~0.05 on every log-prob, i.e. a
    5% error in the policy ratio against a clip range of 0.2, and it would do so silently.
    """
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, TypeError) as err:
        raise RuntimeError(
            f"linear_logprob: hidden ({a.dtype}) x weight ({b.dtype}) on {a.device.type} needs "
            "a matmul with float32 output, torch.mm(..., out_dtype=torch.float32), and this "
            f"torch ({torch.__version__}) refused it: {str(err).splitlines()[0].split('. ')[0]}. Rounding the "
            "logits to the operand dtype instead would put an error of ~0.05 on every "
            "log-prob. Use a torch whose mm accepts out_dtype=torch.float32 for these "
            "operands on this device, or pass float32 hidden and weight, or set "
            "PARAVT_IMPL=torch (the torch path upcasts each weight tile)."
        ) from err


def _vocab_tile(n_tok: int, vocab: int) -> int:
    if interpreting():
        if CPU_VOCAB_TILE:
            return min(vocab, CPU_VOCAB_TILE)
        return vocab if vocab <= 8192 else 4096
    bv = max(512, min(16384, LOGITS_TILE_BYTES // 4 // max(n_tok, 1)))
    return min(vocab, bv // 128 * 128)


def _dw_cols(n_tok: int, d: int, bv: int) -> int:
    """Columns of hidden per dW GEMM (see ``DW_COLS``): the zeroed-row operand is at most
    ``n_tok x cols`` in hidden's dtype, no larger than the logits tile."""
    if DW_COLS:
        return min(d, DW_COLS)
    return min(d, max(128, bv // 128 * 128))


def _dw_tile(out: torch.Tensor, dz: torch.Tensor, h: torch.Tensor, void: torch.Tensor,
             cols: int) -> None:  # fmt: skip
    """``out = dz^T h`` with ``h``'s ``void`` rows taken as zeros: per chunk of ``cols``
    columns, an ``(N, cols)`` select, then one GEMM into ``out[:, chunk]`` (the full
    reduction over the N rows in one GEMM: same precision as one ``dz^T h``)."""
    d = h.shape[1]
    for c0 in range(0, d, cols):
        c1 = min(c0 + cols, d)
        h_c = torch.where(void[:, None], 0.0, h[:, c0:c1])
        torch.mm(dz.T, h_c, out=out[:, c0:c1])


def addmm_f32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` fp32 (the products of low-precision operands are formed
    with an fp32 output, never rounded to the operand dtype).

    On CUDA the low-precision product is accumulated by cuBLAS itself (``addmm`` with
    ``out_dtype=float32``, beta 1, into ``acc``): no fp32 temporary of ``acc``'s size (at
    V = 151936, d = 4096 that temporary is 2.5 GB written, read and added per call). Where
    torch lacks that overload, the temporary path gives the same fp32 sums. Used by the
    backward of ``linear_logprob`` (dH) and by ``linear_policy_loss`` (dW)."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    if a.is_cuda:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (RuntimeError, TypeError):
            pass
    acc += mm_f32(a, b)


def _blocks(n_tok: int, bv: int, fwd: bool) -> dict:
    if interpreting():
        # programs run one after another: few, large blocks.
        return {"BLOCK_M": min(next_pow2(n_tok), 128), "BLOCK_N": min(next_pow2(bv), 1024)}
    return dict(_GPU_FWD if fwd else _GPU_BWD)


def linear_logprob_fwd_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float | torch.Tensor,
    return_entropy: bool,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logprob (N,), entropy (N,) or (0,), lse (N,))``, all float32; ``temperature`` is a
    float or a ``(N,)`` tensor (one per row)."""
    n_tok, _ = hidden.shape
    vocab = weight.shape[0]
    dev = hidden.device
    f32 = {"dtype": torch.float32, "device": dev}
    m = torch.full((n_tok,), float("-inf"), **f32)
    s = torch.zeros(n_tok, **f32)
    u = torch.zeros(n_tok, **f32) if return_entropy else None
    zt = torch.zeros(n_tok, **f32)
    if n_tok == 0:
        e = torch.empty(0, **f32)
        return e, e.clone(), e.clone()
    bv = _vocab_tile(n_tok, vocab)
    inv_t = inverse_temperature(temperature, dev)
    for v0 in range(0, vocab, bv):
        v1 = min(v0 + bv, vocab)
        z = mm_f32(hidden, weight[v0:v1].T)
        fwd_tile(z, v0, bias, targets, m, s, u, zt, inv_t)
    logprob, entropy, lse = row_stats(m, s, u, zt, targets != ignore_index)
    return logprob, torch.empty(0, **f32) if entropy is None else entropy, lse


def fwd_tile(z, v0, bias, targets, m, s, u, zt, inv_t) -> None:
    """Update the online log-sum-exp state ``(m, s, u, zt)`` of ``z``'s rows with the raw
    logits tile ``z`` (columns ``v0 ..``; bias and ``1/T`` applied on load; ``u is None``:
    no entropy). ``targets`` and the state have ``z``'s rows."""
    n_rows, n_cols = z.shape
    cfg = _blocks(n_rows, n_cols, fwd=True)
    row_t = isinstance(inv_t, torch.Tensor)
    _llp_fwd_tile_kernel[(triton.cdiv(n_rows, cfg["BLOCK_M"]),)](
        z, z.stride(0), z if bias is None else bias, targets, m, s, m if u is None else u, zt,
        inv_t if row_t else m, n_rows, n_cols, v0, 1.0 if row_t else inv_t,
        HAS_BIAS=bias is not None, ENTROPY=u is not None, ROW_T=row_t, **cfg,
    )  # fmt: skip


def bwd_tile(z, dz, v0, bias, targets, lse, g, k, entropy, inv_t, void=None) -> None:
    """Write ``dz = (g (1[j=t] - p) - k p (z - lse + H)) / T`` of the raw logits tile ``z``
    (columns ``v0 ..``) in ``dz``'s dtype; ``k is None``: no entropy term. ``dz`` may be
    ``z`` itself (each element is read, then written, by the same program). ``void`` (rows,)
    uint8: rows whose ``dz`` is selected to exactly 0 whatever ``z``/``lse`` hold."""
    n_rows, n_cols = z.shape
    cfg = _blocks(n_rows, n_cols, fwd=False)
    row_t = isinstance(inv_t, torch.Tensor)
    grid = (triton.cdiv(n_rows, cfg["BLOCK_M"]), triton.cdiv(n_cols, cfg["BLOCK_N"]))
    _llp_bwd_tile_kernel[grid](
        z, z.stride(0), dz, dz.stride(0), z if bias is None else bias, targets, lse, g,
        g if k is None else k, lse if entropy is None else entropy, inv_t if row_t else lse,
        lse if void is None else void, n_rows, n_cols, v0, 1.0 if row_t else inv_t,
        HAS_BIAS=bias is not None, ENTROPY=k is not None, ROW_T=row_t,
        HAS_VOID=void is not None, **cfg,
    )  # fmt: skip


def linear_logprob_bwd_triton(
    grad_logprob: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    temperature: float | torch.Tensor,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dhidden (N,d) fp32, dweight (V,d), dbias (V,) fp32 or None)`` by tile recomputation."""
    n_tok, d = hidden.shape
    vocab = weight.shape[0]
    dev = hidden.device
    valid = targets != ignore_index
    # select, never multiply by the mask: a NaN gradient arriving for an ignored row would
    # survive `* 0` and reach every row of the weight gradient through dZ^T H.
    g = torch.where(valid, grad_logprob.float(), 0.0).contiguous()
    use_ent = grad_entropy is not None and entropy.numel() == n_tok
    k = torch.where(valid, grad_entropy.float(), 0.0).contiguous() if use_ent else g
    # Rows with no incoming gradient (masked by the loss, ignored) and a NaN/inf hidden state
    # must contribute nothing, but 0 * NaN = NaN would reach every row of dW through dZ^T H.
    # Selected per tile, never a copy of hidden: their dZ rows are set to exactly 0 in the
    # tile kernel (so dH = dZ W is 0 there), and the H operand of each dW GEMM is taken
    # column chunk by column chunk with those rows zeroed (``_dw_tile``). ``void`` comes from
    # a row sum in fp32, (N,) without an (N, d) temporary; a finite row whose sum overflows
    # counts as void too, which is harmless: zeroing a dead row changes nothing.
    live = (g != 0) | (k != 0) if use_ent else g != 0
    void = ~(live | torch.isfinite(hidden.sum(dim=1, dtype=torch.float32)))
    void_u8 = void.to(torch.uint8)
    inv_t = inverse_temperature(temperature, dev)
    lse = lse.contiguous()
    grad_h = torch.zeros(n_tok, d, dtype=torch.float32, device=dev)
    # dW is written once per vocabulary tile, in the weight's dtype on GPU (as cuBLAS emits).
    gw_dtype = weight.dtype if dev.type == "cuda" else torch.float32
    grad_w = torch.empty(vocab, d, dtype=gw_dtype, device=dev)
    grad_b = torch.empty(vocab, dtype=torch.float32, device=dev) if bias is not None else None
    if n_tok == 0:
        grad_w.zero_()
        if grad_b is not None:
            grad_b.zero_()
        return grad_h, grad_w, grad_b
    # dZ feeds two matmuls: keep it in the operand dtype on GPU (tensor cores), fp32 on CPU.
    dz_dtype = hidden.dtype if dev.type == "cuda" else torch.float32
    h_op = hidden if dev.type == "cuda" or hidden.dtype == torch.float32 else hidden.float()
    bv = _vocab_tile(n_tok, vocab)
    dc = _dw_cols(n_tok, d, bv)
    dz_buf = torch.empty(n_tok, bv, dtype=dz_dtype, device=dev)
    for v0 in range(0, vocab, bv):
        v1 = min(v0 + bv, vocab)
        w_j = weight[v0:v1]
        z = mm_f32(hidden, w_j.T)
        dz = dz_buf[:, : v1 - v0]
        bwd_tile(z, dz, v0, bias, targets, lse, g, k if use_ent else None,
                 entropy if use_ent else None, inv_t, void_u8)  # fmt: skip
        del z
        w_op = w_j if dev.type == "cuda" else w_j.float()
        _dw_tile(grad_w[v0:v1], dz, h_op, void, dc)
        addmm_f32(grad_h, dz, w_op)  # in place: no fp32 (N, d) product per tile
        if grad_b is not None:
            grad_b[v0:v1] = dz.sum(dim=0, dtype=torch.float32)
    return grad_h, grad_w, grad_b
