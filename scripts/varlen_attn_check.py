"""Step 3 of ``scripts/gpu_train_check.sh`` (issue 36): torch's own varlen attention
(``torch.nn.attention.varlen.varlen_attn``, FlashAttention-2 kernels, torch >= 2.10) against
the attention paravt runs today without flash-attn, on a real-size packed sequence mix.

    python scripts/varlen_attn_check.py --json OUT.json [--size real|tiny] [--reps 20]

Two cases, each the same packed rows through both paths (bf16 on CUDA):

- ``lm``: the language model's causal attention of one packed micro-batch (Qwen3-VL-8B: 32
  query heads, 8 key/value heads, head dim 128; ``algo.max_tokens_per_microbatch`` = 16,384
  tokens as one K = 64 main rollout, one K = 32 one and its crops' sub-agents) against
  ``paravt.models.forward.varlen_sdpa_attention`` (one causal SDPA call per sequence);
- ``vision``: the vision tower's non-causal attention within each temporal patch (16 heads,
  head dim 72, 784 rows per patch at 448 x 448: a K = 64 overview and 5 crops of 16 frames)
  against ``paravt.vision.encoder.varlen_attention`` with ``impl='sdpa'`` (one dense SDPA call
  per distinct segment length).

Reported per case: the largest and the relative (‖a − b‖ / ‖ref‖) difference of each path to
an fp32 reference computed by the SDPA path on upcast inputs, forward and forward + backward
times (CUDA events, median of ``--reps``) and the speed ratio. Where ``varlen_attn`` is missing
(torch < 2.10) or has no kernel for the device (CPU: it raises ``NotImplementedError``), the
case is reported ``skipped`` with the reason; the SDPA path still runs, so the script's own
code is exercised on any machine (``--size tiny`` for a CPU).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Sequence mixes: (lengths, heads, kv heads, head dim, causal).
SIZES: dict[str, dict[str, tuple[list[int], int, int, int, bool]]] = {
    "real": {
        # 16,384 tokens: a K=64 main rollout (~6.5k with 448x448 frames), a K=32 one (~3.4k),
        # sub-agents of 16-frame crops (~1.7k), and a tail.
        "lm": ([6560, 3360, 1664, 1664, 1664, 1472], 32, 8, 128, True),
        # Vision tower: 784 patches per temporal patch at 448x448 (32 of a K=64 overview, 8 of
        # each of 5 crops of 16 frames), non-causal.
        "vision": ([784] * (32 + 5 * 8), 16, 16, 72, False),
    },
    "tiny": {
        "lm": ([37, 11, 59, 5], 4, 2, 16, True),
        "vision": ([16] * 6 + [24] * 3, 2, 2, 16, False),
    },
}


def varlen_fn() -> tuple[Callable | None, str]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        return None, f"torch {torch.__version__} has no torch.nn.attention.varlen ({e})"
    return varlen_attn, ""


def _cu(lengths: list[int], device: torch.device) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return cu.to(device)


def sdpa_path(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], causal: bool
) -> torch.Tensor:
    """What paravt runs without flash-attn, ``(N, H, D)`` in and out."""
    scale = q.shape[-1] ** -0.5
    if causal:
        from paravt.models.forward import varlen_sdpa_attention

        cu = _cu(lengths, torch.device("cpu"))  # a host tensor, as packed_attention_kwargs
        out, _ = varlen_sdpa_attention(
            None, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            None, scaling=scale, cu_seq_lens_q=cu,
        )  # fmt: skip
        return out[0]
    from paravt.vision.encoder import VarlenPlan, varlen_attention

    by_len: dict[int, list[int]] = {}
    off = 0
    for n in lengths:
        by_len.setdefault(n, []).append(off)
        off += n
    groups = [
        (n, (torch.tensor(s)[:, None] + torch.arange(n)).reshape(-1).to(q.device))
        for n, s in sorted(by_len.items())
    ]
    plan = VarlenPlan(groups, _cu(lengths, q.device), max(lengths))
    return varlen_attention(q, k, v, plan, scale, impl="sdpa")


def timed(fn: Callable[[], Any], reps: int, cuda: bool) -> float:
    """Median milliseconds of ``fn`` (CUDA events on a GPU), after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_case(name: str, spec: tuple, device: torch.device, dtype: torch.dtype, reps: int) -> dict:
    lengths, h, hkv, d, causal = spec
    n = sum(lengths)
    cuda = device.type == "cuda"
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (
        torch.randn(n, hh, d, generator=g).to(device, dtype).requires_grad_()
        for hh in (h, hkv, hkv)
    )
    res: dict[str, Any] = {
        "tokens": n, "sequences": len(lengths), "max_len": max(lengths), "heads": h,
        "kv_heads": hkv, "head_dim": d, "causal": causal, "dtype": str(dtype),
    }  # fmt: skip
    # fp32 reference through the SDPA path on upcast inputs (repeated K/V for grouped heads).
    rep = h // hkv
    qf, kf, vf = q.detach().float(), k.detach().float(), v.detach().float()
    kf, vf = kf.repeat_interleave(rep, 1), vf.repeat_interleave(rep, 1)
    ref = sdpa_path(qf, kf, vf, lengths, causal)
    # The causal (LM) path broadcasts grouped K/V heads itself; the vision path has none.
    out_sdpa = sdpa_path(q, k, v, lengths, causal)

    def err(o: torch.Tensor) -> dict[str, float]:
        o = o.detach().float()
        return {
            "max_abs": float((o - ref).abs().max()),
            "rel": float((o - ref).norm() / ref.norm()),
        }

    res["sdpa_vs_fp32"] = err(out_sdpa)
    grad = torch.randn_like(out_sdpa)

    def sdpa_fwd() -> torch.Tensor:
        with torch.no_grad():
            return sdpa_path(q, k, v, lengths, causal)

    def sdpa_fwd_bwd() -> None:
        o = sdpa_path(q, k, v, lengths, causal)
        o.backward(grad)

    res["sdpa_fwd_ms"] = timed(sdpa_fwd, reps, cuda)
    res["sdpa_fwd_bwd_ms"] = timed(sdpa_fwd_bwd, reps, cuda)
    fn, why = varlen_fn()
    if fn is None:
        res["varlen"] = {"status": "skipped", "reason": why}
        return res
    cu = _cu(lengths, device)
    # The keyword API moved between releases: 2.10 has is_causal and no scale; later ones
    # scale and window_size (causal = (-1, 0)); grouped heads (enable_gqa) came later still.
    # Without enable_gqa the K/V heads are repeated inside the timed call (what paravt would
    # have to do there).
    params = inspect.signature(fn).parameters
    kw: dict[str, Any] = {}
    if "scale" in params:
        kw["scale"] = d**-0.5  # else its default, the same 1/sqrt(d)
    if causal:
        kw["window_size" if "window_size" in params else "is_causal"] = (
            (-1, 0) if "window_size" in params else True
        )
    gqa = hkv != h and "enable_gqa" in params
    if gqa:
        kw["enable_gqa"] = True
    res["varlen_kwargs"] = sorted(kw) + ([] if gqa or hkv == h else ["(K/V heads repeated)"])

    def varlen() -> torch.Tensor:
        kk, vv = (
            (k, v)
            if gqa or hkv == h
            else (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
        )
        return fn(q, kk, vv, cu, cu, max(lengths), max(lengths), **kw)

    try:
        out_v = varlen()
    except (NotImplementedError, RuntimeError, TypeError) as e:
        first = str(e).splitlines()[0].split(". ")[0][:200]  # torch's first sentence
        res["varlen"] = {
            "status": "skipped",
            "reason": f"varlen_attn does not run on {device.type} / {dtype}: "
            f"{type(e).__name__}: {first}",
        }
        return res
    vr: dict[str, Any] = {"status": "ok", "vs_fp32": err(out_v)}
    vr["vs_sdpa_max_abs"] = float((out_v.detach().float() - out_sdpa.detach().float()).abs().max())

    def v_fwd() -> None:
        with torch.no_grad():
            varlen()

    def v_fwd_bwd() -> None:
        varlen().backward(grad)

    vr["fwd_ms"] = timed(v_fwd, reps, cuda)
    vr["fwd_bwd_ms"] = timed(v_fwd_bwd, reps, cuda)
    vr["speedup_fwd"] = res["sdpa_fwd_ms"] / vr["fwd_ms"]
    vr["speedup_fwd_bwd"] = res["sdpa_fwd_bwd_ms"] / vr["fwd_bwd_ms"]
    # bf16 tolerance: varlen's error to fp32 within 2x SDPA's own (flash-attention's test rule).
    vr["within_tolerance"] = vr["vs_fp32"]["rel"] <= 2 * res["sdpa_vs_fp32"]["rel"] + 1e-6
    res["varlen"] = vr
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="")
    ap.add_argument("--size", choices=sorted(SIZES), default="")
    ap.add_argument("--device", default="")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    size = a.size or ("real" if device.type == "cuda" else "tiny")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    res: dict[str, Any] = {
        "torch": torch.__version__, "device": str(device), "size": size, "cases": {},
    }  # fmt: skip
    if device.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name(device)
    status = "ok"
    for name, spec in SIZES[size].items():
        try:
            r = run_case(name, spec, device, dtype, a.reps)
        except Exception as e:  # one case failing still reports the other
            r = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
            status = "failed"
        res["cases"][name] = r
        v = r.get("varlen", {})
        line = f"[varlen] {name}: {r.get('tokens', '?')} tokens, sdpa fwd {r.get('sdpa_fwd_ms', 0):.3f} ms"
        if v.get("status") == "ok":
            line += (
                f", varlen fwd {v['fwd_ms']:.3f} ms ({v['speedup_fwd']:.2f}x), fwd+bwd "
                f"{v['fwd_bwd_ms']:.3f} vs {r['sdpa_fwd_bwd_ms']:.3f} ms "
                f"({v['speedup_fwd_bwd']:.2f}x); rel err to fp32 varlen {v['vs_fp32']['rel']:.2e}, "
                f"sdpa {r['sdpa_vs_fp32']['rel']:.2e}"
            )
        else:
            line += (
                f"; varlen {v.get('status', r.get('status'))}: {v.get('reason', r.get('error'))}"
            )
        print(line, flush=True)
    if status == "ok" and all(
        c.get("varlen", {}).get("status") == "skipped" for c in res["cases"].values()
    ):
        status = "skipped"
        res["reason"] = next(iter(res["cases"].values()))["varlen"]["reason"]
    res["status"] = status
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0 if status != "failed" else 1


if __name__ == "__main__":
    sys.exit(main())
