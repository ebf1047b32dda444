"""CPU benchmark: ``linear_logprob`` fwd+bwd vs the naive path and vs Liger-Kernel.

Shapes: tokens 4096, d 256, vocab 32768, fp32, on whatever CPU runs it (the numbers in
kernels/README.md are from a shared 2-core machine). Each test measures baseline and ours
in the same run on the same inputs and reports ``time_ratio`` and ``mem_ratio`` (ours /
baseline; lower is better) in ``benchmark.extra_info``. Peak memory is the peak of torch's
CPU allocator events (``paravt_kernels.profiling.peak_cpu_alloc_bytes``).

    pytest bench/test_bench_kernels_linear_logprob.py --benchmark-only -s
"""

from __future__ import annotations

import pytest
import torch
from paravt_kernels import linear_logprob, policy_loss
from paravt_kernels.profiling import median_seconds, peak_cpu_alloc_bytes, report_ratios

TOKENS, D, VOCAB = 4096, 256, 32768
ROUNDS = 3
SHAPE = f"tokens={TOKENS} d={D} vocab={VOCAB} fp32"


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(TOKENS, D, generator=g) * 0.5).requires_grad_()
    w = (torch.randn(VOCAB, D, generator=g) * 0.05).requires_grad_()
    t = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    gout = torch.randn(TOKENS, generator=g)
    return h, w, t, gout


