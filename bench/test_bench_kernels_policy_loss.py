"""CPU benchmark: ``group_advantage`` + ``policy_loss`` (fwd+bwd) vs a per-sample Python loop.

The baseline is the formulation of verl's GRPO path: group scores collected in a Python dict
sample by sample, mean/std per group, a loop normalising each sample, then the clipped PPO
loss + k3 KL computed sequence by sequence (seq-mean-token-mean) with ``.item()`` metrics.
Shape: 1024 sequences x 512 tokens (groups of 8). Reports ``time_ratio`` (ours / loop).

    pytest bench/test_bench_kernels_policy_loss.py --benchmark-only -s
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from paravt_kernels import broadcast_to_tokens, group_advantage, policy_loss
from paravt_kernels.profiling import median_seconds

B, L, G = 1024, 512, 8


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(0)
    n = B * L
    old = -torch.rand(n, generator=g) * 3
    return {
        "rewards": torch.rand(B, generator=g).round(),
        "index": torch.arange(B) // G,
        "lp": old + 0.2 * torch.randn(n, generator=g),
        "old": old,
        "ref": old + 0.1 * torch.randn(n, generator=g),
        "mask": (torch.rand(n, generator=g) > 0.2).float(),
        "cu": torch.arange(0, n + 1, L),
    }


def loop_baseline(b):
    """verl-style: Python loops over samples, per-sample tensors, host syncs for metrics."""
    scores = b["rewards"]
    id2score = defaultdict(list)
    for i in range(B):
        id2score[int(b["index"][i])].append(scores[i])
    id2mean, id2std = {}, {}
    for idx, vals in id2score.items():
        t = torch.stack(vals)
        id2mean[idx], id2std[idx] = t.mean(), t.std()
    adv = torch.empty(B)
    for i in range(B):
        k = int(b["index"][i])
        adv[i] = (scores[i] - id2mean[k]) / (id2std[k] + 1e-6)
    lp_all = b["lp"].detach().requires_grad_()
    losses, clipfracs = [], []
    for i in range(B):
        sl = slice(i * L, (i + 1) * L)
        lp, old, ref, m = lp_all[sl], b["old"][sl], b["ref"][sl], b["mask"][sl]
        ratio = torch.exp(lp - old)
        pg = torch.maximum(-adv[i] * ratio, -adv[i] * ratio.clamp(0.8, 1.2))
        d = ref - lp
        kl = torch.exp(d) - d - 1
        tok = pg + 0.01 * kl
        losses.append((tok * m).sum() / m.sum())
        clipfracs.append((((ratio - 1).abs() > 0.2).float() * m).sum().item() / m.sum().item())
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.detach(), lp_all.grad


def ours(b):
    adv = group_advantage(b["rewards"], b["index"])
    adv_tok = broadcast_to_tokens(adv, b["cu"], total_tokens=B * L)
    lp = b["lp"].detach().requires_grad_()
    loss, stats = policy_loss(lp, b["old"], adv_tok, b["mask"], ref_logprob=b["ref"], kl_coef=0.01,
                              kl_type="k3", agg="seq-mean-token-mean", cu_seqlens=b["cu"])  # fmt: skip
    loss.backward()
    return loss.detach(), lp.grad


def test_bench_advantage_and_policy_loss_vs_loop(benchmark, batch):
    loss_b, grad_b = loop_baseline(batch)
    loss_o, grad_o = ours(batch)
    torch.testing.assert_close(loss_o, loss_b, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grad_o, grad_b, atol=1e-8, rtol=1e-4)

    benchmark.pedantic(lambda: ours(batch), rounds=5, iterations=1, warmup_rounds=1)
    t_ours = benchmark.stats.stats.median
    t_loop = median_seconds(lambda: loop_baseline(batch), repeats=3, warmup=0)
    info = {"shape": f"{B} seqs x {L} tokens, groups of {G}", "ours_s": t_ours,
            "loop_s": t_loop, "time_ratio": t_ours / t_loop}  # fmt: skip
    benchmark.extra_info.update(info)
    print(f"\ngroup_advantage+policy_loss vs per-sample loop: {info}")


def test_bench_policy_loss_op_registration_host_cost(benchmark):
    """Host cost of the ``torch.library`` op around ``policy_loss``: the registered op on
    meta tensors (its fake kernel: a few allocations) vs calling that function directly,
    same run, with and without autograd: the registration's own cost per call, in
    microseconds and as a ratio. The CPU torch path's own work (~100 small ops) is too noisy
    on a shared machine to show a difference of this size; the GPU script measures it with
    the Triton path (``bench/gpu_kernels.py``)."""
    from paravt_kernels.profiling import policy_loss_op_host_cost

    info = benchmark.pedantic(lambda: policy_loss_op_host_cost("meta"), rounds=1, iterations=1)
    benchmark.extra_info.update(info)
    print("\npolicy_loss op registration host cost (meta: fake kernel vs direct call):", info)
    assert info["extra_us"] > 0 and info["extra_grad_us"] > 0, info
