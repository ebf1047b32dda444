"""linear_policy_loss: the torch path against autograd of the naive formula (full logits,
log_softmax / T, gather, then ``reference.policy_loss_torch``), and the Triton path (CPU
interpreter) against the torch path at awkward shapes, masks, aggregation modes and dtypes."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from paravt_kernels import (  # noqa: E402
    LINEAR_POLICY_STAT_NAMES,
    linear_logprob,
    linear_policy_loss,
    ops,
    policy_loss,
)
from paravt_kernels import reference as ref  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
IMPLS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton"))]  # fmt: skip


# Configurations of the policy loss; "lengths" are the cu_seqlens sequences (0 = an empty one,
# as the trainer produces when it gathers only the trained rows of each sequence).
CONFIGS = {
    "ppo-token-mean": {},
    "k1-dual-seqmean": {"kl_coef": 0.05, "kl_type": "k1", "dual_clip": 3.0,
                        "agg": "seq-mean-token-mean", "bias": True},
    "decoupled-k3-seqsum-weights": {"prox": True, "behav_cap": 1.1, "kl_coef": 0.1,
                                    "kl_type": "k3", "agg": "seq-mean-token-sum",
                                    "seq_weights": True, "clip_high": 0.28},
    "k2-rowtemp-floatmask-empty-seqs": {"kl_coef": 0.02, "kl_type": "k2", "row_temp": True,
                                        "mask": "float", "agg": "token-mean", "cu": True,
                                        "bias": True, "dual_clip": 2.0},
}  # fmt: skip


def _lengths(n: int) -> list[int]:
    """A ragged split of n rows with empty sequences at the start, middle and end."""
    if n == 0:
        return [0, 0]
    a = max(1, n // 3)
    return [0, a, 0, n - a, 0]


def _case(n, d, v, dtype=torch.float32, seed=0, cfg=None, temperature=0.7):
    cfg = dict(cfg or {})
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, d, generator=g) * 0.5).to(dtype)
    w = (torch.randn(v, d, generator=g) * 0.5).to(dtype)
    b = torch.randn(v, generator=g).to(dtype) if cfg.pop("bias", False) else None
    t = torch.randint(0, v, (n,), generator=g)
    # old log-probs near the current ones (so that some ratios clip and some do not)
    with torch.no_grad():
        z = h.double() @ w.double().T + (0 if b is None else b.double())
        lp0 = torch.log_softmax(z / temperature, -1).gather(1, t[:, None]).squeeze(1).float()
    old = lp0 + 0.3 * torch.randn(n, generator=g)
    kw = {
        "old_logprob": old,
        "advantages": torch.randn(n, generator=g),
        "temperature": temperature,
    }
    mask_kind = cfg.pop("mask", "bool")
    kw["loss_mask"] = (
        torch.rand(n, generator=g) > 0.25 if mask_kind == "bool" else torch.rand(n, generator=g)
    )
    if cfg.pop("row_temp", False):
        kw["temperature"] = 0.5 + torch.rand(n, generator=g)
    if cfg.get("kl_coef"):
        kw["ref_logprob"] = lp0 + 0.2 * torch.randn(n, generator=g)
    if cfg.pop("prox", False):
        kw["prox_logprob"] = old + 0.1 * torch.randn(n, generator=g)
    agg = cfg.get("agg", "token-mean")
    if cfg.pop("cu", False) or agg != "token-mean" or cfg.get("seq_weights"):
        lengths = _lengths(n)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        cu[1:] = torch.tensor(lengths).cumsum(0)
        kw["cu_seqlens"] = cu
    if cfg.pop("seq_weights", False):
        kw["seq_weights"] = torch.rand(len(kw["cu_seqlens"]) - 1, generator=g) + 0.1
    kw.update(cfg)
    return h, w, b, t, kw


def _final_on(kw, n):
    """The final mask (capped tokens and rows outside cu_seqlens removed), as weights."""
    m = kw["loss_mask"].float()
    if kw.get("behav_cap") is not None:
        behav = torch.exp((kw["prox_logprob"] - kw["old_logprob"]).clamp(-20, 20))
        m = torch.where((behav > kw["behav_cap"]) & (m > 0), 0.0, m)
    return torch.where(ref.covered_tokens(kw.get("cu_seqlens"), n, m.device), m, 0.0)


def _naive(h, w, b, t, kw, leaves_dtype=None):
    """Autograd of the naive formula: ``(loss, stats, logprob, entropy, grads)``."""
    leaves = [x.clone().requires_grad_() for x in (h, w) + ((b,) if b is not None else ())]
    hh, ww = leaves[0], leaves[1]
    z = (hh @ ww.T + (leaves[2] if b is not None else 0)).float()
    temp = kw["temperature"]
    temp = temp[:, None] if isinstance(temp, torch.Tensor) else temp
    lsm = torch.log_softmax(z / temp, dim=-1)
    lp = lsm.gather(1, t[:, None]).squeeze(1)
    ent = -(lsm.exp() * lsm).sum(-1)
    pk = {k: v for k, v in kw.items() if k not in ("old_logprob", "advantages", "loss_mask",
                                                   "temperature")}  # fmt: skip
    loss, stats = ref.policy_loss_torch(
        lp, kw["old_logprob"], kw["advantages"], kw["loss_mask"], **pk
    )
    m = _final_on(kw, h.shape[0])
    n_tok = m.sum()
    stats["entropy"] = torch.where(m > 0, m * ent.detach(), 0.0).sum() / n_tok.clamp_min(1e-30)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True) if h.shape[0] else None
    return loss.detach(), stats, lp.detach(), ent.detach(), grads


def _ours(h, w, b, t, kw):
    leaves = [x.clone().requires_grad_() for x in (h, w) + ((b,) if b is not None else ())]
    loss, stats, lp, ent = linear_policy_loss(
        leaves[0], leaves[1], t, bias=leaves[2] if b is not None else None, **kw
    )
    grads = torch.autograd.grad(loss, leaves)
    return loss.detach(), stats, lp, ent, grads


def _close(got, want, rtol=1e-5, what="", floor=1e-3):
    """Relative tolerance ``rtol`` of the largest magnitude (at least ``floor``)."""
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * max(scale, floor), msg=what)


SHAPES = [(1, 59, 133), (7, 111, 300), (83, 256, 257), (1031, 59, 101)]


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_torch_path_matches_naive_autograd(cfg, shape, monkeypatch):
    monkeypatch.setenv("PARAVT_IMPL", "torch")
    n, d, v = shape
    h, w, b, t, kw = _case(n, d, v, cfg=CONFIGS[cfg], seed=n)
    loss, stats, lp, ent, grads = _ours(h, w, b, t, kw)
    loss0, stats0, lp0, ent0, grads0 = _naive(h, w, b, t, kw)
    assert set(stats) == set(LINEAR_POLICY_STAT_NAMES)
    assert not lp.requires_grad and not ent.requires_grad and lp.dtype == torch.float32
    _close(loss, loss0, what="loss")
    _close(lp, lp0, what="logprob")
    _close(ent, ent0, what="entropy")
    for k in LINEAR_POLICY_STAT_NAMES:
        # stats such as a k1 mean are differences of log-probs of magnitude ~5: their
        # rounding error scales with the log-probs, not with the (small) result
        _close(stats[k], stats0[k].float(), what=k, floor=10.0)
    for name, got, want in zip(("hidden", "weight", "bias"), grads, grads0):
        _close(got, want, what=name)


# Triton (interpreter) vs the torch path: each shape paired with configurations so that every
# config meets a small and a large shape without the full cross product (interpreter time).
TRITON_CASES = [
    ((1, 59, 133), "ppo-token-mean"),
    ((1, 59, 133), "k2-rowtemp-floatmask-empty-seqs"),
    ((7, 111, 300), "k1-dual-seqmean"),
    ((7, 111, 300), "decoupled-k3-seqsum-weights"),
    ((83, 256, 257), "k2-rowtemp-floatmask-empty-seqs"),
    ((83, 256, 257), "decoupled-k3-seqsum-weights"),
    ((1031, 59, 101), "k1-dual-seqmean"),
    ((1031, 59, 101), "ppo-token-mean"),
]


@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
@pytest.mark.parametrize("shape,cfg", TRITON_CASES, ids=lambda x: x if isinstance(x, str) else "x".join(map(str, x)))  # fmt: skip
def test_triton_matches_torch_path_fp32(shape, cfg, monkeypatch):
    n, d, v = shape
    h, w, b, t, kw = _case(n, d, v, cfg=CONFIGS[cfg], seed=n + 1)
    monkeypatch.setenv("PARAVT_IMPL", "torch")
    want = _ours(h, w, b, t, kw)
    monkeypatch.setenv("PARAVT_IMPL", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got = _ours(h, w, b, t, kw)
    assert "paravt_kernels.linear_policy_loss_triton" in sys.modules  # the Triton path ran
    for name, a, c in zip(("loss", "stats", "logprob", "entropy"), got[:4], want[:4]):
        if name == "stats":
            for k in LINEAR_POLICY_STAT_NAMES:
                _close(a[k], c[k], rtol=2e-5, what=k, floor=10.0)
        else:
            _close(a, c, rtol=2e-5, what=name)
    for name, a, c in zip(("hidden", "weight", "bias"), got[4], want[4]):
        _close(a, c, rtol=2e-5, what=name)


def _err(x, exact):
    return float((x.double() - exact.double()).abs().max())


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_bf16_error_within_twice_naive_bf16(impl, monkeypatch):
    """bf16 operands: error vs the fp32-exact reference (the torch path on the same values
    upcast to fp32) at most 2x that of the naive bf16 torch computation (bf16 matmul, softmax
    in fp32), for logprob, entropy, loss and the hidden/weight/bias gradients."""
    n, d, v = 83, 111, 300
    h, w, b, t, kw = _case(n, d, v, torch.bfloat16, seed=3, cfg=CONFIGS["k1-dual-seqmean"])
    loss, _, lp, ent, grads = _ours(h, w, b, t, kw)
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3
    monkeypatch.setenv("PARAVT_IMPL", "torch")
    exact = _ours(h.float(), w.float(), b.float(), t, kw)
    same = _naive(h, w, b, t, kw)  # bf16 leaves: the matmul and its gradients run in bf16
    for name, a, e, s in (
        ("loss", loss, exact[0], same[0]),
        ("logprob", lp, exact[2], same[2]),
        ("entropy", ent, exact[3], same[3]),
    ):
        assert _err(a, e) <= 2 * max(_err(s, e), 1e-7), (name, _err(a, e), _err(s, e))
    for name, a, e, s in zip(("hidden", "weight", "bias"), grads, exact[4], same[4]):
        assert _err(a, e) <= 2 * _err(s, e), (name, _err(a, e), _err(s, e))


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("agg", ref.AGG_MODES)
def test_masked_nan_inf_olds_change_nothing_and_empty_sequences(impl, agg):
    """Masked rows may hold -inf/NaN old/ref/prox log-probs: the loss, stats and gradients
    equal those with finite stand-ins; empty sequences contribute nothing."""
    n, d, v = 13, 59, 133
    h, w, b, t, kw = _case(n, d, v, seed=5, cfg={"prox": True, "behav_cap": 2.0, "kl_coef": 0.1,
                                                  "agg": agg, "cu": True})  # fmt: skip
    kw["loss_mask"][[0, 5, 12]] = False
    clean = _ours(h, w, b, t, kw)
    dirty_kw = {k: (x.clone() if isinstance(x, torch.Tensor) else x) for k, x in kw.items()}
    dirty_kw["old_logprob"][[0, 5]] = float("-inf")
    dirty_kw["old_logprob"][12] = float("nan")
    dirty_kw["ref_logprob"][[0, 12]] = float("nan")
    dirty_kw["prox_logprob"][5] = float("inf")
    dirty_kw["advantages"][0] = float("nan")
    dirty = _ours(h, w, b, t, dirty_kw)
    assert torch.isfinite(dirty[0])
    for k in LINEAR_POLICY_STAT_NAMES:
        torch.testing.assert_close(dirty[1][k], clean[1][k], msg=k)
    for name, a, c in zip(("hidden", "weight"), dirty[4], clean[4]):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, c, msg=name)


def _pair(h, w, b, t, kw):
    """The unfused pair ``linear_logprob`` + ``policy_loss``, returned like ``_ours`` (no
    entropy)."""
    leaves = [x.clone().requires_grad_() for x in (h, w) + ((b,) if b is not None else ())]
    lp = linear_logprob(leaves[0], leaves[1], t, temperature=kw["temperature"],
                        bias=leaves[2] if b is not None else None)  # fmt: skip
    pk = {k: x for k, x in kw.items() if k != "temperature"}
    loss, stats = policy_loss(
        lp, pk.pop("old_logprob"), pk.pop("advantages"), pk.pop("loss_mask"), **pk
    )
    grads = torch.autograd.grad(loss, leaves)
    return loss.detach(), stats, lp.detach(), None, grads


# the interpreter computes the forward of the NaN rows in numpy, which warns
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("path", ["fused", "fused-chunks-of-5", "pair"])
def test_nonfinite_hidden_at_masked_rows_contributes_nothing(impl, path, monkeypatch):
    """A masked row's hidden state may be NaN/inf (e.g. a pad position whose bf16 activations
    overflowed). It must contribute exactly nothing: loss, stats, the other rows' log-probs
    and every gradient equal those with the row replaced by zeros, and its own dH is 0 (it
    was: 0 * NaN = NaN in the dW GEMM made every row of the weight gradient NaN). Its
    log-prob stays non-finite (no made-up value), and an UNmasked non-finite row still gives
    a non-finite loss (nothing is hidden from the trainer's guard)."""
    n, d, v = 13, 59, 133
    if path == "fused-chunks-of-5":
        _budget_rows(monkeypatch, 5, v)
    cfg = {"kl_coef": 0.1, "kl_type": "k3", "dual_clip": 3.0, "agg": "seq-mean-token-mean",
           "bias": True}  # fmt: skip
    h, w, b, t, kw = _case(n, d, v, seed=12, cfg=cfg, temperature=0.7)
    masked = [0, 6, 12]
    kw["loss_mask"] = torch.ones(n, dtype=torch.bool)
    kw["loss_mask"][masked] = False
    zeroed, dirty = h.clone(), h.clone()
    zeroed[masked] = 0.0
    dirty[0] = float("nan")
    dirty[6, 3] = float("inf")
    dirty[12, 1], dirty[12, 40] = float("-inf"), float("nan")
    run = _pair if path == "pair" else _ours
    want = run(zeroed, w, b, t, kw)
    got = run(dirty, w, b, t, kw)
    assert torch.isfinite(got[0]), "loss"
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)
    for k, x in want[1].items():
        torch.testing.assert_close(got[1][k], x, atol=0, rtol=0, msg=k)
    kept = torch.ones(n, dtype=torch.bool)
    kept[masked] = False
    torch.testing.assert_close(got[2][kept], want[2][kept], atol=0, rtol=0)
    assert not torch.isfinite(got[2][masked]).any(), "log-prob of a non-finite hidden row"
    for name, a, c in zip(("hidden", "weight", "bias"), got[4], want[4]):
        assert torch.isfinite(a).all(), f"non-finite {name} gradient"
        torch.testing.assert_close(a, c, atol=0, rtol=0, msg=name)
    assert (got[4][0][masked] == 0).all(), "dH of the masked rows"
    kw["loss_mask"][0] = True  # the NaN row is trained: the loss must show it
    assert not torch.isfinite(run(dirty, w, b, t, kw)[0])


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_all_masked_and_zero_rows(impl):
    h, w, b, t, kw = _case(7, 59, 133, seed=6, cfg={"agg": "seq-mean-token-mean", "bias": True})
    kw["loss_mask"] = torch.zeros(7, dtype=torch.bool)
    loss, stats, lp, ent, grads = _ours(h, w, b, t, kw)
    assert float(loss) == 0.0 and float(stats["entropy"]) == 0.0
    assert float(stats["n_tokens"]) == 0.0 and float(stats["n_masked"]) == 7.0
    assert all(float(g.abs().max()) == 0.0 for g in grads)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    # n = 0 rows, with empty sequences in cu_seqlens
    h0, w0, b0, t0, kw0 = _case(0, 59, 133, seed=7, cfg={"agg": "seq-mean-token-sum",
                                                         "bias": True})  # fmt: skip
    loss, stats, lp, ent, grads = _ours(h0, w0, b0, t0, kw0)
    assert float(loss) == 0.0 and lp.shape == (0,) and ent.shape == (0,)
    assert all(torch.isfinite(s) for s in stats.values())
    assert grads[0].shape == (0, 59) and float(grads[1].abs().max()) == 0.0
    assert float(grads[2].abs().max()) == 0.0


