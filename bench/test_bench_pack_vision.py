"""pack_vision (paravt._C) vs the HF path, and the packed vision forward vs a per-crop loop.

Workloads (uint8 RGB crops already resized to multiples of 32, as pack_vision takes them):
  * ``big``: 64 crops x 16 frames at 448x448 (401,408 patches; 2.4 GB float32 output).
    Peak memory ~8 GB (HF's intermediates); set PARAVT_BENCH_BIG_CROPS to shrink it.
  * ``small``: 256 crops, 2-8 frames, 32-128 px, non-square (a training step's sub-agent crops).

Baseline ("HF path"), measured in the same run on the same crops: the Qwen3-VL video
processor's ``_preprocess`` (normalise + patchify; its input conversion is skipped, which
flatters it) plus the vision model's metadata helpers exactly as ``Qwen3VLVisionModel.forward``
calls them (bilinear position-embedding taps, rotary position ids, cu_seqlens, max_seqlen).
Ours: ``pack_vision`` (native CPU op), which returns all of that in one call, measured four
ways: float32 output (bit-identical to HF) with the op's output pool warm (a freed output's
pages are reused: the steady state of a rollout loop), the same on the first call of the
process (cold pool: every output page faulted in), float32 into a caller's reused buffer, and
bfloat16 output (what the patch embedding casts to).
Reported: time ratios ours / HF (target <= 0.1), printed and in ``benchmark.extra_info``.

Encoder: ONE ``encode_packed`` forward of a tiny Qwen3-VL vision tower over 64 small crops vs
64 HF forwards (one per crop). On GPU also the CUDA pack vs the CPU pack.
"""

from __future__ import annotations

import gc
import os
import random
import time

import pytest
import torch

from paravt.vision import hf_reference as hf_ref
from paravt.vision import pack as pk
from paravt.vision.encoder import encode_packed

SPEC = dict(patch_size=16, temporal_patch_size=2, merge_size=2)
BIG_CROPS = int(os.environ.get("PARAVT_BENCH_BIG_CROPS", "64"))


@pytest.fixture(scope="module")
def hf_path():
    proc = hf_ref.video_processor(**SPEC)

    def run(crops):
        pixels, grid = hf_ref.hf_video_pixels(proc, crops)
        cu, pos, idx, wt, max_seqlen = hf_ref.hf_vision_metadata(
            grid, merge_size=2, num_position_embeddings=2304
        )
        return pixels, grid, cu, max_seqlen, pos, idx, wt

    return run


def _crops(kind: str) -> list[torch.Tensor]:
    rng = random.Random(0)
    if kind == "big":
        return [
            torch.randint(0, 256, (16, 448, 448, 3), dtype=torch.uint8) for _ in range(BIG_CROPS)
        ]
    return [
        torch.randint(
            0,
            256,
            (rng.randint(2, 8), rng.choice([32, 64, 96, 128]), rng.choice([32, 64, 96, 128]), 3),
            dtype=torch.uint8,
        )
        for _ in range(256)
    ]


