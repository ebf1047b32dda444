"""Rollout throughput: parallel tool dispatch vs sequential (one crop per turn), same crops.

What is measured: episodes/s of ``AgentRunner.rollout`` on the tiny Qwen3-VL (CPU) and the
synthetic task, 4 prompts x G=2. Main agents are scripted so that both modes request exactly
the same three crop windows per episode: *parallel* asks for all three in one turn (one
planner pass and ONE batched sub-agent call for all 24 crops), *sequential* asks for one per
turn over three turns (three planner passes, three sub-agent calls of 8). Sub-agents are the
real tiny model (HFEngine, 16 new tokens, 4 frames per crop at 32x32). The scripted main
agent costs nothing, so the ratio isolates tool dispatch; a real main agent would add two more
main-agent turns to the sequential mode, so this ratio is a lower bound for end-to-end.

Run: ``pytest bench/test_bench_rollout.py --benchmark-only -s``.
"""

from __future__ import annotations

import json
import time

import pytest

from paravt.agent import AgentRunner
from paravt.config import load_config
from paravt.data.readers import load_samples
from paravt.data.synth import generate
from paravt.models import build_tiny_checkpoint, load_model
from paravt.rollout.engine import GenerationResult
from paravt.rollout.hf import HFEngine

PROMPTS, G = 4, 2
WINDOWS = ((4.0, 10.0), (20.0, 28.0), (40.0, 46.0))


def _call(s: float, e: float) -> str:
    args = {"start_time": s, "end_time": e}
    return (
        "<tool_call>\n" + json.dumps({"name": "crop_video", "arguments": args}) + "\n</tool_call>"
    )


PARALLEL = [
    "look\n</think>\n" + "\n".join(_call(*w) for w in WINDOWS),
    "x\n</think>\n<answer>A</answer>",
]
SEQUENTIAL = [f"look {i}\n</think>\n" + _call(*w) for i, w in enumerate(WINDOWS)] + [PARALLEL[1]]


class ScriptedMain:
    """Scripted main agents (log-prob 0), real sub-agents."""

    def __init__(self, real: HFEngine, tokenizer, script: list[str]):
        self.real, self.tok, self.script = real, tokenizer, script
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.turn: dict[str, int] = {}

    def generate(self, requests):
        if any(":t" in r.request_id for r in requests):
            return self.real.generate(requests)
        out = []
        for r in requests:
            k = self.turn.get(r.request_id, 0)
            self.turn[r.request_id] = k + 1
            ids = self.tok.encode(self.script[k], add_special_tokens=False) + [self.im_end]
            out.append(GenerationResult(ids, [0.0] * len(ids), "stop", r.request_id))
        return out

    def sync_weights(self, model):
        return None


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_rollout")
    data = generate(root / "synth", 3, seed=0, min_duration=60, max_duration=60)
    bundle = load_model(build_tiny_checkpoint(root / "model"), dtype="float32", device="cpu")
    samples = load_samples(data, split="train")[:PROMPTS]
    cfg = load_config(
        "tiny_cpu",
        overrides=[
            "agent.max_turns=3",
            "rollout.sub_max_new_tokens=16",
            "video.crop_max_frames=4",
        ],
    )
    return bundle, samples, cfg


def _run(bundle, samples, cfg, script):
    real = HFEngine(bundle, seed=0)
    runner = AgentRunner(ScriptedMain(real, bundle.tokenizer, script), bundle, cfg)
    t0 = time.perf_counter()
    groups = runner.rollout(samples, [8] * len(samples), group_size=G, seed=0)
    dt = time.perf_counter() - t0
    n = sum(len(g.trajectories) for g in groups)
    assert runner.stats["crops"] == n * len(WINDOWS)
    return dt, n, runner.stats, real.stats["generated_tokens"]


def test_bench_rollout_parallel_vs_sequential(benchmark, setup):
    bundle, samples, cfg = setup
    _run(bundle, samples, cfg, PARALLEL)  # warm-up (allocator, caches)
    seq_stats = min((_run(bundle, samples, cfg, SEQUENTIAL) for _ in range(2)), key=lambda r: r[0])
    seq = seq_stats[0]
    par_stats = benchmark.pedantic(
        _run, args=(bundle, samples, cfg, PARALLEL), rounds=2, iterations=1
    )
    par = benchmark.stats.stats.min
    n = par_stats[1]
    ratio = seq / par
    info = {
        "episodes": n,
        "crops_per_episode": len(WINDOWS),
        "parallel_episodes_per_s": n / par,
        "sequential_episodes_per_s": n / seq,
        "speedup_parallel_vs_sequential": ratio,
        "sub_engine_calls_parallel": par_stats[2]["sub_engine_calls"],
        "sub_engine_calls_sequential": seq_stats[2]["sub_engine_calls"],
        "sub_tokens_parallel": par_stats[3],
        "sub_tokens_sequential": seq_stats[3],
    }
    benchmark.extra_info.update(info)
    print(
        f"\nrollout, {n} episodes x {len(WINDOWS)} crops (tiny Qwen3-VL, CPU): parallel "
        f"{n / par:.2f} ep/s, sequential {n / seq:.2f} ep/s -> {ratio:.2f}x "
        f"(sub-agent tokens {par_stats[3]} vs {seq_stats[3]})"
    )
    assert par_stats[2]["sub_engine_calls"] == 1 and seq_stats[2]["sub_engine_calls"] == 3
