"""linear_logprob: Triton kernels (CPU interpreter) and the chunked torch path vs the naive
formulation (full logits, log_softmax, gather) evaluated in float64."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede any Triton kernel launch; the kernels jit lazily, so this also holds when
    # another test module imported paravt_kernels first.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from paravt_kernels import linear_logprob  # noqa: E402
from paravt_kernels import reference as ref  # noqa: E402

IMPLS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("triton") is None, reason="triton not installed"))]  # fmt: skip
# (tokens, d, vocab): vocab never a multiple of a tile; 5000 > the interpreter's 4096-row
# torch tile and, for Triton, spans two 1024-column blocks plus a remainder.
SHAPES = [(1, 59, 333), (7, 111, 1000), (83, 256, 2049), (1031, 59, 5000)]


def _naive(h, w, t, b, temperature, ignore_index=-100):
    """The formulation users know, with autograd: (logprob, entropy) (N,)."""
    z = h @ w.T
    if b is not None:
        z = z + b
    lsm = torch.log_softmax(z / temperature, dim=-1)
    valid = t != ignore_index
    lp = lsm.gather(1, t.clamp_min(0)[:, None]).squeeze(1)
    ent = -(lsm.exp() * lsm).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


def _inputs(n, d, v, dtype, seed=0, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, d, generator=g) * scale).to(dtype)
    w = (torch.randn(v, d, generator=g) * scale).to(dtype)
    b = torch.randn(v, generator=g).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    return h, w, b, t


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("with_bias,entropy,temperature", [(False, False, 1.0), (True, True, 0.7)])
def test_matches_naive_fp32(impl, shape, with_bias, entropy, temperature):
    n, d, v = shape
    h, w, b, t = _inputs(n, d, v, torch.float32)
    if n > 1:
        t[1::3] = -100  # ignored tokens: value 0, no gradient
    b = b if with_bias else None
    g = torch.Generator().manual_seed(1)
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)

    leaves = [x.clone().requires_grad_() for x in (h, w) + ((b,) if b is not None else ())]
    out = linear_logprob(
        leaves[0], leaves[1], t, temperature=temperature,
        bias=leaves[2] if b is not None else None, return_entropy=entropy,
    )  # fmt: skip
    lp, ent = out if entropy else (out, None)
    obj = (lp * g_lp).sum() + ((ent * g_ent).sum() if entropy else 0.0)
    grads = torch.autograd.grad(obj, leaves)

    oracle = [x.double().requires_grad_() for x in (h, w) + ((b,) if b is not None else ())]
    lp64, ent64 = _naive(oracle[0], oracle[1], t, oracle[2] if b is not None else None, temperature)
    obj64 = (lp64 * g_lp.double()).sum() + ((ent64 * g_ent.double()).sum() if entropy else 0.0)
    grads64 = torch.autograd.grad(obj64, oracle)

    assert lp.dtype == torch.float32 and lp.shape == (n,)
    assert (lp <= 0).all(), "a log-probability above 0"
    torch.testing.assert_close(lp.double(), lp64, atol=2e-5, rtol=1e-5)
    if entropy:
        torch.testing.assert_close(ent.double(), ent64, atol=2e-5, rtol=1e-5)
    if n > 1:
        assert (lp[1::3] == 0).all() and grads[0][1::3].abs().max() == 0
    # Same-dtype baseline: the naive formulation in float32 (the project's tolerance rule:
    # error vs the fp64 oracle <= 2x that of the same-dtype torch computation, where the fixed
    # tolerance alone is too tight for this CPU's rounding).
    naive = [x.clone().requires_grad_() for x in (h, w) + ((b,) if b is not None else ())]
    lp32, ent32 = _naive(naive[0], naive[1], t, naive[2] if b is not None else None, temperature)
    obj32 = (lp32 * g_lp).sum() + ((ent32 * g_ent).sum() if entropy else 0.0)
    grads32 = torch.autograd.grad(obj32, naive)
    for got, want, base in zip(grads, grads64, grads32):
        try:
            torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)
        except AssertionError:
            err = float((got.double() - want).abs().max())
            base_err = float((base.double() - want).abs().max())
            assert err <= 2 * base_err, f"grad error {err:.3g} > 2x naive fp32 {base_err:.3g}"


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_bf16_error_within_twice_torch_bf16(impl):
    """bf16 error vs an fp64 oracle <= 2x the error of the same-dtype naive torch computation."""
    n, d, v = 83, 256, 3001
    h, w, b, t = _inputs(n, d, v, torch.bfloat16, seed=3, scale=1.0)
    lp64, ent64 = _naive(h.double(), w.double(), t, b.double(), 0.7)
    # same-dtype torch: bf16 matmul, softmax in fp32 (what a bf16 trainer computes)
    z16 = (h @ w.T + b).float() / 0.7
    lsm16 = torch.log_softmax(z16, -1)
    lp16 = lsm16.gather(1, t[:, None]).squeeze(1)
    ent16 = -(lsm16.exp() * lsm16).sum(-1)
    lp, ent = linear_logprob(h, w, t, temperature=0.7, bias=b, return_entropy=True)
    assert (lp <= 0).all()
    err, err_torch = (lp.double() - lp64).abs().max(), (lp16.double() - lp64).abs().max()
    assert err <= 2 * err_torch, (err, err_torch)
    err_e, err_e_torch = (ent.double() - ent64).abs().max(), (ent16.double() - ent64).abs().max()
    assert err_e <= 2 * err_e_torch, (err_e, err_e_torch)

    # gradients, same rule, w.r.t. hidden and weight
    g = torch.Generator().manual_seed(4)
    g_lp = torch.randn(n, generator=g)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    gh, gw = torch.autograd.grad((linear_logprob(hh, ww, t, bias=b) * g_lp).sum(), (hh, ww))
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    gh64, gw64 = torch.autograd.grad(
        (_naive(h64, w64, t, b.double(), 1.0)[0] * g_lp.double()).sum(), (h64, w64)
    )
    h16, w16 = h.clone().requires_grad_(), w.clone().requires_grad_()
    lsm = torch.log_softmax((h16 @ w16.T + b).float(), -1)
    gh16, gw16 = torch.autograd.grad(
        (lsm.gather(1, t[:, None]).squeeze(1) * g_lp).sum(), (h16, w16)
    )
    for got, same, want in ((gh, gh16, gh64), (gw, gw16, gw64)):
        e, e_t = (got.double() - want).abs().max(), (same.double() - want).abs().max()
        assert e <= 2 * e_t, (e, e_t)


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_never_above_zero_with_peaked_logits(impl):
    """Near-one-hot distributions are where z_t - lse rounds to a positive number."""
    n, d, v = 7, 59, 300
    h, w, _, t = _inputs(n, d, v, torch.float32, seed=5, scale=4.0)
    t = (h @ w.T).argmax(-1)  # the dominant token: logprob ~ -1e-30 in exact arithmetic
    lp = linear_logprob(h, w, t)
    assert (lp <= 0).all()
    torch.testing.assert_close(
        lp.double(), _naive(h.double(), w.double(), t, None, 1.0)[0], atol=1e-5, rtol=1e-5
    )


def test_torch_path_chunks_do_not_change_results():
    """Tile/chunk boundaries of the torch path are invisible in the result."""
    h, w, b, t = _inputs(50, 59, 777, torch.float32, seed=6)
    full = ref.linear_logprob_forward_torch(h, w, t, b, 0.9, True, -100, 10**6, 10**6)
    tiled = ref.linear_logprob_forward_torch(h, w, t, b, 0.9, True, -100, 16, 100)
    for a, c in zip(full, tiled):
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)
    # the standalone autograd.Function of reference.py agrees with the registered op
    hh = h.clone().requires_grad_()
    lp, ent = ref.linear_logprob_torch(hh, w, t, temperature=0.9, bias=b, return_entropy=True)
    torch.testing.assert_close(lp, full[0])
    torch.testing.assert_close(ent, full[1])
    (gh,) = torch.autograd.grad(lp.sum(), hh)
    hh2 = h.clone().requires_grad_()
    (gh2,) = torch.autograd.grad(linear_logprob(hh2, w, t, temperature=0.9, bias=b).sum(), hh2)
    torch.testing.assert_close(gh, gh2)


def test_errors_name_the_problem():
    h, w, _, t = _inputs(7, 59, 100, torch.float32)
    with pytest.raises(ValueError, match=r"weight must be\s+\(vocab, d\)|\(vocab, d\)"):
        linear_logprob(h, w.T.contiguous(), t)
    with pytest.raises(ValueError, match="targets has 6 elements but hidden has 7"):
        linear_logprob(h, w, t[:6])
    with pytest.raises(ValueError, match="temperature=0"):
        linear_logprob(h, w, t, temperature=0.0)
    with pytest.raises(TypeError, match="hidden is torch.float32 but weight is torch.bfloat16"):
        linear_logprob(h, w.bfloat16(), t)


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_nan_gradient_at_ignored_rows_stays_out_of_weight_grad(impl):
    """An ignored row's log-prob is a constant 0: whatever gradient arrives for it (here NaN,
    as from a loss that formed 0 * inf) must not reach the weight gradient of any row."""
    h, w, b, t = _inputs(13, 59, 333, torch.float32, seed=8)
    t[[2, 9]] = -100
    g = torch.Generator().manual_seed(9)
    g_lp, g_ent = torch.randn(13, generator=g), torch.randn(13, generator=g)
    g_lp[[2, 9]] = 0.0
    g_ent[[2, 9]] = 0.0
    nan_lp, nan_ent = g_lp.clone(), g_ent.clone()
    nan_lp[[2, 9]] = float("nan")
    nan_ent[[2, 9]] = float("nan")
    grads = {}
    for name, gl, ge in (("clean", g_lp, g_ent), ("nan", nan_lp, nan_ent)):
        leaves = [x.clone().requires_grad_() for x in (h, w, b)]
        lp, ent = linear_logprob(*leaves[:2], t, bias=leaves[2], return_entropy=True)
        grads[name] = torch.autograd.grad((lp, ent), leaves, (gl, ge))
    for name, got, want in zip(("hidden", "weight", "bias"), grads["nan"], grads["clean"]):
        assert torch.isfinite(got).all(), f"NaN in the {name} gradient"
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=name)


# the interpreter computes the forward of the NaN rows in numpy, which warns
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_nonfinite_hidden_at_rows_without_gradient_stays_out_of_weight_grad(impl):
    """A row whose log-prob and entropy get zero gradient (a token the loss masks) may hold
    a NaN/inf hidden state: its gradients equal those of the row replaced by zeros (0 for
    its own dH, nothing in dW/db), entropy term and temperature included; it was 0 * NaN =
    NaN in every row of dW. A row that does get a gradient still shows its NaN."""
    h, w, b, t = _inputs(11, 59, 333, torch.float32, seed=10)
    g = torch.Generator().manual_seed(11)
    g_lp, g_ent = torch.randn(11, generator=g), torch.randn(11, generator=g)
    dead = [1, 7]
    g_lp[dead], g_ent[dead] = 0.0, 0.0
    zeroed, dirty = h.clone(), h.clone()
    zeroed[dead] = 0.0
    dirty[1] = float("nan")
    dirty[7, 4] = float("-inf")

    def grads(hidden, gl):
        leaves = [x.clone().requires_grad_() for x in (hidden, w, b)]
        lp, ent = linear_logprob(*leaves[:2], t, bias=leaves[2], temperature=0.7,
                                 return_entropy=True)  # fmt: skip
        return torch.autograd.grad((lp, ent), leaves, (gl, g_ent))

    for name, got, want in zip(("hidden", "weight", "bias"), grads(dirty, g_lp),
                               grads(zeroed, g_lp)):  # fmt: skip
        assert torch.isfinite(got).all(), f"non-finite {name} gradient"
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=name)
    g_lp[1] = 1.0
    assert not torch.isfinite(grads(dirty, g_lp)[1]).all()


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("triton") is None, reason="triton not installed"
)
def test_low_precision_logits_never_fall_back_to_bf16_rounding():
    """Where torch cannot emit fp32 logits from bf16 operands (mm out_dtype), the GPU path
    raises instead of rounding the logits to bf16 (~0.05 error on every log-prob)."""
    from paravt_kernels import linear_logprob_triton as llt

    class LooksCuda(torch.Tensor):  # takes the CUDA branch; CPU has no aten::mm.dtype
        @property
        def is_cuda(self) -> bool:
            return True

    a = torch.randn(4, 8).bfloat16().as_subclass(LooksCuda)
    b = torch.randn(8, 5).bfloat16().as_subclass(LooksCuda)
    with pytest.raises(
        RuntimeError,
        match=r"hidden \(torch.bfloat16\) x weight \(torch.bfloat16\).*needs a matmul with "
        r"float32 output.*error of ~0.05.*pass float32 hidden and weight",
    ):
        llt.mm_f32(a, b)


class _CopiesOf(__import__("torch.utils._python_dispatch", fromlist=["x"]).TorchDispatchMode):
    """Records every op (matmuls aside) that reads ``src``'s storage and returns a tensor of
    ``src``'s shape: a copy of ``src`` (``where``, ``clone``, ``to``, ``mul``, ...)."""

    def __init__(self, src: torch.Tensor) -> None:
        super().__init__()
        self.ptr, self.shape, self.copies = src.untyped_storage().data_ptr(), src.shape, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        reads = any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == self.ptr
                    for a in torch.utils._pytree.tree_leaves((args, kwargs)))  # fmt: skip
        mm = func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm)
        if reads and not mm:
            for o in torch.utils._pytree.tree_leaves(out):
                if isinstance(o, torch.Tensor) and o.shape == self.shape:
                    self.copies.append(str(func))
        return out


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("impl", ["triton"], indirect=True)
@pytest.mark.skipif(
    __import__("importlib").util.find_spec("triton") is None, reason="triton not installed"
)
def test_backward_selects_dead_nan_rows_per_tile_without_copying_hidden(impl, monkeypatch):
    """The NaN-row fix of the backward is a select per (vocabulary tile, column chunk): no op
    makes an (N, d) copy of hidden (the code before: ``torch.where(void, 0, hidden)``, a full
    copy), and the gradients equal the torch path's on the zeroed rows, with 3 vocabulary
    tiles and 4 column chunks forced."""
    from paravt_kernels import linear_logprob_triton as llt

    monkeypatch.setattr(llt, "CPU_VOCAB_TILE", 128, raising=False)
    monkeypatch.setattr(llt, "DW_COLS", 16, raising=False)
    h, w, b, t = _inputs(13, 59, 333, torch.float32, seed=12)
    g_lp = torch.randn(13, generator=torch.Generator().manual_seed(13))
    g_lp[[2, 9]] = 0.0
    zeroed, dirty = h.clone(), h.clone()
    zeroed[[2, 9]] = 0.0
    dirty[2] = float("nan")
    dirty[9, 0] = float("inf")

    def grads(hidden):
        leaves = [x.clone().requires_grad_() for x in (hidden, w, b)]
        lp = linear_logprob(leaves[0], leaves[1], t, bias=leaves[2], temperature=0.9)
        return leaves[0], torch.autograd.grad(lp, leaves, g_lp)

    _, got = grads(dirty)
    # the registered op hides its body from a dispatch mode: run the backward's body
    _, ent, lse = llt.linear_logprob_fwd_triton(dirty, w, t, b, 0.9, False, -100)
    mode = _CopiesOf(dirty)
    with mode:
        llt.linear_logprob_bwd_triton(g_lp, None, dirty, w, t, b, lse, ent, 0.9, -100)
    assert mode.copies == [], mode.copies
    monkeypatch.setenv("PARAVT_IMPL", "torch")
    _, want = grads(zeroed)
    for name, a, e in zip(("hidden", "weight", "bias"), got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5, msg=name)
