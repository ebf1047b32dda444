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


# Where the sections run: "cuda", or "cpu" for the dry run (``--dry``: every section at tiny
# shapes through the same code, so that a broken section shows in CI, not on the device).
DEV = "cuda"


def _lm_shape(quick: bool) -> tuple[int, int, int]:
    """``(tokens, d, vocab)`` of the linear_* sections (docs/gpu's shapes)."""
    if DEV == "cpu":
        return 64, 32, 1000
    return (2048, 4096, 151936) if quick else (8192, 4096, 151936)


def _policy_shape(quick: bool) -> tuple[int, int]:
    """``(tokens, sequences)`` of the policy_loss sections."""
    if DEV == "cpu":
        return 4096, 16
    return (1 << 22, 1024) if quick else (1 << 24, 4096)


def _cuda_times(fn, repeats: int = 5, warmup: int = 2) -> list[float]:
    """Seconds of ``repeats`` CUDA-event-timed calls after ``warmup`` calls, sorted (host
    clock in the dry run)."""
    if DEV == "cpu":  # one call: the dry run checks the code, not the time
        repeats, warmup = 1, 0
        for _ in range(warmup):
            fn()
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return sorted(out)
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
    return sorted(times)


def _time_cuda(fn, repeats: int = 5, warmup: int = 2) -> float:
    times = _cuda_times(fn, repeats, warmup)
    return times[len(times) // 2]


def _peak_mem(fn) -> int:
    """Peak CUDA bytes allocated by ``fn`` over what was allocated before (0 in the dry run:
    the CPU allocator keeps no peak)."""
    if DEV == "cpu":
        return 0
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


def _lm_inputs(quick: bool) -> tuple:
    """The lm-head benchmarks' inputs: ``(n, d, v, h, w, targets, grad_out)``, seeded."""
    n, d, v = _lm_shape(quick)
    g = torch.Generator(device=DEV).manual_seed(0)
    h = (torch.randn(n, d, device=DEV, generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(v, d, device=DEV, generator=g) * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), device=DEV, generator=g)
    gout = torch.randn(n, device=DEV, generator=g)
    return n, d, v, h, w, t, gout


def bench_linear_logprob(quick: bool) -> dict:
    from paravt_kernels import linear_logprob

    n, d, v, h, w, t, gout = _lm_inputs(quick)

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


def _liger_grpo(h, w, t, mask, adv_seq, old, b: int) -> tuple:
    """Liger's ``LigerFusedLinearGRPOLoss`` as shipped (bnpo, no KL) on the packed inputs
    viewed as ``b`` equal sequences: ``(the loss module, one forward + backward)``."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    n, d = h.shape
    lf = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="bnpo")

    def liger() -> None:
        h.grad = w.grad = None
        out = lf(h.view(b, n // b, d), w, t.view(b, n // b), mask.view(b, n // b), adv_seq,
                 old_per_token_logps=old.view(b, n // b))  # fmt: skip
        out[0].backward()

    return lf, liger


def _linear_policy_inputs(quick: bool) -> tuple:
    """The linear-policy-loss shapes of docs/gpu (tokens 8192, or 2048 with ``quick``; d 4096;
    vocab 151,936; 8 sequences), bf16 on CUDA, seed 0: ``(n, d, v, b, h, w, t, adv_seq, adv,
    old, mask)``."""
    n, d, v = _lm_shape(quick)
    b = 8
    g = torch.Generator(device=DEV).manual_seed(0)
    h = (torch.randn(n, d, device=DEV, generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(v, d, device=DEV, generator=g) * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), device=DEV, generator=g)
    adv_seq = torch.randn(b, device=DEV, generator=g)
    adv = adv_seq.repeat_interleave(n // b)
    old = -torch.rand(n, device=DEV, generator=g) * 3 - 8
    mask = torch.ones(n, device=DEV)
    return n, d, v, b, h, w, t, adv_seq, adv, old, mask


def bench_linear_policy_loss(quick: bool) -> dict:
    from paravt_kernels import linear_policy_loss

    n, d, v, b, h, w, t, adv_seq, adv, old, mask = _linear_policy_inputs(quick)

    def ours():
        h.grad = w.grad = None
        loss, _, _, _ = linear_policy_loss(h, w, t, old, adv, mask, agg="token-mean")
        loss.backward()

    res = {"tokens": n, "d": d, "vocab": v, "dtype": "bfloat16", "gemm_equivalents": 3}
    t_ours = _time_cuda(ours)
    flops = 6.0 * n * d * v
    res.update(seconds=t_ours, tflops=flops / t_ours / 1e12, peak_mem_bytes=_peak_mem(ours))
    try:
        lf, liger = _liger_grpo(h, w, t, mask, adv_seq, old, b)

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

    n, b = _policy_shape(quick)
    g = torch.Generator(device=DEV).manual_seed(0)
    old = -torch.rand(n, device=DEV, generator=g) * 3
    lp = (old + 0.1 * torch.randn(n, device=DEV, generator=g)).requires_grad_()
    prox = old + 0.05 * torch.randn(n, device=DEV, generator=g)
    ref = old + 0.05 * torch.randn(n, device=DEV, generator=g)
    adv = torch.randn(n, device=DEV, generator=g)
    mask = (torch.rand(n, device=DEV, generator=g) > 0.1).float()
    cu = torch.linspace(0, n, b + 1, device=DEV).long()

    def step():
        lp.grad = None
        loss, _ = policy_loss(lp, old, adv, mask, ref_logprob=ref, prox_logprob=prox,
                              behav_cap=2.0, kl_coef=0.01, kl_type="k3",
                              agg="seq-mean-token-mean", cu_seqlens=cu)  # fmt: skip
        loss.backward()

    sec = _time_cuda(step, repeats=10, warmup=3)
    # bytes the three kernels must move (policy_loss_triton.policy_loss_bytes): the forward
    # reads 6 fp32 streams and writes the gradient buffer, the backward reads it and writes
    # d logprob: 36 B/token (this bench counted 44 before issue 37: an in-place scaling pass
    # that the fused backward no longer makes) + O(B) partials.
    from paravt_kernels import policy_loss_triton as pl
    from paravt_kernels.options import PolicyTokens

    split, _ = pl._launch_shape(n, b, lp.device)
    per_token, fixed = pl.policy_loss_bytes(lp, PolicyTokens(old, adv, mask, ref, prox), cu,
                                            None, split)  # fmt: skip
    bytes_moved = per_token * n + fixed
    peak = _peak_bandwidth(torch.cuda.current_device()) if DEV == "cuda" else float("nan")
    bw = bytes_moved / sec
    return {"tokens": n, "sequences": b, "seconds": sec, "bytes_moved": bytes_moved,
            "bytes_per_token": per_token,
            "bandwidth_bytes_per_s": bw, "peak_bandwidth_bytes_per_s": peak,
            "fraction_of_peak": bw / peak}  # fmt: skip


# --------------------------------------------------------------------------------------------
# issue 37: launches, byte model, host cost, CUDA graph, tile sweep, baselines
# --------------------------------------------------------------------------------------------
def _skip(reason: str) -> dict:
    return {"skipped": reason}


def _cuda_kernels_per_call(fn) -> dict:
    """CUDA kernels one call of ``fn`` runs on the device (torch.profiler's CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"cuda_kernels": len(names), "cuda_kernel_names": sorted(set(names))}


def _policy_loss_inputs(n: int, b: int, device: str) -> dict[str, torch.Tensor]:
    """The policy_loss inputs of the issue-37 sections (seed 0): ``lp`` (with grad), ``old``,
    ``prox``, ``ref``, ``adv``, ``mask`` over ``n`` tokens and ``cu`` of ``b`` equal
    sequences. (Named apart from :func:`_linear_policy_inputs`: one name for both once
    shadowed the first, and every section that used it raised a TypeError.)"""
    g = torch.Generator(device=device).manual_seed(0)
    old = -torch.rand(n, device=device, generator=g) * 3
    return {
        "lp": (old + 0.1 * torch.randn(n, device=device, generator=g)).requires_grad_(),
        "old": old,
        "prox": old + 0.05 * torch.randn(n, device=device, generator=g),
        "ref": old + 0.05 * torch.randn(n, device=device, generator=g),
        "adv": torch.randn(n, device=device, generator=g),
        "mask": (torch.rand(n, device=device, generator=g) > 0.1).float(),
        "cu": torch.linspace(0, n, b + 1, device=device).long(),
    }


def issue37_policy_loss(quick: bool) -> dict:
    """Item 1: launches per call (Triton + torch ops, and CUDA kernels on the device), the
    byte model and the bandwidth it gives (min / median / max of 20 runs: the run-to-run
    spread), a sweep of the forward kernel's (BLOCK, warps), the op registration's host cost,
    and a CUDA graph of the two implementation calls against eager at 2^24 and 2^16 tokens.
    Without CUDA: the CPU parts (interpreter launch count, byte model, host cost on meta
    tensors, sm_90 registers)."""
    from paravt_kernels import policy_loss_triton as pl
    from paravt_kernels.options import PolicyLossOptions, PolicyTokens
    from paravt_kernels.profiling import (
        count_launches,
        policy_loss_op_host_cost,
        sm90_registers,
    )

    res: dict = {"host_cost_meta": policy_loss_op_host_cost("meta")}
    types = {n: "*fp32" for n in ("lp_ptr", "old_ptr", "adv_ptr", "mask_ptr", "ref_ptr",
                                   "prox_ptr", "gbuf_ptr", "part_ptr")}  # fmt: skip
    types.update(cu_ptr="*i64", n_slots="i64", n_seq="i64", n_total="i64")
    for f in ("clip_low", "clip_high", "dual_clip", "behav_cap", "kl_coef", "k3_clamp",
              "k3_kl_clamp", "lr_clamp"):  # fmt: skip
        types[f] = "fp32"
    configs = ((512, 8), (256, 4), (512, 4), (1024, 4))
    base = {"SPLIT": 1, "HAS_CU": True, "HAS_REF": True, "HAS_PROX": True, "HAS_DUAL": False,
            "HAS_CAP": True, "KL_TYPE": 3}  # fmt: skip
    try:
        got = sm90_registers([(pl._policy_loss_fwd_kernel, types, {**base, "BLOCK": blk}, wp)
                              for blk, wp in configs])  # fmt: skip
        regs = {f"{blk}x{wp}": r for (blk, wp), r in zip(configs, got)}
    except Exception as e:
        regs = {"error": f"{type(e).__name__}: {e}"}
    res["sm90_registers"] = regs
    cuda = DEV == "cuda"
    dev = "cuda" if cuda else "cpu"
    n, b = _policy_shape(quick) if cuda else (4096, 16)
    if not cuda:  # the Triton kernels in the interpreter: the same launches as on a GPU
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["PARAVT_IMPL"] = "triton"
    x = _policy_loss_inputs(n, b, dev)
    seed = torch.ones((), device=dev)
    from paravt_kernels.profiling import policy_loss_step

    step = policy_loss_step(x, seed)
    step()
    c = count_launches(step)
    res["launches"] = {"triton": c.triton, "torch_ops": c.torch_ops, "total": c.total}
    tok = PolicyTokens(x["old"], x["adv"], x["mask"], x["ref"], x["prox"])
    split, _ = pl._launch_shape(n, b, x["lp"].device)
    per_token, fixed = pl.policy_loss_bytes(x["lp"], tok, x["cu"], None, split)
    res.update(tokens=n, sequences=b, bytes_per_token=per_token, bytes_fixed=fixed,
               bytes_moved=per_token * n + fixed,
               bytes_checked_vs_launch_args=c.tensor_bytes(n) == per_token * n)  # fmt: skip
    if not cuda:
        res["gpu"] = "skipped: no CUDA device"
        return res
    try:
        res.update(_cuda_kernels_per_call(step))
    except Exception as e:  # a profiler without CUDA activity: keep the rest
        res["cuda_kernels_error"] = f"{type(e).__name__}: {e}"
    peak = _peak_bandwidth(torch.cuda.current_device())

    def bw_stats(fn, moved: int = per_token * n + fixed) -> dict:
        ts = _cuda_times(fn, repeats=20, warmup=3)
        return {"seconds_min": ts[0], "seconds_median": ts[10], "seconds_max": ts[-1],
                "fraction_of_peak_median": moved / ts[10] / peak,
                "fraction_of_peak_best": moved / ts[0] / peak}  # fmt: skip

    res["peak_bandwidth_bytes_per_s"] = peak
    res["autograd_call"] = bw_stats(step)
    sweep = {}
    keep = (pl._GPU_BLOCK, pl._FWD_WARPS)
    for block, warps in ((512, 8), (256, 4), (512, 4), (1024, 4), (1024, 8)):
        pl._GPU_BLOCK, pl._FWD_WARPS = block, warps
        try:
            sweep[f"{block}x{warps}"] = bw_stats(step)
        except Exception as e:
            sweep[f"{block}x{warps}"] = {"error": f"{type(e).__name__}: {e}"}
    pl._GPU_BLOCK, pl._FWD_WARPS = keep
    res["block_warps_sweep"] = sweep
    res["host_cost_cuda_4096_tokens"] = policy_loss_op_host_cost("cuda", "triton", 4096)
    # CUDA graph of the implementation (no autograd wrapper): forward + backward at static
    # shapes, against the same two calls eager, at 2^24 and 2^16 tokens
    opts = PolicyLossOptions(clip_low=0.2, clip_high=0.2, behav_cap=2.0, kl_coef=0.01,
                             kl_type="k3", agg="seq-mean-token-mean")  # fmt: skip
    graphs = {}
    for nn_, bb in ((n, b), (1 << 16, 64)):
        y = _policy_loss_inputs(nn_, bb, "cuda")
        lp = y["lp"].detach()
        tk = PolicyTokens(y["old"], y["adv"], y["mask"], y["ref"], y["prox"])

        def impl(lp=lp, tk=tk, y=y):
            _, gbuf, coef, _ = pl.policy_loss_fused_triton(lp, tk, y["cu"], None, opts)
            return pl.policy_loss_grad_triton(gbuf, coef, y["cu"], seed, lp.dtype)

        sp, _ = pl._launch_shape(nn_, bb, lp.device)
        moved = per_token * nn_ + pl.policy_loss_bytes(lp, tk, y["cu"], None, sp)[1]
        eager = bw_stats(impl, moved)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                impl()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            impl()
        replay = bw_stats(graph.replay, moved)
        graphs[f"tokens_{nn_}"] = {"eager_impl": eager, "graph_replay": replay,
                                   "graph_over_eager_median": replay["seconds_median"]
                                   / eager["seconds_median"]}  # fmt: skip
    res["cuda_graph"] = graphs
    return res


def issue37_linear_logprob_tiles(quick: bool) -> dict:
    """Item 2: ``linear_logprob`` fwd+bwd TFLOP/s (6 N d V counted) and peak memory per
    logits-tile size, against Liger's fused linear cross-entropy's peak in the same run."""
    if DEV is None:
        return _skip("no CUDA device")
    from paravt_kernels import linear_logprob
    from paravt_kernels import linear_logprob_triton as llt

    n, d, v, h, w, t, gout = _lm_inputs(quick)
    flops = 6.0 * n * d * v

    def ours():
        h.grad = w.grad = None
        (linear_logprob(h, w, t) * gout).sum().backward()

    res: dict = {"tokens": n, "d": d, "vocab": v}
    keep = llt.LOGITS_TILE_BYTES
    for mib in (32, 64, 128, 256):
        llt.LOGITS_TILE_BYTES = mib << 20
        try:
            sec = _time_cuda(ours)
            res[f"tile_{mib}MiB"] = {"seconds": sec, "tflops": flops / sec / 1e12,
                                     "peak_mem_bytes": _peak_mem(ours)}  # fmt: skip
        except Exception as e:
            res[f"tile_{mib}MiB"] = {"error": f"{type(e).__name__}: {e}"}
    llt.LOGITS_TILE_BYTES = keep
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        lce = LigerFusedLinearCrossEntropyLoss(reduction="sum")

        def liger():
            h.grad = w.grad = None
            lce(w, h, t).backward()

        res["liger_flce_seconds"] = _time_cuda(liger)
        res["liger_flce_peak_mem_bytes"] = _peak_mem(liger)
        for k, r in list(res.items()):
            if k.startswith("tile_") and "peak_mem_bytes" in r:
                r["mem_ratio_vs_liger_flce"] = (
                    r["peak_mem_bytes"] / res["liger_flce_peak_mem_bytes"]
                )
    except Exception as e:
        res["liger_error"] = f"{type(e).__name__}: {e}"
    return res


def issue37_baselines(quick: bool) -> dict:
    """Item 4: the baselines at the ``linear_policy_loss`` shapes, fwd+bwd, TFLOP/s counted as
    6 N d V and peak memory, in one run: Liger's GRPO loss as shipped and with TF32 allowed,
    the full-logits no-fusion path (one bf16 cuBLAS GEMM, log-softmax in fp32, gather,
    policy_loss), QuACK's chunked linear cross-entropy, Apple's cut-cross-entropy; ours
    (``linear_policy_loss``, ``linear_logprob`` + ``policy_loss``) against the fastest."""
    if DEV is None:
        return _skip("no CUDA device")
    from paravt_kernels import linear_logprob, linear_policy_loss, policy_loss

    n, d, v, b, h, w, t, adv_seq, adv, old, mask = _linear_policy_inputs(quick)
    flops = 6.0 * n * d * v

    def measure(fn) -> dict:
        sec = _time_cuda(fn)
        return {"seconds": sec, "tflops": flops / sec / 1e12, "peak_mem_bytes": _peak_mem(fn)}

    def ours_fused():
        h.grad = w.grad = None
        linear_policy_loss(h, w, t, old, adv, mask, agg="token-mean")[0].backward()

    def ours_pair():
        h.grad = w.grad = None
        lp = linear_logprob(h, w, t)
        policy_loss(lp, old, adv, mask, agg="token-mean")[0].backward()

    def full_logits():
        h.grad = w.grad = None
        z = h @ w.T  # one bf16 cuBLAS GEMM, (n, V) bf16
        lp = torch.log_softmax(z.float(), -1).gather(1, t[:, None]).squeeze(1)
        policy_loss(lp, old, adv, mask, agg="token-mean")[0].backward()

    res: dict = {"tokens": n, "d": d, "vocab": v, "dtype": "bfloat16"}
    base: dict = {}
    for name, fn in (("ours_linear_policy_loss", ours_fused), ("ours_linear_logprob_pair",
                     ours_pair)):  # fmt: skip
        try:
            res[name] = measure(fn)
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {e}"}
    try:
        base["full_logits_bf16_gemm"] = measure(full_logits)
    except Exception as e:
        base["full_logits_bf16_gemm"] = {"error": f"{type(e).__name__}: {e}"}
    try:
        _, liger = _liger_grpo(h, w, t, mask, adv_seq, old, b)

        base["liger_grpo_shipped"] = measure(liger)
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True  # its fp32 backward GEMMs on TF32
        try:
            base["liger_grpo_tf32"] = measure(liger)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
    except Exception as e:
        base["liger_grpo_shipped"] = base["liger_grpo_tf32"] = _skip(f"{type(e).__name__}: {e}")
    try:
        from quack.linear_cross_entropy import chunked_linear_cross_entropy

        def quack():
            h.grad = w.grad = None
            chunked_linear_cross_entropy(h, w, t, reduction="sum").backward()

        base["quack_linear_cross_entropy"] = measure(quack)
    except ImportError as e:
        base["quack_linear_cross_entropy"] = _skip(
            f"quack-kernels not importable ({e}); its nvidia-cutlass-dsl-libs-cu12 wheel "
            "(91.7 MB) is over the device tool's 64 MiB per call"
        )
    except Exception as e:
        base["quack_linear_cross_entropy"] = {"error": f"{type(e).__name__}: {e}"}
    try:
        from cut_cross_entropy import linear_cross_entropy

        def cce():
            h.grad = w.grad = None
            linear_cross_entropy(h, w, t, reduction="sum", impl="cce").backward()

        base["cut_cross_entropy"] = measure(cce)
    except ImportError as e:
        base["cut_cross_entropy"] = _skip(f"cut-cross-entropy not importable ({e})")
    except Exception as e:
        base["cut_cross_entropy"] = {"error": f"{type(e).__name__}: {e}"}
    res["baselines"] = base
    timed = {k: r["seconds"] for k, r in base.items() if "seconds" in r}
    if timed:
        best = min(timed, key=timed.get)
        res["strongest_baseline"] = best
        for name in ("ours_linear_policy_loss", "ours_linear_logprob_pair"):
            if "seconds" in res.get(name, {}):
                res[name]["time_ratio_vs_strongest"] = res[name]["seconds"] / timed[best]
                res[name]["mem_ratio_vs_strongest"] = res[name]["peak_mem_bytes"] / max(
                    base[best]["peak_mem_bytes"], 1
                )
    return res


ISSUE37 = (
    ("policy_loss_launches_bytes_graph", issue37_policy_loss),
    ("linear_logprob_tiles", issue37_linear_logprob_tiles),
    ("baselines", issue37_baselines),
)


DEFAULT = (
    ("linear_logprob", bench_linear_logprob),
    ("linear_policy_loss", bench_linear_policy_loss),
    ("policy_loss", bench_policy_loss),
)
# Issue 49's three kernel targets, each with its baselines in the same run: policy_loss's
# bandwidth and launches (the issue-37 section), linear_logprob's peak memory against Liger's
# FLCE, linear_policy_loss's TFLOP/s against Liger's GRPO loss and the other baselines.
TARGETS = (
    ("policy_loss_launches_bytes_graph", issue37_policy_loss),
    ("linear_logprob", bench_linear_logprob),
    ("linear_policy_loss", bench_linear_policy_loss),
    ("baselines", issue37_baselines),
)
POLICY_LOSS_BW_TARGET = 0.70  # fraction of peak HBM bandwidth, fwd + bwd
POLICY_LOSS_LAUNCH_TARGET = 2  # CUDA kernels per fwd + bwd call
LINEAR_LOGPROB_MEM_TARGET = 3.0  # peak memory over Liger FLCE's, same inputs
LINEAR_POLICY_LOSS_TFLOPS_TARGET = 680.0  # fwd + bwd, 6 N d V counted


def targets(r: dict) -> dict:
    """The three kernel targets read off the sections' results: per target the measured
    value, the target and ``met`` (``None`` where the run did not measure it)."""

    def judge(x, ok) -> bool | None:
        return None if x is None else bool(ok(x))

    pl = r.get("policy_loss_launches_bytes_graph", {})
    frac = pl.get("autograd_call", {}).get("fraction_of_peak_median")
    kernels = pl.get("cuda_kernels")
    mem = r.get("linear_logprob", {}).get("mem_ratio_vs_liger")
    tf = r.get("linear_policy_loss", {}).get("tflops") if DEV == "cuda" else None
    out = {
        "policy_loss_bandwidth": {
            "fraction_of_peak_median": frac,
            "cuda_kernels_per_call": kernels,
            "launches_counted": pl.get("launches", {}).get("total"),
            "target": f">= {POLICY_LOSS_BW_TARGET} of peak HBM bandwidth in "
            f"<= {POLICY_LOSS_LAUNCH_TARGET} CUDA kernels",
            "met": None
            if frac is None or kernels is None
            else frac >= POLICY_LOSS_BW_TARGET and kernels <= POLICY_LOSS_LAUNCH_TARGET,
        },
        "linear_logprob_memory": {
            "mem_ratio_vs_liger_flce": mem,
            "target": f"<= {LINEAR_LOGPROB_MEM_TARGET}x Liger FLCE's peak memory",
            "met": judge(mem if DEV == "cuda" else None, lambda x: x <= LINEAR_LOGPROB_MEM_TARGET),
        },
        "linear_policy_loss_tflops": {
            "tflops": tf,
            "target": f">= {LINEAR_POLICY_LOSS_TFLOPS_TARGET} TFLOP/s",
            "met": judge(tf, lambda x: x >= LINEAR_POLICY_LOSS_TFLOPS_TARGET),
        },
    }
    return out


def section_errors(results: dict) -> list[str]:
    """What went wrong in a run: every section that raised, and on CUDA every baseline or
    Liger comparison that raised (a missing wheel: the comparison the run is for is then not
    made). In the dry run Liger's Triton kernels cannot take CPU tensors: not counted there."""
    errs = []
    for name, r in results.items():
        if not isinstance(r, dict):
            continue
        if "error" in r:
            errs.append(f"{name}: {r['error']}")
        if DEV == "cuda":
            if "liger_error" in r:
                errs.append(f"{name}: Liger: {r['liger_error']}")
            for b, v in r.get("baselines", {}).items():
                if isinstance(v, dict) and "error" in v:
                    errs.append(f"{name}/{b}: {v['error']}")
    return errs


def main(argv: list[str] | None = None) -> int:
    global DEV
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_kernels.json")
    ap.add_argument("--quick", action="store_true", help="smaller shapes (smoke test)")
    ap.add_argument("--issue37", action="store_true",
                    help="only the issue-37 sections (launches, byte model, host cost, CUDA "
                         "graph, tile sweep, baselines); their CPU parts run without CUDA")  # fmt: skip
    ap.add_argument(
        "--targets",
        action="store_true",
        help="the three kernel targets with their baselines (issue 49)",
    )
    ap.add_argument("--all", action="store_true", help="every section once")
    ap.add_argument("--dry", action="store_true",
                    help="on the CPU at tiny shapes, through the same code (CI)")  # fmt: skip
    args = ap.parse_args(argv)
    DEV = "cuda" if torch.cuda.is_available() else ("cpu" if args.dry else None)
    if args.all:
        names = dict(DEFAULT + TARGETS + ISSUE37)
        return _run_sections(args, tuple(names.items()))
    if args.targets:
        return _run_sections(args, TARGETS)
    if args.issue37:
        return _run_sections(args, ISSUE37)
    if DEV is None:
        out = {"skipped": "no CUDA device: the GPU benchmarks need one"}
        print(out["skipped"])
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
        return 0
    return _run_sections(args, DEFAULT)


def _run_sections(args, sections) -> int:
    """Runs each ``(name, fn)``; an exception is recorded as that section's ``error`` and the
    next section still runs. The JSON at ``args.out`` is rewritten after every section (a run
    cut by its time limit keeps what it measured), with ``targets`` and ``errors``. Exits 1
    when :func:`section_errors` finds any."""
    if DEV == "cuda":
        os.environ.setdefault("PARAVT_IMPL", "triton")
    t0 = time.time()
    results = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
               "dry": DEV == "cpu", "torch": torch.__version__}  # fmt: skip
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        pass

    def write() -> None:
        results["targets"] = targets(results)
        results["errors"] = section_errors(results)
        results["wall_seconds"] = time.time() - t0
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2, default=str)

    results["section_seconds"] = {}
    for name, fn in sections:
        t_s = time.time()
        try:
            results[name] = fn(args.quick)
        except Exception as e:
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        results["section_seconds"][name] = round(time.time() - t_s, 2)
        print(name, json.dumps(results[name], indent=2, default=str), flush=True)
        if DEV == "cuda":
            torch.cuda.empty_cache()
        write()
    write()
    print("targets", json.dumps(results["targets"], indent=2), flush=True)
    print(f"wrote {args.out}")
    if results["errors"]:
        print("section errors:\n  " + "\n  ".join(results["errors"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
