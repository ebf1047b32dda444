"""HFEngine throughput: one batched call vs one call per request, same requests and seeds.

What is measured: wall time of ``HFEngine.generate`` for 8 video prompts (tiny Qwen3-VL on the
CPU, or the GPU when present), 32 new tokens each at temperature 0.7, prompts of 8 or 16
frames at 64x64 (64-128 video tokens + timestamps, 88-152 prompt tokens). *batched*: the 8
requests in one call (one vision forward, one left-padded prefill, 32 batched decode steps);
*sequential*: the same 8 requests one call each. Requests carry seeds, so both modes produce
the same tokens (checked), and the ratio is pure batching gain.

A second benchmark measures the vision de-duplication of a GRPO group (8 rollouts sharing
one overview clip object) against the same requests holding copies.

Run: ``pytest bench/test_bench_hf_engine.py --benchmark-only -s``.
"""

from __future__ import annotations

import time

import pytest
import torch

from paravt.models import build_tiny_checkpoint, load_model
from paravt.rollout.engine import GenerationRequest, SamplingParams
from paravt.rollout.hf import HFEngine
from paravt.vision.preprocess import encode_clip

BATCH, NEW_TOKENS = 8, 32


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    bundle = load_model(
        build_tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny"), packed_vision=True
    )
    tok = bundle.tokenizer
    reqs = []
    for i in range(BATCH):
        n = 8 if i % 2 else 16
        g = torch.Generator().manual_seed(i)
        frames = torch.randint(0, 256, (n, 64, 64, 3), dtype=torch.uint8, generator=g)
        clip = encode_clip(frames, [0.5 * k for k in range(n)], bundle.vision, tok)
        head = tok.encode("<|im_start|>user\n", add_special_tokens=False)
        tail = tok.encode(
            f"Question {i}: what happens?<|im_end|>\n<|im_start|>assistant\n",
            add_special_tokens=False,
        )
        reqs.append(
            GenerationRequest(
                head + clip.token_ids + tail,
                SamplingParams(temperature=0.7, max_new_tokens=NEW_TOKENS, seed=i),
                clip.visuals,
                {"mm_token_type_ids": [0] * len(head) + clip.mm_token_type_ids + [0] * len(tail)},
            )
        )
    return HFEngine(bundle), reqs


def test_bench_hf_engine_batched_vs_sequential(benchmark, setup):
    engine, reqs = setup
    engine.generate(reqs[:2])  # warm-up (allocator, kernels)
    t0 = time.perf_counter()
    seq = [engine.generate([r])[0] for r in reqs]
    t_seq = time.perf_counter() - t0
    out = benchmark.pedantic(lambda: engine.generate(reqs), rounds=3, iterations=1)
    assert [o.token_ids for o in out] == [o.token_ids for o in seq]
    t_batched = benchmark.stats.stats.min
    n_tok = sum(len(o.token_ids) for o in out)
    ratio = t_seq / t_batched
    benchmark.extra_info.update(
        {
            "device": str(engine.bundle.device),
            "batch": BATCH,
            "new_tokens": NEW_TOKENS,
            "prompt_tokens": [len(r.prompt_ids) for r in reqs],
            "sequential_s": t_seq,
            "batched_s": t_batched,
            "batched_tokens_per_s": n_tok / t_batched,
            "speedup_vs_sequential": ratio,
        }
    )
    print(
        f"\nHFEngine {BATCH}x{NEW_TOKENS} tokens on {engine.bundle.device}: batched "
        f"{t_batched * 1e3:.0f} ms ({n_tok / t_batched:.0f} tok/s), sequential "
        f"{t_seq * 1e3:.0f} ms -> {ratio:.2f}x"
    )


def test_bench_hf_engine_shared_overview(benchmark, setup):
    """A GRPO group: 8 rollouts of ONE prompt whose overview clip (32 frames, 64x64) is the
    same ``VisualInputs`` object -> the vision tower runs once instead of 8 times. Baseline:
    the same 8 requests holding separate copies of the clip. 8 new tokens each."""
    import dataclasses

    engine, reqs = setup
    tok = engine.bundle.tokenizer
    g = torch.Generator().manual_seed(0)
    frames = torch.randint(0, 256, (32, 64, 64, 3), dtype=torch.uint8, generator=g)
    clip = encode_clip(frames, [0.5 * k for k in range(32)], engine.bundle)
    head = tok.encode("<|im_start|>user\n", add_special_tokens=False)
    tail = tok.encode("What happens?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    mm = {"mm_token_type_ids": [0] * len(head) + clip.mm_token_type_ids + [0] * len(tail)}
    ids = head + clip.token_ids + tail

    def group(copies: bool) -> list[GenerationRequest]:
        return [
            GenerationRequest(
                ids,
                SamplingParams(temperature=0.7, max_new_tokens=8, seed=i),
                dataclasses.replace(clip.visuals, pixel_values=clip.visuals.pixel_values.clone())
                if copies
                else clip.visuals,
                mm,
            )
            for i in range(BATCH)
        ]

    copied = group(True)
    engine.generate(copied[:2])
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        base = engine.generate(copied)
        times.append(time.perf_counter() - t0)
    t_copies = min(times)
    shared = group(False)
    out = benchmark.pedantic(lambda: engine.generate(shared), rounds=3, iterations=1)
    assert [o.token_ids for o in out] == [o.token_ids for o in base]
    t_shared = benchmark.stats.stats.min
    ratio = t_copies / t_shared
    benchmark.extra_info.update(
        {"copies_s": t_copies, "shared_s": t_shared, "speedup_vs_copies": ratio}
    )
    print(
        f"\nHFEngine group of {BATCH} sharing a {len(ids)}-token overview: shared "
        f"{t_shared * 1e3:.0f} ms, copies {t_copies * 1e3:.0f} ms -> {ratio:.2f}x"
    )
