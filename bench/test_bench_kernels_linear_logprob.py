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
