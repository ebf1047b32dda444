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
from paravt_kernels.profiling import policy_loss_step  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
IMPLS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton")),
]
# sequence lengths of the packed batch: single token, tiny, ragged, one long sequence
LENGTHS = [[1], [7], [3, 1, 79], [5, 1000, 2, 40]]
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


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
    monkeypatch.setattr(ref.OWNERS["POLICY_TOKEN_CHUNK"], "POLICY_TOKEN_CHUNK", 64)
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


# Values a masked token can carry in a real batch: an old log-prob of -1e4 (a pad), -inf from a
# reference that gave the token zero probability, NaN from an uninitialised pad.
# the interpreter computes the selected-away lanes in numpy, which warns about inf - inf
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
@pytest.mark.parametrize("prox", [False, True], ids=["old", "prox"])
def test_extreme_values_at_masked_tokens_change_nothing(impl, kl_type, prox):
    b = _batch([6, 9, 4], seed=13)
    b["loss_mask"] = torch.ones(19, dtype=torch.bool)
    b["loss_mask"][[1, 7, 15]] = False
    bad = {k: v.clone() for k, v in b.items()}
    bad["old_logprob"][1], bad["prox_logprob"][1], bad["advantages"][1] = -1e4, -1e4, -1.0
    bad["ref_logprob"][7] = float("-inf")
    for k in ("logprob", "old_logprob", "advantages", "ref_logprob", "prox_logprob"):
        bad[k][15] = float("nan")
    cfg = {"kl_coef": 0.1, "kl_type": kl_type, "dual_clip": 3.0, "prox": prox}
    if prox:
        cfg["behav_cap"] = 1.2
    for fn in (policy_loss, ref.policy_loss_torch):  # the fused op and the autograd oracle
        loss, grad, stats = _run(fn, bad, cfg, "seq-mean-token-mean")
        loss_c, grad_c, stats_c = _run(fn, b, cfg, "seq-mean-token-mean")
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), fn.__name__
        torch.testing.assert_close(loss, loss_c, atol=0, rtol=0)
        torch.testing.assert_close(grad, grad_c, atol=0, rtol=0)
        assert (grad[[1, 7, 15]] == 0).all()
        for k in POLICY_STAT_NAMES:
            torch.testing.assert_close(stats[k], stats_c[k], atol=0, rtol=0, msg=k)


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_log_ratio_is_clamped_before_exp(impl):
    """An unmasked token 1e4 nats off its old log-prob: ratio exp(20), not inf."""
    lp = torch.tensor([-1.0, -1.0, -0.5], requires_grad=True)
    old = torch.tensor([-1e4, -1.2, -0.5])
    adv = torch.tensor([-1.0, 1.0, 0.5])
    loss, stats = policy_loss(lp, old, adv, torch.ones(3))
    (grad,) = torch.autograd.grad(loss, lp)
    big = float(torch.exp(torch.tensor(ref.LOG_RATIO_CLAMP)))
    # token 0: -A r = exp(20); token 1: r = e^0.2 > 1.2, A > 0, clipped: -1.2; token 2: -0.5
    assert loss.item() == pytest.approx((big - 1.2 - 0.5) / 3, rel=1e-6)
    assert stats["ratio_max"].item() == pytest.approx(big, rel=1e-6)
    # the clamped token has no gradient (as torch.clamp), the others the usual one
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.0, -0.5 / 3]))
    loss_r, stats_r = ref.policy_loss_torch(lp, old, adv, torch.ones(3))
    (grad_r,) = torch.autograd.grad(loss_r, lp)
    torch.testing.assert_close(loss.detach(), loss_r.detach())
    torch.testing.assert_close(grad, grad_r)