def test_bench_linear_logprob_vs_naive(benchmark, inputs):
    h, w, t, gout = inputs

    def naive():
        h.grad = w.grad = None
        lp = torch.log_softmax(h @ w.T, dim=-1).gather(1, t[:, None]).squeeze(1)
        (lp * gout).sum().backward()

    def ours():
        h.grad = w.grad = None
        (linear_logprob(h, w, t) * gout).sum().backward()

    # correctness on these very inputs before timing anything
    with torch.no_grad():
        ref = torch.log_softmax(h[:64] @ w.T, -1).gather(1, t[:64, None]).squeeze(1)
        torch.testing.assert_close(linear_logprob(h[:64], w, t[:64]), ref, atol=1e-4, rtol=1e-5)

    benchmark.pedantic(ours, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    t_ours = benchmark.stats.stats.median
    t_base = median_seconds(naive, repeats=ROUNDS, warmup=1)
    peaks = (peak_cpu_alloc_bytes(ours), peak_cpu_alloc_bytes(naive))
    baseline = "naive (full logits, log_softmax, gather)"
    info = report_ratios(benchmark, "linear_logprob", SHAPE, baseline, (t_ours, t_base), peaks)
    assert info["mem_ratio"] <= 0.25, info


def test_bench_linear_logprob_loss_vs_liger(benchmark, inputs):
    """Same GRPO token loss (bnpo/token-mean, clip 0.2, no KL) both ways: Liger's chunked fused
    linear GRPO loss (its torch path, compiled=False) vs linear_logprob + policy_loss."""
    liger = pytest.importorskip("liger_kernel.chunked_loss")
    h, w, t, _ = inputs
    b, s = 8, TOKENS // 8
    g = torch.Generator().manual_seed(1)
    adv_seq = torch.randn(b, generator=g)
    old = -torch.rand(b, s, generator=g) * 3 - 8
    mask = torch.ones(b, s)
    lf = liger.LigerFusedLinearGRPOLoss(beta=0.0, compiled=False, use_ref_model=False,
                                        chunk_size=1, loss_type="bnpo")  # fmt: skip

    def run_liger():
        h.grad = w.grad = None
        out = lf(h.view(b, s, D), w, t.view(b, s), mask, adv_seq, old_per_token_logps=old)
        out[0].backward()

    adv_tok = adv_seq.repeat_interleave(s)

    def ours():
        h.grad = w.grad = None
        lp = linear_logprob(h, w, t)
        loss, _ = policy_loss(lp, old.view(-1), adv_tok, mask.view(-1), agg="token-mean")
        loss.backward()

    benchmark.pedantic(ours, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    t_ours = benchmark.stats.stats.median
    t_base = median_seconds(run_liger, repeats=ROUNDS, warmup=1)
    peaks = (peak_cpu_alloc_bytes(ours), peak_cpu_alloc_bytes(run_liger))
    baseline = "liger LigerFusedLinearGRPOLoss (torch path)"
    report_ratios(benchmark, "linear_logprob", SHAPE, baseline, (t_ours, t_base), peaks)


def _previous_bwd_triton(grad_logprob, hidden, weight, targets, lse, bv):
    """The Triton-path backward of ``linear_logprob`` before issue 37 (commit 96e34d3), kept
    here as the memory baseline: a full NaN-safe copy of ``hidden``, a fresh fp32 ``dZ W``
    product per vocabulary tile added into ``dH``, a ``bv``-column logits tile (no entropy,
    no bias, temperature 1: the bench's case)."""
    from paravt_kernels.linear_logprob_reference import (
        void_row_stand_ins,
        zero_nonfinite_dead_rows,
    )
    from paravt_kernels.linear_logprob_triton import bwd_tile, mm_f32

    n_tok, d = hidden.shape
    vocab = weight.shape[0]
    g = grad_logprob.float().contiguous()
    hidden, void = zero_nonfinite_dead_rows(hidden, g != 0)
    lse, _ = void_row_stand_ins(void, lse, torch.empty(0), None, 1.0)
    grad_h = torch.zeros(n_tok, d)
    grad_w = torch.empty(vocab, d)
    dz_buf = torch.empty(n_tok, bv)
    for v0 in range(0, vocab, bv):
        v1 = min(v0 + bv, vocab)
        z = mm_f32(hidden, weight[v0:v1].T)
        dz = dz_buf[:, : v1 - v0]
        bwd_tile(z, dz, v0, None, targets, lse.contiguous(), g, None, None, 1.0)
        del z
        torch.mm(dz.T, hidden, out=grad_w[v0:v1])
        grad_h += mm_f32(dz, weight[v0:v1])
    return grad_h, grad_w


def test_bench_linear_logprob_triton_backward_memory(benchmark, monkeypatch):
    """Peak memory of the Triton path's forward + backward (CPU interpreter) against the
    previous backward (its 8192-column tile, and the new 2048-column tile to separate the
    tile from the copy / the fresh product) and against the full-logits torch path with
    autograd, same inputs, same run. Shape: tokens 2048, d 1024, vocab 8192, fp32."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from paravt_kernels import linear_logprob_triton as llt

    n, d, v, tile = 2048, 1024, 8192, 2048
    g = torch.Generator().manual_seed(5)
    h = torch.randn(n, d, generator=g) * 0.5
    w = torch.randn(v, d, generator=g) * 0.05
    t = torch.randint(0, v, (n,), generator=g)
    gout = torch.randn(n, generator=g)
    monkeypatch.setattr(llt, "CPU_VOCAB_TILE", tile)
    _, _, lse = llt.linear_logprob_fwd_triton(h, w, t, None, 1.0, False, -100)

    def ours():
        llt.linear_logprob_fwd_triton(h, w, t, None, 1.0, False, -100)
        llt.linear_logprob_bwd_triton(gout, None, h, w, t, None, lse, torch.empty(0), 1.0, -100)

    def previous(bv):
        def run():
            llt.linear_logprob_fwd_triton(h, w, t, None, 1.0, False, -100)
            _previous_bwd_triton(gout, h, w, t, lse, bv)

        return run

    def full_logits():
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp = torch.log_softmax(hh @ ww.T, dim=-1).gather(1, t[:, None]).squeeze(1)
        torch.autograd.grad(lp, (hh, ww), gout)

    # same gradients before measuring anything
    gh, gw, _ = llt.linear_logprob_bwd_triton(gout, None, h, w, t, None, lse, torch.empty(0),
                                              1.0, -100)  # fmt: skip
    ph, pw = _previous_bwd_triton(gout, h, w, t, lse, v)
    torch.testing.assert_close(gh, ph, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gw, pw, atol=1e-5, rtol=1e-4)

    benchmark.pedantic(ours, rounds=1, iterations=1, warmup_rounds=0)
    fns = {"ours": ours, "previous_tile8192": previous(v), "previous_tile2048": previous(tile),
           "full_logits_torch": full_logits}  # fmt: skip
    peaks = {k: peak_cpu_alloc_bytes(f) for k, f in fns.items()}
    info = {f"{k}_peak_mib": b / 2**20 for k, b in peaks.items()}
    for k in ("previous_tile8192", "previous_tile2048", "full_logits_torch"):
        info[f"mem_ratio_vs_{k}"] = peaks["ours"] / peaks[k]
    info["shape"] = f"tokens={n} d={d} vocab={v} fp32, tile {tile} (previous: {v})"
    benchmark.extra_info.update(info)
    print("\nlinear_logprob triton backward memory:", info)
    assert peaks["ours"] < peaks["previous_tile2048"] < peaks["previous_tile8192"], info
