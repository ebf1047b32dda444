"""Measurement helpers for the kernel benchmarks.

``peak_cpu_alloc_bytes`` measures what torch's CPU allocator hands out: it runs ``fn`` under
``torch.profiler`` with ``profile_memory=True``, which records one signed event per CPU
allocation (+bytes) and free (-bytes), sorts them by time and returns the peak of their
running sum: the largest amount of *additional* torch memory live at any moment during
``fn`` (tensors that exist before the call are not counted; tensors ``fn`` frees that were
allocated before are, as negative steps). ``tracemalloc`` cannot do this (torch allocates
outside Python's allocator) and process RSS is blurred by the allocator's caching.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def peak_cpu_alloc_bytes(fn: Callable[[], object]) -> int:
    """Peak additional bytes allocated by torch on the CPU while ``fn()`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    events.sort()
    cur = peak = 0
    for _, nbytes in events:
        cur += nbytes
        peak = max(peak, cur)
    return peak


def median_seconds(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def report_ratios(
    benchmark: object,
    title: str,
    shape: str,
    baseline: str,
    seconds: tuple[float, float],
    peak_bytes: tuple[int, int],
) -> dict[str, object]:
    """The benchmarks' one report of ours against a baseline measured in the same run:
    ``seconds`` / ``peak_bytes`` are ``(ours, baseline)``. Puts the times, peaks and their
    ratios (ours / baseline, lower is better) in ``benchmark.extra_info`` (pytest-benchmark's
    JSON) and prints them; returns them."""
    (t_ours, t_base), (m_ours, m_base) = seconds, peak_bytes
    info: dict[str, object] = {
        "shape": shape,
        "baseline": baseline,
        "ours_s": t_ours,
        "baseline_s": t_base,
        "time_ratio": t_ours / t_base,
        "ours_peak_mib": m_ours / 2**20,
        "baseline_peak_mib": m_base / 2**20,
        "mem_ratio": m_ours / m_base,
    }
    benchmark.extra_info.update(info)  # type: ignore[attr-defined]
    print(
        f"\n{title} vs {baseline}: "
        + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items())
    )
    return info