def _verl_low_var_kl(lp, ref_lp):
    """verl ``kl_penalty(..., "low_var_kl")`` (core_algos.py), from its published code."""
    kl = torch.clamp(ref_lp - lp, min=-20, max=20)
    ratio = torch.exp(kl)
    kld = ratio - kl - 1
    return torch.clamp(kld, min=-10, max=10)


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_k3_is_clamped_to_ten_as_verl_low_var_kl(impl):
    """k3 is clamped to [-10, 10] as verl's low_var_kl: ref - lp = 5 (pi_ref/pi = e^5 ~ 148)
    gives 10, not e^5 - 6 ~ 142, and no gradient (torch.clamp's, as in verl); ref - lp = -12
    gives 10, not 11; inside the range (0.5, 2) the usual value and gradient 1 - e^(ref-lp).
    Advantages are 0 and the ratio 1: the loss is the KL term alone. Checked on the op (this
    path), the autograd oracle and ``kl_penalty`` (also the reward-mode KL)."""
    lp = torch.tensor([-6.0, -0.5, -2.0, -3.0])
    ref_lp = lp + torch.tensor([5.0, -12.0, 0.5, 2.0])
    kl_want = _verl_low_var_kl(lp, ref_lp)
    assert kl_want[0] == 10.0 and kl_want[1] == 10.0  # the case this test is about
    lp_t = lp.clone().requires_grad_()
    (g_want,) = torch.autograd.grad(0.1 * _verl_low_var_kl(lp_t, ref_lp).mean(), lp_t)
    assert g_want[0] == 0.0 and g_want[1] == 0.0
    torch.testing.assert_close(ref.kl_penalty(lp, ref_lp, "k3"), kl_want)
    for fn in (policy_loss, ref.policy_loss_torch):
        x = lp.clone().requires_grad_()
        loss, stats = fn(x, lp, torch.zeros(4), torch.ones(4), ref_logprob=ref_lp,
                         kl_coef=0.1, kl_type="k3")  # fmt: skip
        (grad,) = torch.autograd.grad(loss, x)
        torch.testing.assert_close(loss.detach(), 0.1 * kl_want.mean(), msg=fn.__name__)
        torch.testing.assert_close(stats["kl_mean"], kl_want.mean(), msg=fn.__name__)
        torch.testing.assert_close(grad, g_want, msg=fn.__name__)


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("agg", AGGS)
def test_rows_outside_cu_seqlens_get_zero_gradient(impl, agg):
    """A fixed-size buffer: 2 rows before cu[0] and 5 after cu[-1] hold NaN and mask 1; they
    belong to no sequence: zero gradient, and loss and stats as without them."""
    b = _batch([6, 9, 4], seed=17)
    padded = {}
    for k, v in b.items():
        if k == "cu_seqlens":
            padded[k] = v + 2
        elif k == "seq_weights":
            padded[k] = v
        elif k == "loss_mask":
            padded[k] = torch.cat([torch.ones(2, dtype=v.dtype), v, torch.ones(5, dtype=v.dtype)])
        else:
            padded[k] = torch.cat([torch.full((2,), float("nan")), v, torch.full((5,), -1e4)])
    cfg = {"prox": True, "behav_cap": 1.2, "kl_coef": 0.1, "kl_type": "k3", "seq_weights": True}
    loss, grad, stats = _run(policy_loss, b, cfg, agg)
    for _ in range(3):  # freed buffers of the gradient's size, full of NaN, for torch.empty
        junk = torch.full((26,), float("nan"))
        del junk
        loss_p, grad_p, stats_p = _run(policy_loss, padded, cfg, agg)
        assert (grad_p[:2] == 0).all() and (grad_p[-5:] == 0).all(), grad_p
        # equal up to summation order (the padding shifts the rows within the blocks)
        torch.testing.assert_close(grad_p[2:-5], grad, atol=1e-7, rtol=1e-5)
        torch.testing.assert_close(loss_p, loss, atol=1e-6, rtol=1e-5)
        for k in POLICY_STAT_NAMES:
            torch.testing.assert_close(stats_p[k], stats[k], atol=1e-6, rtol=1e-5, msg=k)


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_cu_seqlens_is_one_sequence(impl, dtype):
    """cu_seqlens=None (no [0, N] tensor is built) gives what cu_seqlens=[0, N] gives; the
    backward scales by the incoming gradient, writes the log-prob dtype and can run twice."""
    b = _batch([83], seed=19)
    b["logprob"] = b["logprob"].to(dtype)
    cfg = {"prox": True, "behav_cap": 1.2, "kl_coef": 0.1, "kl_type": "k2", "dual_clip": 3.0}
    loss, grad, stats = _run(policy_loss, b, cfg, "token-mean")
    loss_n, grad_n, stats_n = _run(policy_loss, dict(b, cu_seqlens=None), cfg, "token-mean")
    assert grad_n.dtype == dtype
    # equal up to summation order (one running sum vs per-sequence partial sums)
    torch.testing.assert_close(loss_n, loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad_n.float(), grad.float(), atol=1e-7, rtol=1e-5)
    for k in POLICY_STAT_NAMES:
        torch.testing.assert_close(stats_n[k], stats[k], atol=1e-6, rtol=1e-5, msg=k)
    lp = b["logprob"].clone().requires_grad_()
    kw = {"ref_logprob": b["ref_logprob"], "prox_logprob": b["prox_logprob"]}
    kw.update({k: v for k, v in cfg.items() if k != "prox"})
    out, _ = policy_loss(lp, b["old_logprob"], b["advantages"], b["loss_mask"], **kw)
    (g3,) = torch.autograd.grad(3.0 * out, lp, retain_graph=True)
    (g1,) = torch.autograd.grad(out, lp)
    torch.testing.assert_close(g1, grad_n, atol=0, rtol=0)
    torch.testing.assert_close(g3, (3.0 * grad_n.float()).to(dtype))