def _best_of(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
        del out
    return best


@pytest.mark.parametrize("kind", ["small", "big"])
def test_bench_pack_vision_cpu_vs_hf(benchmark, hf_path, kind):
    if not pk.native_available():
        pytest.skip("paravt._C not built: nothing native to measure")
    crops = _crops(kind)
    rounds = 2 if kind == "big" else 5
    hf_s = _best_of(lambda: hf_path(crops), rounds)
    # First pack of this size in the process: its output buffer is freshly faulted in. Later
    # packs reuse a freed output's pages (paravt._C's output pool), as a rollout loop does.
    cold_s = _best_of(lambda: pk.pack_vision(crops, impl="native"), 1)
    benchmark.pedantic(lambda: pk.pack_vision(crops, impl="native"), rounds=rounds, iterations=1)
    ours_s = benchmark.stats.stats.min
    # Steady state of a pipeline: pack into one reused staging buffer (no page faults).
    buf = torch.empty_like(pk.pack_vision(crops, impl="native").pixel_values)
    reuse_s = _best_of(lambda: pk.pack_vision(crops, out=buf, impl="native"), rounds)
    # bf16 output (what the patch embedding casts to anyway): half the bytes written.
    bf16_s = _best_of(lambda: pk.pack_vision(crops, dtype=torch.bfloat16, impl="native"), rounds)
    n_patch = buf.shape[0]
    ratio, ratio_reuse, ratio_bf16 = ours_s / hf_s, reuse_s / hf_s, bf16_s / hf_s
    benchmark.extra_info.update(
        {
            "workload": kind,
            "crops": len(crops),
            "patches": n_patch,
            "hf_s": hf_s,
            "ours_s": ours_s,
            "ours_cold_s": cold_s,
            "ratio_cold": cold_s / hf_s,
            "ours_reused_buffer_s": reuse_s,
            "ratio": ratio,
            "ratio_reused_buffer": ratio_reuse,
            "ours_bf16_s": bf16_s,
            "ratio_bf16": ratio_bf16,
        }
    )
    print(
        f"\n[pack_vision {kind}] {len(crops)} crops, {n_patch} patches, "
        f"threads={torch.get_num_threads()}: HF path {hf_s * 1e3:.1f} ms, pack_vision "
        f"{ours_s * 1e3:.1f} ms (ratio {ratio:.3f}; first call, cold pool "
        f"{cold_s * 1e3:.1f} ms, ratio {cold_s / hf_s:.3f}), into a reused buffer {reuse_s * 1e3:.1f} ms "
        f"(ratio {ratio_reuse:.3f}), bf16 output {bf16_s * 1e3:.1f} ms (ratio {ratio_bf16:.3f}); "
        "target <= 0.1"
    )


def _tiny_visual(device: str):
    return hf_ref.tiny_vision_tower(
        hidden_size=64,
        num_heads=4,
        out_hidden_size=64,
        deepstack_visual_indexes=(1,),
        device=device,
    )


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_bench_packed_encoder_vs_per_crop(benchmark, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    visual = _tiny_visual(device)
    rng = random.Random(1)
    crops = [
        torch.randint(
            0,
            256,
            (rng.randint(2, 4), rng.choice([32, 64]), rng.choice([32, 64, 96]), 3),
            dtype=torch.uint8,
        )
        for _ in range(64)
    ]
    packed = pk.pack_vision(crops, **SPEC).to(device)
    singles = [pk.pack_vision([c], **SPEC).to(device) for c in crops]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def per_crop():
        with torch.no_grad():
            out = [visual(s.pixel_values, grid_thw=s.grid_thw).pooler_output for s in singles]
        sync()
        return out

    def packed_fwd():
        with torch.no_grad():
            out = encode_packed(visual, packed).embeds
        sync()
        return out

    per_crop(), packed_fwd()  # warm-up
    base_s = _best_of(per_crop, 5)
    benchmark.pedantic(packed_fwd, rounds=5, iterations=1)
    ours_s = benchmark.stats.stats.min
    speedup = base_s / ours_s
    benchmark.extra_info.update(
        {"device": device, "per_crop_s": base_s, "packed_s": ours_s, "speedup": speedup}
    )
    print(
        f"\n[encoder {device}] 64 crops: per-crop HF loop {base_s * 1e3:.1f} ms, packed "
        f"{ours_s * 1e3:.1f} ms, speed-up {speedup:.1f}x (GPU target >= 3x)"
    )


def test_bench_pack_vision_cuda_vs_cpu(benchmark, hf_path):
    """The CUDA pack of 256 small crops vs the native CPU pack and vs the HF path (the video
    processor + the vision model's metadata helpers, on CPU as an HF pipeline runs them), all
    three on the same crops in this run."""
    if not torch.cuda.is_available() or not pk.native_has_cuda():
        pytest.skip("needs a CUDA device and paravt._C built with CUDA")
    cpu_crops = _crops("small")
    gpu_crops = [c.cuda() for c in cpu_crops]
    cpu_s = _best_of(lambda: pk.pack_vision(cpu_crops, impl="native"), 5)
    hf_s = _best_of(lambda: hf_path(cpu_crops), 3)

    def gpu():
        out = pk.pack_vision(gpu_crops, impl="native")
        torch.cuda.synchronize()
        return out

    gpu()
    benchmark.pedantic(gpu, rounds=10, iterations=1)
    cuda_s = benchmark.stats.stats.min
    ratio, hf_ratio = cuda_s / cpu_s, cuda_s / hf_s
    benchmark.extra_info.update(
        {"cpu_s": cpu_s, "hf_s": hf_s, "cuda_s": cuda_s, "ratio": ratio, "ratio_vs_hf": hf_ratio}
    )
    print(
        f"\n[pack_vision cuda] 256 crops: HF path {hf_s * 1e3:.1f} ms, CPU pack "
        f"{cpu_s * 1e3:.1f} ms, CUDA pack {cuda_s * 1e3:.2f} ms: CUDA/CPU {ratio:.3f}, "
        f"CUDA/HF {hf_ratio:.4f}"
    )
