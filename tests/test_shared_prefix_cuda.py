"""Shared-prefix attention on CUDA (issue 51 item 2): the calls the trainer makes on a GPU, at
Qwen3-VL-8B's attention shape (32 query heads, 8 key/value heads, head dim 128, bf16), against
``flash_varlen_reference`` (flash-attn's varlen contract written out, float32).

* ``sdpa`` (the 8B preset): ``varlen_sdpa_attention`` with a shared layout's blocks, one SDPA
  per block, a suffix's mask ``causal_lower_right``. It must run torch's flash or
  memory-efficient kernel, never a materialised ``L_s x (P + L_s)`` mask (the fallback is
  made to raise here), and be as close to the float32 reference as a bf16 SDPA with an
  explicit mask on the math kernel (2x its error, forward and gradients).
* ``flash_attention_2``: ``varlen_flash_attention`` is ONE varlen call with separate query and
  key boundaries whose causal mask must be aligned to the bottom right. Checked against a
  real FlashAttention-2 kernel: torch's own ``varlen_attn`` (torch >= 2.10, causal as window
  ``(-1, 0)``) always, and flash-attn's ``flash_attn_varlen_func`` through the wrapper where
  the package is installed (not in the device image seen so far: then that case skips).

Run by ``scripts/gpu_check.sh`` (step ``shared_prefix``); every test skips without CUDA.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from paravt.models.forward import (
    flash_varlen_reference,
    prefix_varlen_kwargs,
    varlen_flash_attention,
    varlen_sdpa_attention,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

H, HKV, D = 32, 8, 128
# A prompt of 1,024 rows, four suffixes of it (one shorter than 8, one of odd length), and an
# ungrouped row of 333: the blocks of one shared layout.
_LENGTHS = [("p", 1024), ("s", 300), ("s", 5), ("s", 517), ("s", 64), ("u", 333)]


def _blocks() -> list[tuple[int, int, int, int]]:
    blocks, r, prompt = [], 0, (0, 0)
    for kind, n in _LENGTHS:
        blocks.append((r, r + n, *(prompt if kind == "s" else (0, 0))))
        if kind == "p":
            prompt = (r, r + n)
        r += n
    return blocks


def _qkv(rows: int, grad: bool = True) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    return tuple(
        torch.randn(1, h, rows, D, device="cuda", generator=gen).bfloat16().requires_grad_(grad)
        for h in (H, HKV, HKV)
    )


def _reference(q, k, v, blocks):
    """float32 ``flash_varlen_reference`` over the blocks' gathered keys, ``(1, M, H, D)``."""
    kw = prefix_varlen_kwargs(blocks, q.device)
    idx = kw["paravt_key_index"]
    q3, k3, v3 = (x[0].transpose(0, 1).float() for x in (q, k, v))
    out = flash_varlen_reference(
        q3, k3[idx], v3[idx], kw["cu_seq_lens_q"], kw["cu_seq_lens_k"],
        kw["max_length_q"], kw["max_length_k"], causal=True,
    )  # fmt: skip
    return out[None]