def _bench_batch(n=1000, lengths=(300, 1, 299, 400), lp_dtype=torch.float32):
    """The bench's configuration (k3 KL, decoupled, behaviour cap, seq-mean-token-mean) on a
    small packed batch with a one-token sequence."""
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(n, generator=g) * 3
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return {
        "lp": (old + 0.1 * torch.randn(n, generator=g)).to(lp_dtype).requires_grad_(),
        "old": old,
        "adv": torch.randn(n, generator=g),
        "mask": (torch.rand(n, generator=g) > 0.1).float(),
        "ref": old + 0.05 * torch.randn(n, generator=g),
        "prox": old + 0.05 * torch.randn(n, generator=g),
        "cu": cu,
    }


@pytest.mark.parametrize("impl", ["triton"], indirect=True)
@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
def test_at_most_four_launches_per_call(impl):
    """Forward + backward of one call: the forward kernel, the finalize kernel (partials ->
    coefficients, loss, stats) and the backward kernel, and no torch kernel (the code before
    measured 2 Triton launches + 36 torch ops with this counter)."""
    from paravt_kernels.profiling import count_launches

    b = _bench_batch()
    step = policy_loss_step(b, torch.ones(()))
    step()  # warm-up: first-call work (lazy jit) is not per-call
    c = count_launches(step)
    assert c.triton == [
        "_policy_loss_fwd_kernel",
        "_policy_loss_finalize_kernel",
        "_policy_loss_grad_kernel",
    ], c
    assert c.torch_ops == [], c.torch_ops
    assert c.total <= 4
    # without cu_seqlens (one sequence) too
    lp, one = b["lp"], torch.ones(())

    def no_cu():
        loss, _ = policy_loss(lp, b["old"], b["adv"], b["mask"], kl_coef=0.0)
        torch.autograd.grad(loss, lp, grad_outputs=one)

    c = count_launches(no_cu)
    assert len(c.triton) == 3 and c.torch_ops == [], c


def test_launch_counter_counts_torch_ops_and_triton_launches():
    """The counter is a measurement: it sees the torch ops a function runs (views and
    allocations excluded) and nothing else."""
    from paravt_kernels.profiling import count_launches

    a, b = torch.randn(8), torch.randn(8)

    def fn():
        c = a + b
        c = c.view(2, 4)[1:]  # views: no kernel
        torch.empty(3)  # allocation: no kernel
        return (c * 2).sum()

    got = count_launches(fn)
    assert got.triton == []
    assert sorted(got.torch_ops) == ["aten::add", "aten::mul", "aten::sum"], got.torch_ops


@pytest.mark.parametrize("impl", ["triton"], indirect=True)
@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
@pytest.mark.parametrize("lp_dtype", [torch.float32, torch.bfloat16])
def test_byte_model_matches_the_launched_streams(impl, lp_dtype):
    """bytes/token of the model = the bytes of the per-token tensors the three launches take
    (fp32 with ref + prox: 36, not the 44 the bench counted); bf16 log-probs: 32."""
    from paravt_kernels.options import PolicyTokens
    from paravt_kernels.policy_loss_triton import policy_loss_bytes
    from paravt_kernels.profiling import count_launches

    n = 1000
    b = _bench_batch(n, lp_dtype=lp_dtype)
    c = count_launches(policy_loss_step(b, torch.ones(())))
    tok = PolicyTokens(b["old"], b["adv"], b["mask"], b["ref"], b["prox"])
    per_token, fixed = policy_loss_bytes(b["lp"], tok, b["cu"], None)
    assert per_token == (36 if lp_dtype == torch.float32 else 32)
    assert c.tensor_bytes(n) == per_token * n
    assert 0 < fixed < 1000  # O(B): 4 sequences


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_one_token_sequences_with_nan_at_masked_rows(impl):
    """Many one-token sequences (and empty ones) with -inf / NaN inputs at masked rows: same
    loss, gradient and stats as the autograd reference on the finite batch."""
    lengths = [1, 1, 0, 1, 5, 1, 0, 1]
    for agg in AGGS:
        b = _batch(lengths, seed=23)
        m = torch.tensor([True, False, True, False, True, True, False, True, False, True])
        b["loss_mask"] = m
        cfg = {"prox": True, "kl_coef": 0.1, "kl_type": "k3", "dual_clip": 3.0}
        loss_r, grad_r, stats_r = _run(ref.policy_loss_torch, b, cfg, agg)
        dirty = dict(b)
        for k, v in (("logprob", float("nan")), ("old_logprob", float("-inf")),
                     ("ref_logprob", float("nan")), ("prox_logprob", float("inf"))):  # fmt: skip
            dirty[k] = torch.where(m, b[k], v)
        loss, grad, stats = _run(policy_loss, dirty, cfg, agg)
        torch.testing.assert_close(loss, loss_r, atol=1e-6, rtol=1e-5)
        assert (grad[~m] == 0).all()
        torch.testing.assert_close(grad, grad_r, atol=1e-7, rtol=1e-5)
        for k in POLICY_STAT_NAMES:
            torch.testing.assert_close(stats[k], stats_r[k].float(), atol=1e-6, rtol=1e-5,
                                       msg=k)  # fmt: skip