def test_backward_scales_saved_gradients(monkeypatch):
    monkeypatch.setenv("PARAVT_IMPL", "torch")
    h, w, b, t, kw = _case(9, 16, 50, seed=8, cfg={"bias": True, "kl_coef": 0.1})
    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    loss, _, _, _ = linear_policy_loss(leaves[0], leaves[1], t, bias=leaves[2], **kw)
    g1 = torch.autograd.grad(loss, leaves, retain_graph=True)
    g3 = torch.autograd.grad(loss * 3, leaves, retain_graph=True)
    for a, c in zip(g1, g3):
        torch.testing.assert_close(c, 3 * a)
    (loss * 3).backward(retain_graph=True)
    loss.backward()  # accumulates: 4x
    for leaf, a in zip(leaves, g1):
        torch.testing.assert_close(leaf.grad, 4 * a)
    # a loss that does not reach hidden (weight only) still works
    w2 = w.clone().requires_grad_()
    loss2, _, _, _ = linear_policy_loss(h, w2, t, bias=b, **kw)
    (gw,) = torch.autograd.grad(loss2, w2)
    torch.testing.assert_close(gw, g1[1])


def test_opcheck(monkeypatch):
    monkeypatch.setenv("PARAVT_IMPL", "torch")
    n, d, v = 9, 16, 50
    h, w, b, t, kw = _case(n, d, v, seed=9, cfg={"bias": True, "prox": True, "behav_cap": 2.0,
                                                 "kl_coef": 0.1, "agg": "seq-mean-token-mean",
                                                 "seq_weights": True})  # fmt: skip
    h, w, b = (x.requires_grad_() for x in (h, w, b))
    m = kw["loss_mask"].float()
    cu, sw = kw["cu_seqlens"], kw["seq_weights"]
    for bias, row_t in ((b, None), (None, torch.rand(n) + 0.5)):
        torch.library.opcheck(
            ops.linear_policy_loss_op,
            (h, w, t, kw["old_logprob"], kw["advantages"], m, bias, row_t, kw["ref_logprob"],
             kw["prox_logprob"], cu, sw, 0.7, 0.2, 0.28, 3.0, 2.0, 0.1, "k3",
             "seq-mean-token-mean", "torch"),
        )  # fmt: skip


