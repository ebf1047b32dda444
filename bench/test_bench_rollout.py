"""Rollout throughput: parallel tool dispatch vs sequential (one crop per turn), same crops.

What is measured: episodes/s of ``AgentRunner.rollout`` on the tiny Qwen3-VL (CPU) and the
synthetic task, 4 prompts x G=2. Main agents are scripted so that both modes request exactly
the same three crop windows per episode: *parallel* asks for all three in one turn (one
planner pass and ONE batched sub-agent call for all 24 crops), *sequential* asks for one per
turn over three turns (three planner passes, three sub-agent calls of 8). Sub-agents are the
real tiny model (HFEngine, 16 new tokens, 4 frames per crop at 32x32).

Two ratios, same run: *dispatch only* (the scripted main agent costs nothing, so the ratio
isolates tool dispatch) and *with main-agent compute* (the real model also generates every
main-agent turn, as many tokens as the scripted text, output discarded; the sequential mode
pays two extra main-agent turns per episode, as a real agent would). The real model may stop a
discarded turn early on a stop token, so main-agent token counts are reported too.

Run: ``pytest bench/test_bench_rollout.py --benchmark-only -s``.
"""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from paravt.agent import AgentRunner
from paravt.config import load_config
from paravt.data.readers import load_samples
from paravt.data.synth import generate
from paravt.engines.engine import GenerationResult
from paravt.engines.hf import HFEngine
from paravt.models import build_tiny_checkpoint, load_model

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
    """Scripted main agents (log-prob 0), real sub-agents.

    With ``pay_main_cost`` the real model also runs every main-agent turn (same context, same
    visual inputs, as many new tokens as the scripted turn has) and its output is discarded:
    the main agent's compute is paid as a real one would, while its text stays scripted so both
    modes request the same crops.
    """

    def __init__(self, real: HFEngine, tokenizer, script: list[str], pay_main_cost: bool = False):
        self.real, self.tok, self.script = real, tokenizer, script
        self.pay_main_cost = pay_main_cost
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.turn: dict[str, int] = {}
        self.main_tokens = 0

    def generate(self, requests):
        if any(":t" in r.request_id for r in requests):
            return self.real.generate(requests)
        out = []
        for r in requests:
            k = self.turn.get(r.request_id, 0)
            self.turn[r.request_id] = k + 1
            ids = self.tok.encode(self.script[k], add_special_tokens=False) + [self.im_end]
            out.append(GenerationResult(ids, [0.0] * len(ids), "stop", r.request_id))
        if self.pay_main_cost:
            paid = [
                dataclasses.replace(
                    r, sampling=dataclasses.replace(r.sampling, max_new_tokens=len(o.token_ids))
                )
                for r, o in zip(requests, out)
            ]
            self.main_tokens += sum(len(g.token_ids) for g in self.real.generate(paid))
        return out

    def sync_weights(self, model):
        return None


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_rollout")
    data = generate(root / "synth", 3, seed=0, min_duration=60, max_duration=60)
    bundle = load_model(
        build_tiny_checkpoint(root / "model"), dtype="float32", device="cpu", packed_vision=True
    )
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


def _run(bundle, samples, cfg, script, pay_main_cost=False):
    real = HFEngine(bundle, seed=0)
    main = ScriptedMain(real, bundle.tokenizer, script, pay_main_cost)
    runner = AgentRunner(main, bundle, cfg)
    t0 = time.perf_counter()
    done = runner.rollout(samples, [8] * len(samples), group_size=G, seed=0)
    groups = done.groups
    dt = time.perf_counter() - t0
    n = sum(len(g.trajectories) for g in groups)
    assert done.stats.crops == n * len(WINDOWS)
    sub_tokens = real.stats["generated_tokens"] - main.main_tokens
    return dt, n, done.stats, sub_tokens, main.main_tokens


def _best(bundle, samples, cfg, script, pay_main_cost, rounds=2):
    return min(
        (_run(bundle, samples, cfg, script, pay_main_cost) for _ in range(rounds)),
        key=lambda r: r[0],
    )


def test_bench_rollout_parallel_vs_sequential(benchmark, setup):
    bundle, samples, cfg = setup
    _run(bundle, samples, cfg, PARALLEL)  # warm-up (allocator, caches)
    seq_stats = _best(bundle, samples, cfg, SEQUENTIAL, False)
    seq = seq_stats[0]
    par_stats = benchmark.pedantic(
        _run, args=(bundle, samples, cfg, PARALLEL), rounds=2, iterations=1
    )
    par = benchmark.stats.stats.min
    n = par_stats[1]
    # Same comparison with the real model also paying for every main-agent turn (the
    # sequential mode has two extra main-agent turns per episode, as a real agent would).
    seq_main = _best(bundle, samples, cfg, SEQUENTIAL, True)
    par_main = _best(bundle, samples, cfg, PARALLEL, True)
    info = {
        "episodes": n,
        "crops_per_episode": len(WINDOWS),
        "parallel_episodes_per_s": n / par,
        "sequential_episodes_per_s": n / seq,
        "speedup_parallel_vs_sequential": seq / par,
        "with_main_parallel_episodes_per_s": n / par_main[0],
        "with_main_sequential_episodes_per_s": n / seq_main[0],
        "with_main_speedup_parallel_vs_sequential": seq_main[0] / par_main[0],
        "sub_engine_calls_parallel": par_stats[2].sub_engine_calls,
        "sub_engine_calls_sequential": seq_stats[2].sub_engine_calls,
        "sub_tokens_parallel": par_stats[3],
        "sub_tokens_sequential": seq_stats[3],
        "main_tokens_parallel": par_main[4],
        "main_tokens_sequential": seq_main[4],
    }
    benchmark.extra_info.update(info)
    print(
        f"\nrollout, {n} episodes x {len(WINDOWS)} crops (tiny Qwen3-VL, CPU):\n"
        f"  dispatch only: parallel {n / par:.2f} ep/s, sequential {n / seq:.2f} ep/s -> "
        f"{seq / par:.2f}x (sub-agent tokens {par_stats[3]} vs {seq_stats[3]})\n"
        f"  with main-agent compute: parallel {n / par_main[0]:.2f} ep/s, sequential "
        f"{n / seq_main[0]:.2f} ep/s -> {seq_main[0] / par_main[0]:.2f}x "
        f"(main-agent tokens {par_main[4]} vs {seq_main[4]})"
    )
    assert par_stats[2].sub_engine_calls == 1 and seq_stats[2].sub_engine_calls == 3
    # Same sub-agent work in both modes (a sampled stop may differ by a token: batch shapes
    # differ, so the logits differ in the last bits).
    assert abs(par_stats[3] - seq_stats[3]) <= 0.1 * seq_stats[3]
