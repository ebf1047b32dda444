"""CPU benchmark: ``linear_policy_loss`` fwd+bwd vs ``linear_logprob`` + ``policy_loss`` and vs
the naive materialised path (full logits, ``log_softmax``, gather, ``policy_loss``).

Shapes: tokens 2048, d 256, vocab 32768, fp32, GRPO-style loss (seq-mean-token-mean over 16
sequences, k3 KL, dual clip). All three are measured in the same run on the same inputs;
``benchmark.extra_info`` holds ``time_ratio`` and ``mem_ratio`` (ours / baseline; lower is
better). Peak memory: ``paravt_kernels.profiling.peak_cpu_alloc_bytes``.

    pytest bench/test_bench_kernels_linear_policy_loss.py --benchmark-only -q -s
"""

from __future__ import annotations

import pytest
import torch
from paravt_kernels import linear_logprob, linear_policy_loss, policy_loss
from paravt_kernels.profiling import median_seconds, peak_cpu_alloc_bytes, report_ratios

TOKENS, D, VOCAB, SEQS = 2048, 256, 32768, 16
ROUNDS = 3
SHAPE = f"tokens={TOKENS} d={D} vocab={VOCAB} fp32"


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(TOKENS, D, generator=g) * 0.5).requires_grad_()
    w = (torch.randn(VOCAB, D, generator=g) * 0.05).requires_grad_()
    t = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    old = -torch.rand(TOKENS, generator=g) * 3 - 8
    kw = {
        "old_logprob": old,
        "advantages": torch.randn(TOKENS, generator=g),
        "loss_mask": torch.rand(TOKENS, generator=g) > 0.2,
        "ref_logprob": old + 0.1 * torch.randn(TOKENS, generator=g),
        "kl_coef": 0.01,
        "kl_type": "k3",
        "dual_clip": 3.0,
        "agg": "seq-mean-token-mean",
        "cu_seqlens": torch.linspace(0, TOKENS, SEQS + 1).long(),
    }
    return h, w, t, kw


def _policy(lp, kw):
    return policy_loss(
        lp, kw["old_logprob"], kw["advantages"], kw["loss_mask"],
        **{k: v for k, v in kw.items() if k not in ("old_logprob", "advantages", "loss_mask")},
    )[0]  # fmt: skip


def test_bench_linear_policy_loss(benchmark, inputs):
    h, w, t, kw = inputs

    def ours():
        h.grad = w.grad = None
        linear_policy_loss(
            h, w, t, kw["old_logprob"], kw["advantages"], kw["loss_mask"],
            **{k: v for k, v in kw.items() if k not in ("old_logprob", "advantages", "loss_mask")},
        )[0].backward()  # fmt: skip

    def unfused():
        h.grad = w.grad = None
        _policy(linear_logprob(h, w, t), kw).backward()

    def naive():
        h.grad = w.grad = None
        lp = torch.log_softmax(h @ w.T, dim=-1).gather(1, t[:, None]).squeeze(1)
        _policy(lp, kw).backward()

    # same loss and gradient on these very inputs before timing anything
    grads = {}
    for name, fn in (("ours", ours), ("naive", naive)):
        fn()
        grads[name] = (h.grad.clone(), w.grad.clone())
    for a, c in zip(grads["ours"], grads["naive"]):
        torch.testing.assert_close(a, c, atol=1e-5 * float(c.abs().max()), rtol=1e-4)

    benchmark.pedantic(ours, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    t_ours = benchmark.stats.stats.median
    t_unfused = median_seconds(unfused, repeats=ROUNDS, warmup=1)
    t_naive = median_seconds(naive, repeats=ROUNDS, warmup=1)
    m_ours = peak_cpu_alloc_bytes(ours)
    op = "linear_policy_loss"
    peaks = (m_ours, peak_cpu_alloc_bytes(unfused))
    report_ratios(benchmark, op, SHAPE, "linear_logprob + policy_loss", (t_ours, t_unfused), peaks)
    peaks = (m_ours, peak_cpu_alloc_bytes(naive))
    baseline = "naive (full logits, log_softmax, gather, policy_loss)"
    info = report_ratios(benchmark, op, SHAPE, baseline, (t_ours, t_naive), peaks)
    assert info["mem_ratio"] <= 0.5, info