def test_errors_name_the_problem(monkeypatch):
    monkeypatch.setenv("PARAVT_IMPL", "torch")
    h, w, b, t, kw = _case(7, 16, 50, seed=10)
    with pytest.raises(ValueError, match=r"\(vocab, d\)"):
        linear_policy_loss(h, w.T.contiguous(), t, **kw)
    with pytest.raises(ValueError, match="targets has 6 elements but hidden has 7"):
        linear_policy_loss(h, w, t[:6], **kw)
    with pytest.raises(ValueError, match="advantages has 6 elements but hidden has 7"):
        linear_policy_loss(h, w, t, **{**kw, "advantages": kw["advantages"][:6]})
    with pytest.raises(TypeError, match="hidden is torch.float32 but weight is torch.bfloat16"):
        linear_policy_loss(h, w.bfloat16(), t, **kw)
    with pytest.raises(TypeError, match="targets has dtype torch.float32"):
        linear_policy_loss(h, w, t.float(), **kw)
    with pytest.raises(ValueError, match="temperature=0.0 must be > 0"):
        linear_policy_loss(h, w, t, **{**kw, "temperature": 0.0})
    with pytest.raises(ValueError, match="temperature has entries <= 0"):
        linear_policy_loss(h, w, t, **{**kw, "temperature": torch.tensor([1.0] * 6 + [0.0])})
    with pytest.raises(ValueError, match="temperature has 3 elements but hidden has 7"):
        linear_policy_loss(h, w, t, **{**kw, "temperature": torch.ones(3)})
    with pytest.raises(ValueError, match=r"bias has shape \(49,\), expected \(50,\)"):
        linear_policy_loss(h, w, t, bias=torch.zeros(49), **kw)
    with pytest.raises(ValueError, match="needs\\s+cu_seqlens"):
        linear_policy_loss(h, w, t, **{**kw, "agg": "seq-mean-token-mean"})
    with pytest.raises(ValueError, match="kl_coef=0.1 needs ref_logprob"):
        linear_policy_loss(h, w, t, **{**kw, "kl_coef": 0.1})
    with pytest.raises(ValueError, match="behav_cap=2.0 caps"):
        linear_policy_loss(h, w, t, **{**kw, "behav_cap": 2.0})


