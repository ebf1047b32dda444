"""HFEngine throughput: one batched call vs one call per request, same requests and seeds.

What is measured: wall time of ``HFEngine.generate`` for 8 video prompts (tiny Qwen3-VL on the
CPU, or the GPU when present), 32 new tokens each at temperature 0.7, prompts of 8 or 16
frames at 64x64 (64-128 video tokens + timestamps, 88-152 prompt tokens). *batched*: the 8
requests in one call (one vision forward, one left-padded prefill, 32 batched decode steps);
*sequential*: the same 8 requests one call each. Requests carry seeds, so both modes produce
the same tokens (checked), and the ratio is pure batching gain.

A second benchmark measures the vision de-duplication of a GRPO group (8 rollouts sharing
one overview clip object) against the same requests holding copies.

A third measures the shared-prefix prefill (``rollout.share_prefix``) of one GRPO group,
G = 8 with a K = 32 overview, at a first and a later turn, against the unshared prefill.

Run: ``pytest bench/test_bench_hf_engine.py --benchmark-only -s``.
"""

from __future__ import annotations

import time

import pytest
import torch

from paravt.engines.engine import GenerationRequest, SamplingParams
from paravt.engines.hf import HFEngine
from paravt.models import build_tiny_checkpoint, load_model
from paravt.vision.preprocess import encode_clip

BATCH, NEW_TOKENS = 8, 32
ROUNDS = 5  # shared-prefix benchmark: alternating rounds


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


def _overview_group(engine: HFEngine, turn: int) -> list[GenerationRequest]:
    """One GRPO group (G = 8) of the real main-agent prompt (system text with the tool schema,
    a K = 32 overview of 64x64 frames, the question). ``turn`` 1: the 8 identical first-turn
    prompts; 2: each context extended by its own 'sample' and tool response (~10% of the
    context, as a later turn), so the 8 share only the first prompt."""
    from paravt.agent.context import TextCache, encode_frames_batch, main_prompt

    bundle = engine.bundle
    text = TextCache(bundle.tokenizer)
    g = torch.Generator().manual_seed(3)
    frames = torch.randint(0, 256, (32, 64, 64, 3), dtype=torch.uint8, generator=g)
    (clip,) = encode_frames_batch(bundle, [(frames, [2.0 * k for k in range(32)])])
    ctx = main_prompt(text, clip, "What happens at the end? (A) a (B) b (C) c", max_parallel=3)
    reqs = []
    for i in range(BATCH):
        c = ctx.copy()
        if turn == 2:
            sample = text.markup(f"<think>\nsample {i} " + "looks " * (8 + 3 * i) + "</think>")
            c.add_generated(sample, [0.0] * len(sample))
            c.add_markup(
                text.markup(
                    "<|im_end|>\n<|im_start|>user\n<tool_response>"
                    + f"summary {i} " * (10 + 2 * i)
                    + "</tool_response><|im_end|>\n<|im_start|>assistant\n"
                )
            )
        reqs.append(c.request(SamplingParams(temperature=0.7, max_new_tokens=1, seed=i), f"g{i}"))
    return reqs


@pytest.mark.parametrize("turn", [1, 2])
def test_bench_hf_engine_shared_prefix_prefill(benchmark, setup, turn):
    """Prefill time of one GRPO group (G = 8, K = 32 overview; one new token, so the call is
    the prefill and the first sample): ``rollout.share_prefix`` on (the group's prompt
    prefilled once, its KV cache forked to the 8 rows) vs off (8 rows prefilled), same engine
    weights, same requests and seeds (the same clip object: the vision tower runs once in
    both). Turn 1: identical prompts; turn 2: contexts sharing the first prompt only."""
    engine, _ = setup
    reqs = _overview_group(engine, turn)
    on = HFEngine(engine.bundle, share_prefix=True)
    off = HFEngine(engine.bundle, share_prefix=False)
    on.generate(reqs[:2])  # warm-up (allocator, kernels)
    off.generate(reqs[:2])
    on.stats["prefill_tokens"] = off.stats["prefill_tokens"] = 0
    # The machine is shared and noisy: the two modes alternate within each round, and the
    # best round of each is compared.
    t = {"on": [], "off": []}
    res = {}

    def both():
        for name, eng in (("off", off), ("on", on)):
            t0 = time.perf_counter()
            res[name] = eng.generate(reqs)
            t[name].append(time.perf_counter() - t0)

    benchmark.pedantic(both, rounds=ROUNDS, iterations=1)
    t_on, t_off = min(t["on"]), min(t["off"])
    out, base = res["on"], res["off"]
    assert [o.token_ids for o in out] == [o.token_ids for o in base]
    for o, b in zip(out, base):
        torch.testing.assert_close(
            torch.tensor(o.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0
        )
    # The vision tower's share (the clip is one object: encoded once in BOTH modes).
    v = reqs[0].visuals
    dev, dtype = engine.bundle.device, next(engine.bundle.model.parameters()).dtype
    vis = []
    with torch.inference_mode():
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            engine.bundle.model.model.get_video_features(
                v.pixel_values.to(dev, dtype), v.grid_thw.to(dev), return_dict=True
            )
            vis.append(time.perf_counter() - t0)
    t_vis = min(vis)
    calls = ROUNDS  # per-call token counts
    tok_on = on.stats["prefill_tokens"] // calls
    tok_off = off.stats["prefill_tokens"] // calls
    ratio = t_on / t_off
    benchmark.extra_info.update(
        {
            "device": str(engine.bundle.device),
            "turn": turn,
            "group": BATCH,
            "prompt_tokens": [len(r.prompt_ids) for r in reqs],
            "backbone_tokens_shared": tok_on,
            "backbone_tokens_unshared": tok_off,
            "shared_s": t_on,
            "unshared_s": t_off,
            "time_ratio_shared_vs_unshared": ratio,
            "vision_s": t_vis,
            "time_ratio_without_vision": (t_on - t_vis) / (t_off - t_vis),
        }
    )
    print(
        f"\nHFEngine prefill of a G={BATCH} group, turn {turn}, prompts "
        f"{min(len(r.prompt_ids) for r in reqs)}-{max(len(r.prompt_ids) for r in reqs)} tokens "
        f"on {engine.bundle.device}: shared {t_on * 1e3:.0f} ms ({tok_on} backbone tokens), "
        f"unshared {t_off * 1e3:.0f} ms ({tok_off}) -> {ratio:.2f}x the time, "
        f"{tok_on / tok_off:.2f}x the tokens; vision tower {t_vis * 1e3:.0f} ms of both, "
        f"without it {(t_on - t_vis) / (t_off - t_vis):.2f}x"
    )
