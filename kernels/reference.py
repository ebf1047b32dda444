"""Pure-torch implementations of the paravt_kernels ops: the CPU path and the test oracle.

Every function here is written from the published formula with plain, vectorised torch ops and
no host synchronisation on the hot path (no ``.item()``, no Python loop over sequences).

Conventions shared by all ops
-----------------------------
* Per-token tensors are packed 1-D ``(N,)`` over a batch of ``B`` sequences whose boundaries are
  ``cu_seqlens`` ``(B+1,)`` int (``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == N``).
* Results are float32 (statistics of bf16 inputs are accumulated in float32).

``linear_logprob_torch`` is a custom ``autograd.Function`` that never materialises the
``(tokens, vocab)`` logits: it walks vocabulary tiles (and token chunks) with an online
log-sum-exp, and its backward recomputes each tile. ``policy_loss_torch`` and
``group_advantage_torch`` are differentiable (where it makes sense) through torch autograd.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .options import AGG_MODES, KL_TYPES, PolicyLossOptions, PolicyTokens

__all__ = [
    "AGG_MODES",
    "KL_TYPES",
    "POLICY_STAT_NAMES",
    "broadcast_to_tokens",
    "group_advantage_torch",
    "kl_penalty",
    "linear_logprob_torch",
    "linear_policy_loss_fused",
    "linear_policy_loss_torch",
    "policy_loss_torch",
    "seq_ids_from_cu_seqlens",
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
# linear_policy_loss: POLICY_STAT_NAMES plus the mean entropy over the final mask.
LINEAR_POLICY_STAT_NAMES = (*POLICY_STAT_NAMES, "entropy")
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


# --------------------------------------------------------------------------------------------
# group advantage
# --------------------------------------------------------------------------------------------
def group_advantage_torch(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    scale: float = 1.0,
    bias: float = 0.0,
) -> torch.Tensor:
    """Group-relative advantages, ``(B,)`` float32.

    ``A_i = (r_i - mean_g) / (std_g + eps) * scale + bias`` (or ``(r_i - mean_g) * scale + bias``
    when ``normalize_std=False``, Dr. GRPO), where ``g = group_index[i]`` and ``std_g`` is the
    **unbiased** (n-1) standard deviation, as ``torch.std`` in TRL's GRPO. A group of size 1
    has no relative signal and an undefined unbiased std: its advantage is exactly 0 (neither
    ``scale`` nor ``bias`` is applied). Groups may be ragged and interleaved in any order;
    ``group_index`` holds arbitrary int ids (only equality matters).
    """
    # group statistics in float64: B is small, and an fp32 sum of rewards with a large common
    # offset loses the low bits that the centred values are made of.
    r = rewards.double()
    # unique's inverse maps arbitrary ids to 0..G-1 (sorted ids; order of rows is irrelevant).
    _, inv = torch.unique(group_index, return_inverse=True)
    num = r.numel()  # an upper bound on the number of groups: no host sync for G
    count = torch.zeros(num, dtype=r.dtype, device=r.device).index_add_(0, inv, torch.ones_like(r))
    total = torch.zeros(num, dtype=r.dtype, device=r.device).index_add_(0, inv, r)
    n = count[inv]
    mean = total[inv] / n
    centred = r - mean
    if normalize_std:
        # two-pass variance (sum of squared deviations) is stable for large reward offsets.
        ssd = torch.zeros(num, dtype=r.dtype, device=r.device).index_add_(0, inv, centred * centred)
        std = torch.sqrt(ssd[inv] / (n - 1).clamp_min(1.0))
        adv = centred / (std + eps) * scale + bias
    else:
        adv = centred * scale + bias
    return torch.where(n > 1, adv, torch.zeros_like(adv)).float()


def seq_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Sequence id of every token, ``(N,)`` int64, from ``cu_seqlens`` ``(B+1,)`` (no host sync).

    Tokens outside ``[cu_seqlens[0], cu_seqlens[-1])`` (padding of a fixed-size buffer) belong
    to no sequence and get id ``B``: size per-sequence buffers ``B + 1`` and drop the last slot.
    """
    cu = cu_seqlens.long()
    nseq = cu.numel() - 1
    # one extra "sequence" B takes the head [0, cu[0]) and one the tail [cu[-1], N)
    lengths = torch.cat([cu[:1], cu[1:] - cu[:-1], total_tokens - cu[-1:]])
    ids = torch.arange(-1, nseq + 1, device=cu.device)
    ids[0] = nseq
    return torch.repeat_interleave(ids, lengths, output_size=total_tokens)


def broadcast_to_tokens(
    seq_values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    parent_index: torch.Tensor | None = None,
    total_tokens: int | None = None,
) -> torch.Tensor:
    """Spread one value per sequence over that sequence's tokens in a packed batch.

    ``seq_values`` ``(B,)``, ``cu_seqlens`` ``(B+1,)`` -> ``(N,)`` with ``N = cu_seqlens[-1]``.
    ``parent_index`` ``(B,)`` int: ``parent_index[i] >= 0`` makes sub-agent sequence ``i`` take
    the value of main sequence ``parent_index[i]``; ``-1`` marks a main sequence (own value).
    Pass ``total_tokens`` (= N) to avoid the one host read of ``cu_seqlens[-1]``.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() != seq_values.numel() + 1:
        raise ValueError(
            f"cu_seqlens has shape {tuple(cu_seqlens.shape)} but seq_values has "
            f"{seq_values.numel()} sequences: cu_seqlens must be (B+1,) = ({seq_values.numel() + 1},)"
        )
    values = seq_values
    if parent_index is not None:
        if parent_index.shape != seq_values.shape:
            raise ValueError(
                f"parent_index has shape {tuple(parent_index.shape)}, expected "
                f"{tuple(seq_values.shape)} (one parent per sequence, -1 for main sequences)"
            )
        pi = parent_index.long()
        values = torch.where(pi >= 0, seq_values[pi.clamp_min(0)], seq_values)
    if total_tokens is None:
        total_tokens = int(cu_seqlens[-1])
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(values, lengths, output_size=total_tokens)


# --------------------------------------------------------------------------------------------
# linear_logprob: chunked, online log-sum-exp, recomputing backward
# --------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------
# policy loss
# --------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------
# linear_policy_loss: lm-head log-prob + policy loss, row chunk by row chunk, three GEMMs
# --------------------------------------------------------------------------------------------
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
        tile = vocab if weight.dtype == torch.float32 else TORCH_VOCAB_TILE
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
        ebuf = torch.empty(z.shape[0], min(TORCH_VOCAB_TILE, vocab), dtype=z.dtype, device=z.device)
        for v0 in range(0, vocab, TORCH_VOCAB_TILE):
            zs = z[:, v0 : v0 + TORCH_VOCAB_TILE]
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
