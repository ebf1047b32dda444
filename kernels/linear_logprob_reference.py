"""Torch reference of ``linear_logprob``: the CPU path and the test oracle of
``linear_logprob_triton.py`` (``ops.linear_logprob_fwd_op`` / ``linear_logprob_bwd_op`` with
``impl="torch"``); its tile helpers (``row_stats``, ``_tile_logits``, ``_dlogits``, ...) are
also the torch steps of ``linear_policy_loss_reference.TorchRowChunks``.

``linear_logprob_torch`` is a custom ``autograd.Function`` that never materialises the
``(tokens, vocab)`` logits: it walks vocabulary tiles (and token chunks) with an online
log-sum-exp, and its backward recomputes each tile. Results are float32 (statistics of bf16
inputs are accumulated in float32); no host synchronisation on the hot path.
"""

from __future__ import annotations

import torch

__all__ = [
    "TORCH_TOKEN_CHUNK",
    "TORCH_VOCAB_TILE",
    "inverse_temperature",
    "linear_logprob_backward_torch",
    "linear_logprob_forward_torch",
    "linear_logprob_torch",
    "row_stats",
    "void_row_stand_ins",
    "zero_nonfinite_dead_rows",
]

# Tile sizes for the CPU path: a (4096 tokens x 2048 vocab) fp32 tile is 32 MiB. Measured on
# 2 cores at 4096 x 256 x 32768: small tiles (256 x 4096) were 3x slower than this (per-op
# overhead and thin matmuls dominate); the memory saving stays ~10x.
TORCH_TOKEN_CHUNK = 4096
TORCH_VOCAB_TILE = 2048


