"""The reference path agrees with the formulations users know (TRL GRPO loss types, verl's
aggregation modes, dual clip and KL estimators, re-implemented here from their published
formulas on padded [B, L] tensors), every registered op passes ``opcheck``, and the dispatch
point raises clear errors."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import paravt_kernels  # noqa: E402
from paravt_kernels import ops, policy_loss, resolve_impl  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
LENGTHS = [5, 12, 1, 9]


def _padded_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    b, L = len(LENGTHS), max(LENGTHS)
    mask = torch.zeros(b, L)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = (torch.rand(n, generator=g) > 0.2).float()
        mask[i, 0] = 1.0  # every sequence keeps a trained token (TRL/verl divide by its count)
    old = -torch.rand(b, L, generator=g) * 2
    lp = old + 0.5 * torch.randn(b, L, generator=g)
    ref = old + 0.3 * torch.randn(b, L, generator=g)
    adv = torch.randn(b, 1, generator=g).expand(b, L).contiguous()  # per-sequence, as GRPO
    return lp, old, ref, adv, mask


def _pack(x, mask_like):
    return torch.cat([x[i, :n] for i, n in enumerate(LENGTHS)])


def _ours(lp_pad, old, ref, adv, mask, agg, **kw):
    lp = _pack(lp_pad, mask).detach().requires_grad_()
    cu = torch.tensor([0] + LENGTHS).cumsum(0)
    loss, _ = policy_loss(
        lp, _pack(old, mask), _pack(adv, mask), _pack(mask, mask),
        ref_logprob=_pack(ref, mask), cu_seqlens=cu, agg=agg, **kw,
    )  # fmt: skip
    (g,) = torch.autograd.grad(loss, lp)
    return loss, g


def _trl_per_token(lp, old, ref, adv, eps_low, eps_high, beta):
    """TRL GRPOTrainer._compute_loss: -min(r A, clip(r) A) + beta * k3."""
    coef_1 = torch.exp(lp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if beta:
        kl = torch.exp(ref - lp) - (ref - lp) - 1
        per_token = per_token + beta * kl
    return per_token


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_trl_loss_types(loss_type, monkeypatch):
    monkeypatch.setenv("PARAVT_IMPL", "torch")
    lp, old, ref, adv, mask = _padded_batch(1)
    L = mask.shape[1]  # max_completion_length
    lp_t = lp.clone().requires_grad_()
    pt = _trl_per_token(lp_t, old, ref, adv, 0.2, 0.28, 0.04)
    if loss_type == "grpo":
        want = ((pt * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        agg, factor = "seq-mean-token-mean", 1.0
    elif loss_type == "bnpo":
        want = (pt * mask).sum() / mask.sum().clamp(min=1.0)
        agg, factor = "token-mean", 1.0
    elif loss_type == "dr_grpo":
        want = (pt * mask).sum() / (pt.size(0) * L)
        agg, factor = "seq-mean-token-sum", 1.0 / L  # Dr. GRPO = seq-mean-token-sum / max_len
    else:  # dapo: normalised by the number of trained tokens in the (global) batch
        want = (pt * mask).sum() / mask.sum()
        agg, factor = "token-mean", 1.0
    (g_want,) = torch.autograd.grad(want, lp_t)
    loss, g = _ours(
        lp, old, ref, adv, mask, agg, clip_low=0.2, clip_high=0.28, kl_coef=0.04, kl_type="k3"
    )
    torch.testing.assert_close(loss * factor, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(g * factor, _pack(g_want, mask), atol=1e-7, rtol=1e-5)


def _verl_kl(lp, ref, kind):
    if kind == "kl":  # k1
        return lp - ref
    if kind == "mse":  # k2
        return 0.5 * (lp - ref).square()
    kl = torch.clamp(ref - lp, -20, 20)  # low_var_kl (k3)
    return torch.clamp(torch.exp(kl) - kl - 1, -10, 10)


def _verl_agg(loss_mat, mask, mode):
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    if mode == "seq-mean-token-sum":
        return (loss_mat * mask).sum(-1).mean()
    if mode == "seq-mean-token-mean":
        return ((loss_mat * mask).sum(-1) / mask.sum(-1)).mean()
    if mode == "seq-mean-token-sum-norm":
        return (loss_mat * mask).sum() / mask.shape[-1]
    raise AssertionError(mode)


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
@pytest.mark.parametrize("kl_kind,kl_type", [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")])
def test_verl_modes_dual_clip_and_kl(mode, kl_kind, kl_type, monkeypatch):
    """verl compute_policy_loss (dual clip, clip_ratio_c=3) + kl_penalty, aggregated by agg_loss."""
    monkeypatch.setenv("PARAVT_IMPL", "torch")
    lp, old, ref, adv, mask = _padded_batch(2)
    lp_t = lp.clone().requires_grad_()
    ratio = torch.exp(lp_t - old)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - 0.2, 1 + 0.3)
    clip1 = torch.maximum(pg1, pg2)
    clip2 = torch.min(-adv * 3.0, clip1)
    pg = torch.where(adv < 0, clip2, clip1)
    want = _verl_agg(pg, mask, mode) + 0.1 * _verl_agg(_verl_kl(lp_t, ref, kl_kind), mask, mode)
    (g_want,) = torch.autograd.grad(want, lp_t)
    agg = "seq-mean-token-sum" if mode == "seq-mean-token-sum-norm" else mode
    factor = len(LENGTHS) / mask.shape[1] if mode == "seq-mean-token-sum-norm" else 1.0
    loss, g = _ours(lp, old, ref, adv, mask, agg, clip_low=0.2, clip_high=0.3, dual_clip=3.0,
                    kl_coef=0.1, kl_type=kl_type)  # fmt: skip
    torch.testing.assert_close(loss * factor, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(g * factor, _pack(g_want, mask), atol=1e-7, rtol=1e-5)


# ---------------------------------------------------------------------------------- opcheck
def _opcheck_cases(impl):
    g = torch.Generator().manual_seed(0)
    n, d, v = 9, 16, 50
    h = torch.randn(n, d, generator=g, requires_grad=True)
    w = torch.randn(v, d, generator=g, requires_grad=True)
    b = torch.randn(v, generator=g, requires_grad=True)
    t = torch.randint(0, v, (n,), generator=g)
    lp = torch.randn(n, generator=g, requires_grad=True)
    cu = torch.tensor([0, 4, 9])
    yield (
        ops.group_advantage_op,
        (torch.randn(n, generator=g), torch.tensor([0, 1] * 4 + [2]), True, 1e-6, 1.0, 0.0, impl),
    )
    yield ops.linear_logprob_fwd_op, (h, w, t, b, 0.7, True, -100, impl)
    yield ops.linear_logprob_fwd_op, (h, w, t, None, 1.0, False, -100, impl)
    with torch.no_grad():
        _, ent, lse = ops.linear_logprob_fwd_op(h, w, t, b, 0.7, True, -100, impl)
    yield (
        ops.linear_logprob_bwd_op,
        (
            torch.randn(n, generator=g),
            torch.randn(n, generator=g),
            h.detach(),
            w.detach(),
            t,
            b.detach(),
            lse,
            ent,
            0.7,
            -100,
            impl,
        ),
    )
    yield ops.policy_loss_op, (lp, torch.randn(n, generator=g), torch.randn(n, generator=g), torch.ones(n),
                               torch.randn(n, generator=g), torch.randn(n, generator=g), cu, torch.rand(2, generator=g),
                               0.2, 0.28, 3.0, 2.0, 0.1, "k3", "seq-mean-token-mean", impl)  # fmt: skip
    gbuf, coef, gl = torch.randn(n, generator=g), torch.rand(2, generator=g), torch.tensor(0.5)
    yield ops.policy_loss_grad_op, (gbuf, coef, cu, gl, torch.bfloat16, impl)
    yield ops.policy_loss_grad_op, (gbuf, coef[:1], None, gl, torch.float32, impl)


@pytest.mark.parametrize(
    "impl",
    ["torch", pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton"))],
)
def test_opcheck_every_registered_op(impl, monkeypatch):
    if impl == "triton":  # CPU tensors: interpret
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    checked = set()
    for op, args in _opcheck_cases(impl):
        torch.library.opcheck(op, args)
        checked.add(op._qualname if hasattr(op, "_qualname") else str(op))
    assert {"paravt::group_advantage", "paravt::linear_logprob_fwd", "paravt::linear_logprob_bwd",
            "paravt::policy_loss", "paravt::policy_loss_grad"} <= checked  # fmt: skip


def test_torch_compile_traces_the_ops(monkeypatch):
    """fake kernels let dynamo/aot trace through the ops with fullgraph=True (eager backend)."""
    monkeypatch.setenv("PARAVT_IMPL", "torch")
    n = 11
    lp = torch.randn(n, requires_grad=True)
    old, adv, mask = torch.randn(n), torch.randn(n), torch.ones(n)

    def step(lp, old, adv, mask):
        loss, stats = policy_loss(lp, old, adv, mask, kl_coef=0.0)
        return loss, stats["clip_frac"]

    loss_c, cf_c = torch.compile(step, backend="aot_eager", fullgraph=True)(lp, old, adv, mask)
    loss_e, cf_e = step(lp, old, adv, mask)
    torch.testing.assert_close(loss_c, loss_e)
    torch.testing.assert_close(cf_c, cf_e)

    h = torch.randn(9, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    t = torch.randint(0, 50, (9,))

    def lm(h, w, t):
        lp, ent = paravt_kernels.linear_logprob(h, w, t, temperature=0.7, return_entropy=True)
        return lp.sum() + 0.1 * ent.sum()

    out_c = torch.compile(lm, backend="aot_eager", fullgraph=True)(h, w, t)
    grads_c = torch.autograd.grad(out_c, (h, w))
    out_e = lm(h, w, t)
    grads_e = torch.autograd.grad(out_e, (h, w))
    torch.testing.assert_close(out_c, out_e)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b)
    r, gi = torch.randn(8), torch.arange(8) // 2
    ga = torch.compile(paravt_kernels.group_advantage, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(ga(r, gi), paravt_kernels.group_advantage(r, gi))


# --------------------------------------------------------------------------------- dispatch
def test_dispatch_choices_and_errors(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("PARAVT_IMPL", "auto")
    assert resolve_impl(cpu, "policy_loss") == "torch"
    monkeypatch.setenv("PARAVT_IMPL", "torch")
    assert resolve_impl(cpu, "policy_loss") == "torch"
    monkeypatch.setenv("PARAVT_IMPL", "cuda")
    with pytest.raises(ValueError, match="PARAVT_IMPL='cuda' is not one of auto|torch|triton"):
        resolve_impl(cpu, "policy_loss")
    if HAS_TRITON:
        monkeypatch.setenv("PARAVT_IMPL", "triton")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1"):
            paravt_kernels.group_advantage(torch.zeros(3), torch.zeros(3, dtype=torch.long))
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert resolve_impl(cpu, "policy_loss") == "triton"


@pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(), reason="needs triton, CPU only")
def test_interpreter_choice_is_made_at_launch_not_import():
    """paravt_kernels imported (and a kernel module loaded) BEFORE TRITON_INTERPRET is set, as
    happens when another test module imports it first: the kernels must still run."""
    import subprocess
    import sys

    code = (
        "import os, torch\n"
        "os.environ.pop('TRITON_INTERPRET', None)\n"
        "import paravt_kernels, paravt_kernels.group_advantage_triton\n"
        "os.environ['TRITON_INTERPRET'] = '1'; os.environ['PARAVT_IMPL'] = 'triton'\n"
        "a = paravt_kernels.group_advantage(torch.tensor([1., 2., 4.]), torch.tensor([0, 0, 1]))\n"
        "print(a.tolist())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PARAVT_IMPL")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = [float(x) for x in out.stdout.strip().strip("[]").split(",")]
    assert got == pytest.approx([-0.7071063, 0.7071063, 0.0], abs=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA + triton")
def test_cuda_triton_matches_torch_reference(monkeypatch):
    """On a GPU: the compiled Triton path (auto) against the torch path, bf16 lm-head."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    g = torch.Generator(device="cuda").manual_seed(0)
    n, d, v = 1031, 256, 50000
    h = (torch.randn(n, d, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(v, d, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    out = {}
    for impl in ("triton", "torch"):
        monkeypatch.setenv("PARAVT_IMPL", impl)
        h.grad = w.grad = None
        lp, ent = paravt_kernels.linear_logprob(h, w, t, temperature=0.7, return_entropy=True)
        (lp.sum() + ent.sum()).backward()
        out[impl] = (lp, ent, h.grad.float(), w.grad.float())
    for a, b in zip(out["triton"], out["torch"]):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    lp = torch.randn(n, device="cuda", requires_grad=True)
    args = (
        lp,
        torch.randn(n, device="cuda"),
        torch.randn(n, device="cuda"),
        torch.ones(n, device="cuda"),
    )
    cu = torch.tensor([0, 500, 1000, n], device="cuda")
    res = {}
    for impl in ("triton", "torch"):
        monkeypatch.setenv("PARAVT_IMPL", impl)
        loss, stats = policy_loss(*args, cu_seqlens=cu, agg="seq-mean-token-mean", dual_clip=3.0)
        (gr,) = torch.autograd.grad(loss, lp)
        res[impl] = (loss, gr, torch.stack(list(stats.values())))
    for a, b in zip(res["triton"], res["torch"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA + triton")
@pytest.mark.parametrize("chunk_rows", [None, 700])
def test_cuda_linear_policy_loss_matches_torch_reference(monkeypatch, chunk_rows):
    """On a GPU: the fused ``linear_policy_loss`` (cuBLAS fp32-output logits chunks + Triton
    row kernels) against its torch path, bf16 operands, per-row temperatures, decoupled
    objective with KL, several sequences across chunk boundaries. ``chunk_rows=700``: 5 equal
    chunks of 600 rows, so dW is accumulated in place by cuBLAS (``addmm`` with an fp32
    output) across chunks, as at V = 151936 with more than 3533 tokens."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if chunk_rows is not None:
        from paravt_kernels import linear_policy_loss_triton as lplt

        monkeypatch.setattr(lplt, "_GPU_CHUNK_BYTES", chunk_rows * 4 * 50000)
    g = torch.Generator(device="cuda").manual_seed(1)
    n, d, v = 3000, 256, 50000
    h = (torch.randn(n, d, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(v, d, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    old = -torch.rand(n, device="cuda", generator=g) * 8 - 3
    kw = dict(
        temperature=torch.where(torch.arange(n, device="cuda") < 1800, 0.7, 1.0),
        ref_logprob=old - 0.1, prox_logprob=old + 0.05, behav_cap=3.0, kl_coef=0.01,
        agg="seq-mean-token-mean", cu_seqlens=torch.tensor([0, 1000, 1800, 2999, n], device="cuda"),
        seq_weights=torch.tensor([1.0, 0.5, 0.5, 1.0], device="cuda"),
    )  # fmt: skip
    adv = torch.randn(n, device="cuda", generator=g)
    mask = (torch.rand(n, device="cuda", generator=g) > 0.2).float()
    out = {}
    for impl in ("triton", "torch"):
        monkeypatch.setenv("PARAVT_IMPL", impl)
        h.grad = w.grad = None
        loss, stats, lp, ent = paravt_kernels.linear_policy_loss(h, w, t, old, adv, mask, **kw)
        (3.0 * loss).backward()
        out[impl] = (loss, lp, ent, h.grad.float(), w.grad.float(), stats["clip_frac"])
    for a, b in zip(out["triton"], out["torch"]):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA + triton")
def test_cuda_issue37_kernels_vs_fp64_reference_nan_rows_one_token(monkeypatch):
    """On a GPU, the restructured kernels of issue 37 at sizes where the GPU launch shapes
    apply: ``policy_loss`` over 2^20 tokens packed as 1-token, empty and long sequences, with
    NaN/-inf inputs at masked rows, against the autograd reference (float64 inputs) on the clean
    inputs, in 3 Triton launches and no torch kernel; ``linear_logprob`` (bf16, 6 vocabulary
    tiles, 3 dW column chunks) with NaN/inf hidden rows that get no gradient, against an
    fp32-logit autograd path on the rows zeroed."""
    from paravt_kernels import linear_logprob_triton as llt
    from paravt_kernels.profiling import count_launches

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("PARAVT_IMPL", "triton")
    g = torch.Generator(device="cuda").manual_seed(7)
    n = 1 << 20
    lengths = [1, 1, 0, 1, 5000, 1, 0] + [1021] * 1000
    lengths.append(n - sum(lengths))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    old = -torch.rand(n, device="cuda", generator=g) * 3
    clean = {"lp": old + 0.2 * torch.randn(n, device="cuda", generator=g), "old": old,
             "ref": old + 0.1 * torch.randn(n, device="cuda", generator=g),
             "prox": old + 0.1 * torch.randn(n, device="cuda", generator=g)}  # fmt: skip
    adv = torch.randn(n, device="cuda", generator=g)
    mask = torch.rand(n, device="cuda", generator=g) > 0.2
    kw = dict(behav_cap=2.0, kl_coef=0.05, kl_type="k3", dual_clip=3.0, cu_seqlens=cu,
              agg="seq-mean-token-mean")  # fmt: skip
    dirty = {k: torch.where(mask, v, float("nan") if k != "old" else float("-inf"))
             for k, v in clean.items()}  # fmt: skip
    lp = dirty["lp"].clone().requires_grad_()
    one = torch.ones((), device="cuda")

    def step():
        loss, stats = policy_loss(lp, dirty["old"], adv, mask.float(), ref_logprob=dirty["ref"],
                                  prox_logprob=dirty["prox"], **kw)  # fmt: skip
        (gr,) = torch.autograd.grad(loss, lp, grad_outputs=one)
        return loss, gr, stats

    loss, gr, stats = step()
    c = count_launches(step)
    assert len(c.triton) == 3 and c.torch_ops == [], c
    lp64 = clean["lp"].double().requires_grad_()
    loss_r, stats_r = paravt_kernels.reference.policy_loss_torch(lp64, clean["old"].double(), adv.double(),
                                            mask.double(), ref_logprob=clean["ref"].double(),
                                            prox_logprob=clean["prox"].double(), **kw)  # fmt: skip
    (gr_r,) = torch.autograd.grad(loss_r, lp64)
    torch.testing.assert_close(loss.double(), loss_r, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(gr.double(), gr_r, atol=1e-9, rtol=1e-4)
    assert (gr[~mask] == 0).all()
    for k in stats:
        torch.testing.assert_close(stats[k].double(), stats_r[k].double(), atol=1e-5,
                                   rtol=1e-4, msg=k)  # fmt: skip
    # linear_logprob: several tiles and column chunks, dead NaN/inf rows
    monkeypatch.setattr(llt, "LOGITS_TILE_BYTES", 2048 * 4 * 6000)
    monkeypatch.setattr(llt, "DW_COLS", 384)
    nt, d, v = 2048, 1024, 32000
    h = (torch.randn(nt, d, device="cuda", generator=g) * 0.5).bfloat16()
    w = (torch.randn(v, d, device="cuda", generator=g) * 0.05).bfloat16()
    t = torch.randint(0, v, (nt,), device="cuda", generator=g)
    gout = torch.randn(nt, device="cuda", generator=g)
    dead = torch.arange(nt, device="cuda") % 97 == 3
    gout[dead] = 0.0
    hd = h.clone()
    hd[dead.nonzero()[::2, 0]] = float("nan")
    hd[dead.nonzero()[1::2, 0], 5] = float("inf")
    hz = torch.where(dead[:, None], 0.0, h)
    hh, ww = hd.clone().requires_grad_(), w.clone().requires_grad_()
    gh, gw = torch.autograd.grad(paravt_kernels.linear_logprob(hh, ww, t), (hh, ww), gout)
    hr, wr = hz.float().requires_grad_(), w.float().requires_grad_()
    lpr = torch.log_softmax(hr @ wr.T, -1).gather(1, t[:, None]).squeeze(1)
    ghr, gwr = torch.autograd.grad(lpr, (hr, wr), gout)
    assert torch.isfinite(gh).all() and torch.isfinite(gw).all()
    for a, b in ((gh, ghr), (gw, gwr)):
        assert float((a.float() - b).norm() / b.norm()) < 1e-2