def _budget_rows(monkeypatch, rows, v):
    """Shrink the CPU chunk budget so that a chunk holds ``rows`` rows of a ``v`` vocabulary."""
    monkeypatch.setattr(ref.OWNERS["LPL_CHUNK_BYTES_CPU"], "LPL_CHUNK_BYTES_CPU", rows * 4 * v)
    assert ref.lpl_row_chunk(v, rows * 4 * v) == rows


@pytest.mark.parametrize("rows", [1, 7, 82, 83, 500])
@pytest.mark.parametrize("cfg", ["k1-dual-seqmean", "decoupled-k3-seqsum-weights"])
def test_row_chunks_torch_path_matches_naive(rows, cfg, monkeypatch):
    """Row chunks of 1, 7 (83 rows = 11 x 7 + 6: the last chunk short), 82, 83 (one chunk)
    and 500 (c > n) rows; the sequences [27, 56] of the seq-mean aggregations straddle
    chunk boundaries."""
    monkeypatch.setenv("PARAVT_IMPL", "torch")
    n, d, v = 83, 64, 257
    _budget_rows(monkeypatch, rows, v)
    h, w, b, t, kw = _case(n, d, v, cfg=CONFIGS[cfg], seed=rows)
    loss, stats, lp, ent, grads = _ours(h, w, b, t, kw)
    loss0, stats0, lp0, ent0, grads0 = _naive(h, w, b, t, kw)
    _close(loss, loss0, what="loss")
    _close(lp, lp0, what="logprob")
    _close(ent, ent0, what="entropy")
    for k in LINEAR_POLICY_STAT_NAMES:
        _close(stats[k], stats0[k].float(), what=k, floor=10.0)
    for name, got, want in zip(("hidden", "weight", "bias"), grads, grads0):
        _close(got, want, what=name)


