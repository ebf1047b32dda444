"""policy_loss: the fused Triton kernel (CPU interpreter) and the torch fused path against the
autograd reference (``reference.policy_loss_torch``) over awkward packed batches."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from paravt_kernels import POLICY_STAT_NAMES, policy_loss  # noqa: E402
from paravt_kernels import reference as ref  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
IMPLS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton")),
]
# sequence lengths of the packed batch: single token, tiny, ragged, one long sequence
LENGTHS = [[1], [7], [3, 1, 79], [5, 1000, 2, 40]]
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


@pytest.fixture
def impl(request, monkeypatch):
    monkeypatch.setenv("PARAVT_IMPL", request.param)
    if request.param == "triton":  # the tests' tensors live on the CPU: interpret
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return request.param


def _batch(lengths, seed=0, mask_kind="random"):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    old = -torch.rand(n, generator=g) * 3
    b = {
        "logprob": old + 0.4 * torch.randn(n, generator=g),
        "old_logprob": old,
        "advantages": torch.randn(n, generator=g),
        "ref_logprob": old + 0.3 * torch.randn(n, generator=g),
        "prox_logprob": old + 0.2 * torch.randn(n, generator=g),
        "cu_seqlens": cu,
        "seq_weights": torch.rand(len(lengths), generator=g) + 0.1,
    }
    if mask_kind == "random":
        b["loss_mask"] = torch.rand(n, generator=g) > 0.3
    elif mask_kind == "float":
        b["loss_mask"] = torch.rand(n, generator=g)
    elif mask_kind == "first_seq_masked":  # a masked-out sequence must contribute nothing
        m = torch.ones(n, dtype=torch.bool)
        m[: lengths[0]] = False
        b["loss_mask"] = m
    return b


CONFIGS = [
    {},
    {"kl_coef": 0.05, "kl_type": "k1"},
    {"kl_coef": 0.05, "kl_type": "k2", "dual_clip": 3.0},
    {"kl_coef": 0.1, "kl_type": "k3", "clip_low": 0.1, "clip_high": 0.28, "dual_clip": 2.0},
    {"prox": True, "behav_cap": 1.1, "kl_coef": 0.01, "kl_type": "k3"},
    {"prox": True, "seq_weights": True, "dual_clip": 3.0},
]


def _run(fn_impl, b, cfg, agg):
    kw = {k: v for k, v in cfg.items() if k not in ("prox", "seq_weights")}
    if kw.get("kl_coef"):
        kw["ref_logprob"] = b["ref_logprob"]
    if cfg.get("prox"):
        kw["prox_logprob"] = b["prox_logprob"]
    if cfg.get("seq_weights"):
        kw["seq_weights"] = b["seq_weights"]
    lp = b["logprob"].clone().requires_grad_()
    loss, stats = fn_impl(lp, b["old_logprob"], b["advantages"], b["loss_mask"], agg=agg,
                          cu_seqlens=b["cu_seqlens"], **kw)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, stats


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda x: "-".join(map(str, x)))
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize(
    "cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "plain"
)
def test_matches_autograd_reference(impl, lengths, agg, cfg):
    b = _batch(lengths, seed=len(lengths) + len(cfg))
    loss, grad, stats = _run(policy_loss, b, cfg, agg)
    loss_r, grad_r, stats_r = _run(ref.policy_loss_torch, b, cfg, agg)
    torch.testing.assert_close(loss, loss_r, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, grad_r, atol=1e-7, rtol=1e-5)
    assert set(stats) == set(POLICY_STAT_NAMES)
    for k in POLICY_STAT_NAMES:
        assert stats[k].dim() == 0 and stats[k].dtype == torch.float32
        torch.testing.assert_close(stats[k], stats_r[k].float(), atol=1e-6, rtol=1e-5, msg=k)


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("agg", AGGS)
def test_masked_out_sequence_contributes_nothing(impl, agg):
    lengths = [6, 9, 4]
    b = _batch(lengths, seed=11, mask_kind="first_seq_masked")
    loss, grad, stats = _run(policy_loss, b, {"kl_coef": 0.1, "kl_type": "k3"}, agg)
    # the same loss as the batch without the masked sequence
    b2 = {k: (v[6:] if k not in ("cu_seqlens", "seq_weights") else v) for k, v in b.items()}
    b2["cu_seqlens"] = torch.tensor([0, 9, 13])
    loss2, _, _ = _run(policy_loss, b2, {"kl_coef": 0.1, "kl_type": "k3"}, agg)
    assert torch.isfinite(loss) and (grad[:6] == 0).all()
    torch.testing.assert_close(loss, loss2, atol=1e-6, rtol=1e-6)
    assert stats["n_masked"] == 6 and stats["n_tokens"] == 13


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_all_masked_gives_zero_not_nan(impl):
    b = _batch([4, 3], seed=2)
    b["loss_mask"] = torch.zeros(7, dtype=torch.bool)
    for agg in AGGS:
        loss, grad, stats = _run(policy_loss, b, {}, agg)
        assert loss == 0 and (grad == 0).all() and stats["n_tokens"] == 0 and stats["n_masked"] == 7
        assert all(torch.isfinite(v) for v in stats.values())


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_float_mask_and_counts(impl):
    b = _batch([10, 20, 5], seed=4, mask_kind="float")
    loss, grad, stats = _run(policy_loss, b, {"prox": True, "behav_cap": 1.05}, "token-mean")
    loss_r, grad_r, stats_r = _run(
        ref.policy_loss_torch, b, {"prox": True, "behav_cap": 1.05}, "token-mean"
    )
    torch.testing.assert_close(grad, grad_r, atol=1e-7, rtol=1e-5)
    w = torch.exp(b["prox_logprob"] - b["old_logprob"])
    n_capped = ((w > 1.05) & (b["loss_mask"] > 0)).sum().float()
    assert n_capped > 0, "test data must exercise the cap"
    assert stats["n_capped"] == n_capped
    # capped tokens are removed from the mask: no gradient flows through them
    assert (grad[(w > 1.05)] == 0).all()


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_clip_fractions_count_the_right_tokens(impl):
    """Hand-built tokens: one per clipping regime."""
    lp = torch.log(torch.tensor([1.5, 0.5, 5.0, 1.0, 1.5]))
    old = torch.zeros(5)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, -1.0])
    mask = torch.ones(5)
    loss, stats = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    # token 0: high clip (r=1.5>1.2, A>0); token 1: low clip (r=0.5<0.8, A<0);
    # token 2: dual clip (A<0, r=5>3); tokens 3, 4: unclipped
    assert stats["clip_frac_high"] == pytest.approx(1 / 5)
    assert stats["clip_frac_low"] == pytest.approx(1 / 5)
    assert stats["clip_frac_dual"] == pytest.approx(1 / 5)
    assert stats["clip_frac"] == pytest.approx(2 / 5)
    assert stats["ratio_max"] == pytest.approx(5.0) and stats["ratio_min"] == pytest.approx(0.5)
    # loss per token: -1.2, 0.8, 3.0 (dual bound), -1.0, 1.5
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 3.0 - 1.0 + 1.5) / 5, rel=1e-6)


def test_validation_errors():
    b = _batch([3, 4])
    args = (b["logprob"], b["old_logprob"], b["advantages"], b["loss_mask"])
    with pytest.raises(ValueError, match="needs cu_seqlens"):
        policy_loss(*args, agg="seq-mean-token-mean")
    with pytest.raises(ValueError, match="kl_coef=0.1 needs ref_logprob"):
        policy_loss(*args, kl_coef=0.1)
    with pytest.raises(ValueError, match="agg='mean' is not one of"):
        policy_loss(*args, agg="mean")
    with pytest.raises(ValueError, match="behav_cap=2.0 caps the behaviour weight"):
        policy_loss(*args, behav_cap=2.0)
    with pytest.raises(ValueError, match="dual_clip=0.5 must be > 1"):
        policy_loss(*args, dual_clip=0.5)
    with pytest.raises(ValueError, match="advantages has 6 elements but logprob has 7"):
        policy_loss(b["logprob"], b["old_logprob"], b["advantages"][:6], b["loss_mask"])


@pytest.mark.parametrize("agg", AGGS)
def test_torch_path_token_chunks_are_invisible(agg, monkeypatch):
    """The fused torch path walks tokens in chunks; chunk edges inside sequences change nothing."""
    monkeypatch.setenv("PARAVT_IMPL", "torch")
    monkeypatch.setattr(ref, "POLICY_TOKEN_CHUNK", 64)
    b = _batch([5, 1000, 2, 40], seed=21)
    cfg = {
        "prox": True,
        "behav_cap": 1.2,
        "kl_coef": 0.1,
        "kl_type": "k3",
        "dual_clip": 3.0,
        "seq_weights": True,
    }
    loss, grad, stats = _run(policy_loss, b, cfg, agg)
    loss_r, grad_r, stats_r = _run(ref.policy_loss_torch, b, cfg, agg)
    torch.testing.assert_close(loss, loss_r, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, grad_r, atol=1e-7, rtol=1e-5)
    for k in POLICY_STAT_NAMES:
        torch.testing.assert_close(stats[k], stats_r[k].float(), atol=1e-6, rtol=1e-5, msg=k)
