"""All GPU benchmarks of paravt_kernels in one script; writes one JSON of results.

    python bench/gpu_kernels.py [--out gpu_kernels.json] [--quick]

Measures (CUDA events, median of a few repeats after a warm-up; the whole script takes well
under 5 minutes on an H100/H200):

* ``linear_logprob`` fwd+bwd at tokens 8192, d 4096, vocab 151936, bf16: TFLOP/s counted as
  ``6 * tokens * d * vocab`` (the useful work of logits + two gradient matmuls; our backward
  recomputes the logits, which is not counted), peak memory, and the time / memory ratios
  against Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` on the same inputs.
* ``linear_policy_loss`` fwd+bwd at the same shapes (GRPO bnpo/token-mean loss, clip 0.2, no
  KL): TFLOP/s counted as ``6 * tokens * d * vocab`` (the op runs exactly these three
  GEMM-equivalents: logits, dH, dW, per row chunk), peak memory, and the time / memory ratios against
  Liger-Kernel's ``LigerFusedLinearGRPOLoss`` (same loss, same inputs).
* ``policy_loss`` fwd+bwd (k3 KL, decoupled, seq-mean-token-mean) over 2^24 tokens in 4096
  sequences: achieved bandwidth (bytes the kernels must move / time) as a fraction of the
  device's peak DRAM bandwidth.

Without CUDA the script prints why and writes ``{"skipped": ...}``; it never fails for that.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

# Peak DRAM bandwidth (bytes/s) by device name, used when the driver does not report clocks.
PEAK_BW = {
    "H200": 4.8e12,
    "H100 SXM": 3.35e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,
    "A100": 2.0e12,
}


def _peak_bandwidth(dev: int) -> float:
    p = torch.cuda.get_device_properties(dev)
    clock = getattr(p, "memory_clock_rate", 0)  # kHz
    width = getattr(p, "memory_bus_width", 0)  # bits
    if clock and width:
        return 2.0 * clock * 1e3 * width / 8  # DDR: two transfers per clock
    for name, bw in PEAK_BW.items():
        if name in p.name:
            return bw
    return float("nan")


def _time_cuda(fn, repeats: int = 5, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def _peak_mem(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _vs_liger(res: dict, liger, flops: float, t_ours: float) -> None:
    """Time Liger's ``liger()`` fwd+bwd on the same inputs; its TFLOP/s, peak memory and our
    time / memory ratios against it go into ``res``."""
    t_liger = _time_cuda(liger)
    res.update(
        liger_seconds=t_liger,
        liger_tflops=flops / t_liger / 1e12,
        liger_peak_mem_bytes=_peak_mem(liger),
        time_ratio_vs_liger=t_ours / t_liger,
    )
    res["mem_ratio_vs_liger"] = res["peak_mem_bytes"] / max(res["liger_peak_mem_bytes"], 1)


def bench_linear_logprob(quick: bool) -> dict:
    from paravt_kernels import linear_logprob

    n, d, v = (2048, 4096, 151936) if quick else (8192, 4096, 151936)
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(n, d, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(v, d, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    gout = torch.randn(n, device="cuda", generator=g)

    def ours():
        h.grad = w.grad = None
        lp = linear_logprob(h, w, t)
        (lp * gout).sum().backward()

    res = {"tokens": n, "d": d, "vocab": v, "dtype": "bfloat16"}
    t_ours = _time_cuda(ours)
    flops = 6.0 * n * d * v
    res.update(seconds=t_ours, tflops=flops / t_ours / 1e12, peak_mem_bytes=_peak_mem(ours))
    # correctness spot-check against the naive bf16 path on a slice of tokens
    with torch.no_grad():
        m = 256
        lp = linear_logprob(h[:m], w, t[:m])
        naive = torch.log_softmax((h[:m] @ w.T).float(), -1).gather(1, t[:m, None]).squeeze(1)
        res["max_abs_diff_vs_naive_bf16"] = (lp - naive).abs().max().item()
    # gradients on a slice of rows against the naive path (fp32 logits, autograd)
    m = 256
    hs, ws = h[:m].detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (linear_logprob(hs, ws, t[:m]) * gout[:m]).sum().backward()
    hn, wn = h[:m].detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    lpn = torch.log_softmax((hn.float() @ wn.float().T), -1).gather(1, t[:m, None]).squeeze(1)
    (lpn * gout[:m]).sum().backward()
    res["grad_rel_err_vs_naive_fp32"] = {"hidden": _rel(hs.grad, hn.grad),
                                         "weight": _rel(ws.grad, wn.grad)}  # fmt: skip
    del hs, ws, hn, wn, lpn
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        lce = LigerFusedLinearCrossEntropyLoss(reduction="sum")

        def liger():
            h.grad = w.grad = None
            lce(w, h, t).backward()

        _vs_liger(res, liger, flops, t_ours)
    except Exception as e:  # liger missing or failing: report, keep going
        res["liger_error"] = f"{type(e).__name__}: {e}"
    return res


def bench_linear_policy_loss(quick: bool) -> dict:
    from paravt_kernels import linear_policy_loss

    n, d, v = (2048, 4096, 151936) if quick else (8192, 4096, 151936)
    b = 8
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(n, d, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(v, d, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    adv_seq = torch.randn(b, device="cuda", generator=g)
    adv = adv_seq.repeat_interleave(n // b)
    old = -torch.rand(n, device="cuda", generator=g) * 3 - 8
    mask = torch.ones(n, device="cuda")

    def ours():
        h.grad = w.grad = None
        loss, _, _, _ = linear_policy_loss(h, w, t, old, adv, mask, agg="token-mean")
        loss.backward()

    res = {"tokens": n, "d": d, "vocab": v, "dtype": "bfloat16", "gemm_equivalents": 3}
    t_ours = _time_cuda(ours)
    flops = 6.0 * n * d * v
    res.update(seconds=t_ours, tflops=flops / t_ours / 1e12, peak_mem_bytes=_peak_mem(ours))
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        lf = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="bnpo")

        def liger():
            h.grad = w.grad = None
            out = lf(h.view(b, n // b, d), w, t.view(b, n // b), mask.view(b, n // b), adv_seq,
                     old_per_token_logps=old.view(b, n // b))  # fmt: skip
            out[0].backward()

        with torch.no_grad():  # same loss value both ways (spot check)
            ours_loss = linear_policy_loss(h, w, t, old, adv, mask)[0]
            res["loss_abs_diff_vs_liger"] = abs(
                float(ours_loss) - float(lf(h.view(b, n // b, d), w, t.view(b, n // b),
                                            mask.view(b, n // b), adv_seq,
                                            old_per_token_logps=old.view(b, n // b))[0])
            )  # fmt: skip
        _vs_liger(res, liger, flops, t_ours)
        ours()
        gh, gw = h.grad.clone(), w.grad.clone()
        liger()
        res["grad_rel_err_vs_liger"] = {"hidden": _rel(gh, h.grad), "weight": _rel(gw, w.grad)}
    except Exception as e:  # liger missing or failing: report, keep going
        res["liger_error"] = f"{type(e).__name__}: {e}"
    return res


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32 (NaN stays NaN)."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def bench_policy_loss(quick: bool) -> dict:
    from paravt_kernels import policy_loss

    n, b = (1 << 22, 1024) if quick else (1 << 24, 4096)
    g = torch.Generator(device="cuda").manual_seed(0)
    old = -torch.rand(n, device="cuda", generator=g) * 3
    lp = (old + 0.1 * torch.randn(n, device="cuda", generator=g)).requires_grad_()
    prox = old + 0.05 * torch.randn(n, device="cuda", generator=g)
    ref = old + 0.05 * torch.randn(n, device="cuda", generator=g)
    adv = torch.randn(n, device="cuda", generator=g)
    mask = (torch.rand(n, device="cuda", generator=g) > 0.1).float()
    cu = torch.linspace(0, n, b + 1, device="cuda").long()

    def step():
        lp.grad = None
        loss, _ = policy_loss(lp, old, adv, mask, ref_logprob=ref, prox_logprob=prox,
                              behav_cap=2.0, kl_coef=0.01, kl_type="k3",
                              agg="seq-mean-token-mean", cu_seqlens=cu)  # fmt: skip
        loss.backward()

    sec = _time_cuda(step, repeats=10, warmup=3)
    # bytes the fused path must move: fwd reads 6 fp32 streams + writes the gradient, the
    # in-place scale reads+writes it, the backward reads it and writes d logprob.
    bytes_moved = n * 4 * (6 + 1 + 2 + 2)
    peak = _peak_bandwidth(torch.cuda.current_device())
    bw = bytes_moved / sec
    return {"tokens": n, "sequences": b, "seconds": sec, "bytes_moved": bytes_moved,
            "bandwidth_bytes_per_s": bw, "peak_bandwidth_bytes_per_s": peak,
            "fraction_of_peak": bw / peak}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_kernels.json")
    ap.add_argument("--quick", action="store_true", help="smaller shapes (smoke test)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        out = {"skipped": "no CUDA device: the GPU benchmarks need one"}
        print(out["skipped"])
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
        return 0
    os.environ.setdefault("PARAVT_IMPL", "triton")
    t0 = time.time()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        pass
    for name, fn in (
        ("linear_logprob", bench_linear_logprob),
        ("linear_policy_loss", bench_linear_policy_loss),
        ("policy_loss", bench_policy_loss),
    ):
        try:
            results[name] = fn(args.quick)
        except Exception as e:
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        print(name, json.dumps(results[name], indent=2), flush=True)
        torch.cuda.empty_cache()
    results["wall_seconds"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