@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
@pytest.mark.parametrize("rows", [5, 83])
def test_row_chunks_triton_matches_single_chunk(rows, monkeypatch):
    n, d, v = 83, 64, 257
    h, w, b, t, kw = _case(n, d, v, cfg=CONFIGS["k2-rowtemp-floatmask-empty-seqs"], seed=4)
    monkeypatch.setenv("PARAVT_IMPL", "torch")
    want = _ours(h, w, b, t, kw)  # default budget: one chunk
    _budget_rows(monkeypatch, rows, v)
    monkeypatch.setenv("PARAVT_IMPL", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got = _ours(h, w, b, t, kw)
    for i, name in ((0, "loss"), (2, "logprob"), (3, "entropy")):
        _close(got[i], want[i], rtol=2e-5, what=name)
    for name, a, c in zip(("hidden", "weight", "bias"), got[4], want[4]):
        _close(a, c, rtol=2e-5, what=name)


@pytest.mark.parametrize(
    "impl_name,dtype,rows",
    [("torch", torch.float32, None), ("torch", torch.float32, 7), ("torch", torch.bfloat16, 7),
     pytest.param("triton", torch.float32, 7, marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton"))],
)  # fmt: skip
def test_three_gemms_no_recompute(impl_name, dtype, rows, monkeypatch):
    """Matmul FLOP of the implementation (forward: it forms every gradient) = 6 n d V: the
    logits, dH and dW GEMMs once each, nothing recomputed (the 4-GEMM design was 8 n d V);
    the op's backward only scales the saved gradients (no matmul). The implementation is
    called directly: a dispatch mode sees a custom op as one opaque call."""
    from torch.utils.flop_counter import FlopCounterMode

    n, d, v = 83, 64, 4100
    if rows is not None:
        _budget_rows(monkeypatch, rows, v)
    monkeypatch.setenv("PARAVT_IMPL", impl_name)
    if impl_name == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        from paravt_kernels.linear_policy_loss_triton import linear_policy_loss_triton as fn
    else:
        fn = ref.linear_policy_loss_torch
    h, w, b, t, kw = _case(n, d, v, dtype, seed=11, cfg=CONFIGS["k1-dual-seqmean"])
    args = (
        h, w, t, kw["old_logprob"], kw["advantages"], kw["loss_mask"], b, kw["temperature"],
        kw["ref_logprob"], None, kw["cu_seqlens"], None, 0.2, 0.2, kw["dual_clip"], None,
        kw["kl_coef"], kw["kl_type"], kw["agg"],
    )  # fmt: skip
    # FlopCounterMode counts mm / addmm but not the in-place addmm_ (the accumulating GEMMs)
    addmm_ = {torch.ops.aten.addmm_: lambda acc, a, b, *_, **__: 2 * a[0] * a[1] * b[1]}
    with FlopCounterMode(display=False, custom_mapping=addmm_) as counter:
        out = fn(*args)
    assert counter.get_total_flops() == 6 * n * d * v, counter.get_flop_counts()
    # the same result as the registered op, whose backward adds no matmul
    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    loss, _, _, _ = linear_policy_loss(leaves[0], leaves[1], t, bias=leaves[2], **kw)
    with FlopCounterMode(display=False, custom_mapping=addmm_) as counter:
        loss.backward()
    assert counter.get_total_flops() == 0
    torch.testing.assert_close(loss.detach(), out[0])
    for leaf, g in zip(leaves, out[4:]):
        torch.testing.assert_close(leaf.grad, g)