@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
def test_kernels_compile_for_sm90_registers_and_no_spills():
    """The GPU launch configurations, compiled for sm_90 by Triton's ptxas on this CPU
    machine (one child process): the policy_loss forward kernel at 512 tokens over 8 warps
    uses <= 64 registers per thread without spills, so 4 programs (32 warps) fit on an SM
    (the 1024-token, 4-warp block of before: 210 registers, 2 programs); the finalize kernel
    compiles (it read non-constexpr globals, which only a compile rejects) without spilling
    (400 bytes at 1024 sequences a step); so does ``linear_logprob``'s backward tile kernel
    with the dead-row select."""
    from paravt_kernels import linear_logprob_triton as llt
    from paravt_kernels import policy_loss_triton as pl
    from paravt_kernels.profiling import sm90_registers

    fwd_t = {n: "*fp32" for n in ("lp_ptr", "old_ptr", "adv_ptr", "mask_ptr", "ref_ptr",
                                   "prox_ptr", "gbuf_ptr", "part_ptr")}  # fmt: skip
    fwd_t.update(cu_ptr="*i64", n_slots="i64", n_seq="i64", n_total="i64")
    for f in ("clip_low", "clip_high", "dual_clip", "behav_cap", "kl_coef", "k3_clamp",
              "k3_kl_clamp", "lr_clamp"):  # fmt: skip
        fwd_t[f] = "fp32"
    fwd_c = {"SPLIT": 1, "BLOCK": pl._GPU_BLOCK, "HAS_CU": True, "HAS_REF": True,
             "HAS_PROX": True, "HAS_DUAL": True, "HAS_CAP": True, "KL_TYPE": 3}  # fmt: skip
    fin_t = {n: "*fp32" for n in ("part_ptr", "w_ptr", "coef_ptr", "loss_ptr", "stats_ptr")}
    fin_t.update(n_seq="i32", n_slots="i32")
    fin_c = {"SPLIT": 2, "SPLIT_P2": 2, "BLOCK_S": pl._fin_block(4096, 2), "HAS_W": True,
             "AGG": 1}  # fmt: skip
    bwd_t = {n: "*fp32" for n in ("z_ptr", "bias_ptr", "lse_ptr", "g_ptr", "k_ptr", "ent_ptr",
                                  "invt_ptr")}  # fmt: skip
    bwd_t.update(dz_ptr="*bf16", tgt_ptr="*i64", void_ptr="*u8", stride_z="i64",
                 stride_dz="i64", n_rows="i32", n_cols="i32", v0="i32", inv_t="fp32")  # fmt: skip
    bwd_c = {"HAS_BIAS": False, "ENTROPY": True, "ROW_T": False, "HAS_VOID": True,
             **{k: llt._GPU_BWD[k] for k in ("BLOCK_M", "BLOCK_N")}}  # fmt: skip
    try:
        fwd, fin, bwd = sm90_registers([
            (pl._policy_loss_fwd_kernel, fwd_t, fwd_c, pl._FWD_WARPS),
            (pl._policy_loss_finalize_kernel, fin_t, fin_c, 4),
            (llt._llp_bwd_tile_kernel, bwd_t, bwd_c, llt._GPU_BWD["num_warps"]),
        ])  # fmt: skip
    except RuntimeError as e:
        if "ships no NVIDIA tools" in str(e):
            pytest.skip(str(e))
        raise
    assert fwd["registers"] <= 64 and fwd["local_bytes"] == fwd["stack_bytes"] == 0, fwd
    assert 65536 // (fwd["registers"] * 32 * pl._FWD_WARPS) >= 4
    for r in (fin, bwd):
        assert r["local_bytes"] == 0 and r["stack_bytes"] == 0, r