def _math_bf16(q, k, v, blocks):
    """The same-dtype torch computation: bf16 SDPA on the math kernel, explicit boolean mask."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    outs = []
    with sdpa_kernel([SDPBackend.MATH]):
        for q0, q1, p0, p1 in blocks:
            kk = torch.cat([k[:, :, p0:p1], k[:, :, q0:q1]], 2)
            vv = torch.cat([v[:, :, p0:p1], v[:, :, q0:q1]], 2)
            lq, lk = q1 - q0, kk.shape[2]
            keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
            outs.append(
                torch.nn.functional.scaled_dot_product_attention(
                    q[:, :, q0:q1], kk, vv, attn_mask=keep, enable_gqa=True
                )
            )
    return torch.cat(outs, 2).transpose(1, 2)


def _grads(out, inputs, seed=1):
    g = torch.randn(
        out.shape, device=out.device, generator=torch.Generator("cuda").manual_seed(seed)
    )
    return torch.autograd.grad((out.float() * g).sum(), inputs)


def _err(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def test_block_sdpa_runs_flash_or_efficient_kernels_and_matches_the_reference(monkeypatch):
    from torch.nn.attention.bias import CausalBias

    def no_mask(self, device=None):
        raise AssertionError("causal_lower_right fell back to a materialised mask")

    monkeypatch.setattr(CausalBias, "_materialize", no_mask)
    blocks = _blocks()
    q, k, v = _qkv(blocks[-1][1])
    cu = torch.tensor([0, blocks[-1][1]], dtype=torch.int32)  # host, as packed_attention_kwargs
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out, _ = varlen_sdpa_attention(
            None, q, k, v, None, cu_seq_lens_q=cu, paravt_blocks=blocks, paravt_masks={}
        )
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type.name == "CUDA"}
    attn = sorted(n for n in names if "flash" in n.lower() or "fmha" in n.lower())
    print("attention kernels:", attn)
    assert attn, sorted(names)
    ref = _reference(q, k, v, blocks)
    math = _math_bf16(q, k, v, blocks)
    e_ours, e_math = _err(out, ref), _err(math, ref)
    print(f"forward rel. error vs fp32: ours {e_ours:.3e}, bf16 math {e_math:.3e}")
    assert e_ours <= 2 * e_math + 1e-6
    g_ours = _grads(out, (q, k, v))
    g_ref = _grads(ref, (q, k, v))
    g_math = _grads(math, (q, k, v))
    for name, a, r, m in zip("qkv", g_ours, g_ref, g_math):
        e_a, e_m = _err(a, r), _err(m, r)
        print(f"d{name} rel. error vs fp32: ours {e_a:.3e}, bf16 math {e_m:.3e}")
        assert e_a <= 2 * e_m + 1e-6, name


def test_a_flash_attention_2_kernel_takes_the_varlen_call_with_a_bottom_right_mask():
    """torch's FlashAttention-2 varlen kernel over ``prefix_varlen_kwargs``' arguments (the
    call ``varlen_flash_attention`` makes) equals the reference: the contract the
    flash_attention_2 path relies on (separate query / key boundaries, bottom-right causal)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        pytest.skip(f"torch {torch.__version__} has no varlen_attn ({e})")
    blocks = _blocks()
    q, k, v = _qkv(blocks[-1][1], grad=False)
    kw = prefix_varlen_kwargs(blocks, q.device)
    idx = kw["paravt_key_index"]
    q3, k3, v3 = (x[0].transpose(0, 1) for x in (q, k, v))
    out = varlen_attn(
        q3, k3[idx], v3[idx], kw["cu_seq_lens_q"], kw["cu_seq_lens_k"],
        kw["max_length_q"], kw["max_length_k"], window_size=(-1, 0), enable_gqa=True,
    )  # fmt: skip
    ref = _reference(q, k, v, blocks)[0]
    e = _err(out, ref)
    print(f"torch varlen_attn (FA2) rel. error vs fp32 reference: {e:.3e}")
    assert e <= 1e-2


@pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is None, reason="flash-attn not installed"
)
def test_varlen_flash_attention_with_flash_attn_matches_the_reference():
    """The flash_attention_2 path itself (``varlen_flash_attention``, flash-attn's kernel)."""

    class Layer(torch.nn.Module):
        config = type("C", (), {"_attn_implementation": "paravt_varlen_flash_attention_2"})()

    blocks = _blocks()
    q, k, v = _qkv(blocks[-1][1])
    kw = prefix_varlen_kwargs(blocks, q.device)
    del kw["attention_mask"]
    out, _ = varlen_flash_attention(Layer(), q, k, v, None, **kw)
    ref = _reference(q, k, v, blocks)
    math = _math_bf16(q, k, v, blocks)
    e_ours, e_math = _err(out, ref), _err(math, ref)
    print(f"flash-attn varlen rel. error vs fp32: {e_ours:.3e} (bf16 math {e_math:.3e})")
    assert e_ours <= 2 * e_math + 1e-6
    for a, r in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
        assert _err(a, r) <= 2e-2