def _tile_logits(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    inv_t: float | torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 ``(h @ w.T + b) * inv_t`` for one tile, written into ``out`` when given.

    ``inv_t`` is a float, or a ``(rows,)`` float32 tensor (one inverse temperature per row).

    ``h`` must already be fp32; bf16/fp16 weight tiles are upcast (exact products). Writing
    into a reused buffer matters on CPU: a fresh 32 MiB result per tile is returned to the
    OS on free and page-faulted back on the next tile (measured: matmul+exp 1.5x slower).
    """
    wf = w if w.dtype == torch.float32 else w.float()
    if out is None:
        z = h @ wf.T
    else:
        z = torch.mm(h, wf.T, out=out)
    if b is not None:
        z.add_(b.float())
    if isinstance(inv_t, torch.Tensor):
        z.mul_(inv_t[:, None])
    elif inv_t != 1.0:
        z.mul_(inv_t)
    return z


def inverse_temperature(
    temperature: float | torch.Tensor, device: torch.device
) -> float | torch.Tensor:
    """``1 / T`` as a float, or as a contiguous ``(N,)`` float32 tensor for per-row ``T``."""
    if isinstance(temperature, torch.Tensor):
        return (1.0 / temperature.to(device=device, dtype=torch.float32)).contiguous()
    return 1.0 / float(temperature)


def _rows(inv_t: float | torch.Tensor, c0: int, c1: int) -> float | torch.Tensor:
    return inv_t[c0:c1] if isinstance(inv_t, torch.Tensor) else inv_t


def linear_logprob_forward_torch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float | torch.Tensor,
    return_entropy: bool,
    ignore_index: int,
    token_chunk: int | None = None,
    vocab_tile: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward statistics without gradients: ``(logprob, entropy, lse)``, each ``(N,)`` float32.

    ``temperature`` is a float or a ``(N,)`` tensor (one temperature per row); ``lse`` and
    ``entropy`` are those of the tempered distribution ``softmax(z / T)``.

    Online log-sum-exp over vocabulary tiles, per token: running max ``m``, ``s = sum e^{z-m}``
    and (entropy only) ``u = sum e^{z-m} z``; then ``lse = m + log s``,
    ``logprob = z_target - lse`` (clamped to <= 0) and ``entropy = lse - u / s``.
    ``entropy`` is an empty tensor when not requested. Ignored targets give 0 and 0.
    """
    token_chunk = token_chunk or TORCH_TOKEN_CHUNK
    vocab_tile = vocab_tile or TORCH_VOCAB_TILE
    n_tok = hidden.shape[0]
    vocab = weight.shape[0]
    dev = hidden.device
    inv_t = inverse_temperature(temperature, dev)
    f32 = {"dtype": torch.float32, "device": dev}
    lse = torch.empty(n_tok, **f32)
    logprob = torch.empty(n_tok, **f32)
    entropy = torch.empty(n_tok if return_entropy else 0, **f32)
    tgt = targets.long()
    valid = tgt != ignore_index
    hf = hidden.float()
    zbuf = torch.empty(min(token_chunk, n_tok) * min(vocab_tile, vocab), **f32)
    for c0 in range(0, n_tok, token_chunk):
        c1 = min(c0 + token_chunk, n_tok)
        h = hf[c0:c1]
        t = tgt[c0:c1]
        m = torch.full((c1 - c0,), float("-inf"), **f32)
        s = torch.zeros(c1 - c0, **f32)
        u = torch.zeros(c1 - c0, **f32) if return_entropy else None
        zt = torch.zeros(c1 - c0, **f32)
        for v0 in range(0, vocab, vocab_tile):
            v1 = min(v0 + vocab_tile, vocab)
            out = zbuf[: (c1 - c0) * (v1 - v0)].view(c1 - c0, v1 - v0)
            b = None if bias is None else bias[v0:v1]
            z = _tile_logits(h, weight[v0:v1], b, _rows(inv_t, c0, c1), out)
            m, s, u, zt = _online_update(z, t, v0, m, s, u, zt)
        lp, ent, lse[c0:c1] = row_stats(m, s, u, zt, valid[c0:c1])
        logprob[c0:c1] = lp
        if u is not None:
            entropy[c0:c1] = ent
    return logprob, entropy, lse


def _online_update(
    z: torch.Tensor,
    t: torch.Tensor,
    v0: int,
    m: torch.Tensor,
    s: torch.Tensor,
    u: torch.Tensor | None,
    zt: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One vocabulary tile ``z`` (columns ``v0 ..``, tempered logits) of the online
    log-sum-exp: returns the updated ``(m, s, u, zt)`` (see ``linear_logprob_forward_torch``).

    Without entropy (``u is None``) ``z`` is overwritten (``exp`` in place, no second
    tile-sized buffer); with it, ``z`` is left intact.
    """
    v1 = v0 + z.shape[1]
    inside = (t >= v0) & (t < v1)
    local = (t - v0).clamp(0, v1 - v0 - 1)
    zt = torch.where(inside, z.gather(1, local[:, None]).squeeze(1), zt)
    m_new = torch.maximum(m, z.amax(dim=1))
    alpha = torch.exp(m - m_new)
    if u is not None:
        e = torch.exp(z - m_new[:, None])
        u = u * alpha + (e * z).sum(dim=1)
    else:
        e = z.sub_(m_new[:, None]).exp_()
    s = s * alpha + e.sum(dim=1)
    return m_new, s, u, zt


def row_stats(
    m: torch.Tensor,
    s: torch.Tensor,
    u: torch.Tensor | None,
    zt: torch.Tensor,
    valid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(logprob, entropy or None, lse)`` from the online state: ``lse = m + log s``,
    ``logprob = min(zt - lse, 0)``, ``entropy = lse - u / s``; 0 and 0 where not ``valid``."""
    lse = m + torch.log(s)
    logprob = torch.where(valid, (zt - lse).clamp_max(0.0), 0.0)
    entropy = None if u is None else torch.where(valid, lse - u / s, 0.0)
    return logprob, entropy, lse


def zero_nonfinite_dead_rows(
    hidden: torch.Tensor, live: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden with each dead row that holds a NaN/inf replaced by zeros, those rows (N,))``.

    ``live`` ``(N,)`` bool marks the rows that take a gradient. A dead row (masked, ignored
    target, zero incoming gradient) must contribute exactly nothing, but ``0 * NaN = NaN``:
    a non-finite hidden value makes the row's logits, hence its ``dlogits = g (onehot - p)``
    row, NaN even though ``g = 0`` there, and ``dW = dlogits^T H`` then spreads it over EVERY
    row of the weight gradient (and ``db`` over every entry). Zeroing such rows before the
    GEMMs gives finite logits, an exactly-0 ``dlogits`` row (``-p * 0``), so ``dH = 0`` for
    the row and nothing in ``dW``/``db``: the result of the row replaced by zeros. A select,
    not a multiply; ``O(N d)`` beside the ``O(N d V)`` GEMMs, no host sync. Live rows are
    never touched: a NaN there still shows in the loss.
    """
    void = ~(live | torch.isfinite(hidden).all(dim=1))
    return torch.where(void[:, None], 0.0, hidden), void


def void_row_stand_ins(
    void: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    bias: torch.Tensor | None,
    inv_t: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lse, entropy)`` of ``linear_logprob``'s backward with stand-ins at the ``void`` rows.

    Those rows were zeroed after the forward (``zero_nonfinite_dead_rows``), whose ``lse`` and
    entropy there are NaN; ``dlogits = -p (g + k (z - lse + H))`` with ``g = k = 0`` is exactly
    0 only if ``p = e^{z - lse}`` and ``z - lse`` are finite. A zero row has logits
    ``z_j = b_j / T``, so ``lse := max_j b_j / T`` (0 without bias) bounds them (``p <= 1``);
    entropy ``:= 0``. ``O(N + V)``, no host sync.
    """
    top = 0.0 if bias is None else bias.float().amax() * inv_t
    lse = torch.where(void, top, lse)
    if entropy.numel() == void.numel():
        entropy = torch.where(void, 0.0, entropy)
    return lse, entropy


def linear_logprob_backward_torch(
    grad_logprob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    temperature: float | torch.Tensor,
    ignore_index: int,
    token_chunk: int | None = None,
    vocab_tile: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients ``(d hidden (N,d), d weight (V,d), d bias (V,) or None)`` by tile recomputation.

    With ``z = (h W^T + b) / T``, ``p = softmax(z)``, ``g`` = grad of logprob, ``k`` = grad of
    entropy ``H``:  ``dL/dz_j = g (1[j=t] - p_j) - k p_j (z_j - lse + H)``, and
    ``dL/dlogits = dL/dz / T``. The vocabulary-tile loop is the OUTER loop so that each tile's
    weight gradient is accumulated over all token chunks and written once.
    """
    token_chunk = token_chunk or TORCH_TOKEN_CHUNK
    vocab_tile = vocab_tile or TORCH_VOCAB_TILE
    n_tok, d = hidden.shape
    vocab = weight.shape[0]
    dev = hidden.device
    f32 = {"dtype": torch.float32, "device": dev}
    inv_t = inverse_temperature(temperature, dev)
    tgt = targets.long()
    valid = tgt != ignore_index
    # select, never multiply by the mask: a NaN gradient arriving for an ignored row would
    # survive `* 0` and reach every row of the weight gradient through dZ^T H.
    g = torch.zeros(n_tok, **f32)
    if grad_logprob is not None:
        g = torch.where(valid, grad_logprob.float(), 0.0)
    k = None
    if grad_entropy is not None and entropy.numel() == n_tok:
        k = torch.where(valid, grad_entropy.float(), 0.0)
    grad_h = torch.zeros(n_tok, d, **f32)
    grad_w = torch.empty(vocab, d, **f32)
    grad_b = torch.empty(vocab, **f32) if bias is not None else None
    # rows with no incoming gradient (masked by the loss, ignored) and a NaN/inf hidden state
    # would still reach dW through 0 * NaN: zeroed (see zero_nonfinite_dead_rows)
    live = g != 0 if k is None else (g != 0) | (k != 0)
    hf, void = zero_nonfinite_dead_rows(hidden.float(), live)
    lse, entropy = void_row_stand_ins(void, lse, entropy, bias, inv_t)
    zbuf = torch.empty(min(token_chunk, n_tok) * min(vocab_tile, vocab), **f32)
    for v0 in range(0, vocab, vocab_tile):
        v1 = min(v0 + vocab_tile, vocab)
        w = weight[v0:v1].float()
        b = None if bias is None else bias[v0:v1]
        gw = grad_w[v0:v1].zero_()
        gb = grad_b[v0:v1].zero_() if grad_b is not None else None
        for c0 in range(0, n_tok, token_chunk):
            c1 = min(c0 + token_chunk, n_tok)
            out = zbuf[: (c1 - c0) * (v1 - v0)].view(c1 - c0, v1 - v0)
            it = _rows(inv_t, c0, c1)
            z = _tile_logits(hf[c0:c1], w, b, it, out)
            kc = None if k is None else k[c0:c1]
            ent = None if k is None else entropy[c0:c1]
            dz = _dlogits(z, tgt[c0:c1], v0, lse[c0:c1], g[c0:c1], kc, ent, it)
            grad_h[c0:c1].addmm_(dz, w)
            gw.addmm_(dz.T, hf[c0:c1])
            if gb is not None:
                gb += dz.sum(dim=0)
    return grad_h, grad_w, grad_b


def _dlogits(
    z: torch.Tensor,
    t: torch.Tensor,
    v0: int,
    lse: torch.Tensor,
    g: torch.Tensor,
    k: torch.Tensor | None,
    entropy: torch.Tensor | None,
    inv_t: float | torch.Tensor,
) -> torch.Tensor:
    """``dL/dlogits`` of one tile ``z`` (columns ``v0 ..``, tempered logits):
    ``(g (1[j=t] - p_j) - k p_j (z_j - lse + H)) / T`` with ``p = exp(z - lse)``.

    Without the entropy term (``k is None``) it is formed in place in ``z`` (returned).
    """
    if k is None:
        dz = z.sub_(lse[:, None]).exp_().mul_(-g[:, None])
    else:
        p = torch.exp(z - lse[:, None])
        dz = -p * (g[:, None] + (z - (lse - entropy)[:, None]) * k[:, None])
    v1 = v0 + z.shape[1]
    inside = (t >= v0) & (t < v1)
    local = (t - v0).clamp(0, v1 - v0 - 1)
    dz.scatter_add_(1, local[:, None], torch.where(inside, g, 0.0)[:, None])
    if isinstance(inv_t, torch.Tensor):
        dz.mul_(inv_t[:, None])
    elif inv_t != 1.0:
        dz.mul_(inv_t)
    return dz


class _LinearLogprobTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, temperature, return_entropy, ignore_index):
        logprob, entropy, lse = linear_logprob_forward_torch(
            hidden, weight, targets, bias, temperature, return_entropy, ignore_index
        )
        ctx.save_for_backward(hidden, weight, targets, bias, lse, entropy)
        ctx.temperature = temperature
        ctx.ignore_index = ignore_index
        ctx.mark_non_differentiable(lse)
        return logprob, entropy, lse

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, _grad_lse):
        hidden, weight, targets, bias, lse, entropy = ctx.saved_tensors
        grad_h, grad_w, grad_b = linear_logprob_backward_torch(
            grad_logprob,
            grad_entropy,
            hidden,
            weight,
            targets,
            bias,
            lse,
            entropy,
            ctx.temperature,
            ctx.ignore_index,
        )
        return (
            grad_h.to(hidden.dtype),
            grad_w.to(weight.dtype),
            None,
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
        )


def linear_logprob_torch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    return_entropy: bool = False,
    ignore_index: int = -100,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log softmax((hidden @ weight.T + bias) / T)[targets]`` without ``(tokens, vocab)`` logits.

    hidden ``(N, d)``, weight ``(V, d)``, targets ``(N,)`` int, bias ``(V,)`` -> logprob ``(N,)``
    float32 (and entropy ``(N,)`` float32). Peak extra memory is one ``(chunk, tile)`` fp32 tile.
    """
    logprob, entropy, _ = _LinearLogprobTorch.apply(
        hidden, weight, targets, bias, float(temperature), bool(return_entropy), int(ignore_index)
    )
    return (logprob, entropy) if return_entropy else logprob
