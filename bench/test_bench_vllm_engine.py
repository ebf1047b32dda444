"""Rollout throughput: the vLLM engine vs the HF engine, same prompts, K and G, one run.

What is measured: episodes/s of ``AgentRunner.rollout`` (the trainer's rollout: main agents,
crops decoded by the planner, ONE batched sub-agent call per turn) with each engine on the
tiny Qwen3-VL's vLLM variant (head_dim 32, fp32, CPU) and the synthetic task: PROMPTS prompts
x G, K overview frames, sub-agents 16 new tokens. Main agents replay the task's oracle turns
(``paravt.engines.oracle.OracleMainEngine``: an untrained model would never call a tool), so
both engines serve exactly the same sub-agent requests (three crops per episode); a second
pass lets the real model also generate every main-agent turn (``max_new_tokens`` 32, no
oracle), which both engines sample themselves (token counts reported).

On 2 CPU cores at this size neither engine is compute bound: this reports the ratio, there is
no CPU target. The GPU target (>= 5x the HF engine with a larger model) is measured by
``scripts/gpu_check.sh`` where the device image has vLLM.

Run: ``pytest bench/test_bench_vllm_engine.py --benchmark-only -s``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time

import pytest

from paravt.agent import AgentRunner
from paravt.config import load_config
from paravt.data.readers import load_samples
from paravt.data.synth import generate
from paravt.engines.hf import HFEngine
from paravt.engines.oracle import OracleMainEngine, load_oracle
from paravt.models import build_tiny_checkpoint, load_model
from paravt.models.tiny import TINY_VLLM_HEAD_DIM

PROMPTS, G, K = 4, 4, 8

if importlib.util.find_spec("vllm") is None:
    pytestmark = pytest.mark.skip(reason="vLLM IS NOT INSTALLED: make install-vllm")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_vllm")
    data = generate(root / "synth", 4, seed=0, min_duration=60, max_duration=60)
    d = build_tiny_checkpoint(root / "model", head_dim=TINY_VLLM_HEAD_DIM)
    bundle = load_model(d, dtype="float32", device="cpu", packed_vision=True)
    samples = load_samples(data, split="train")[:PROMPTS]
    cfg = load_config(
        "tiny_cpu",
        overrides=[
            "agent.max_turns=2",
            "rollout.max_new_tokens=32",
            "rollout.sub_max_new_tokens=16",
            "video.crop_max_frames=4",
        ],
    )
    from paravt.engines.vllm import VLLMEngine

    engines = {
        "hf": HFEngine(bundle, seed=0),
        "vllm": VLLMEngine(bundle, dtype="float32", max_model_len=8192, max_num_seqs=64, seed=0),
    }
    return bundle, samples, cfg, engines, load_oracle(data)


def _run(setup, name: str, oracle: bool) -> tuple[float, int, dict, int]:
    bundle, samples, cfg, engines, records = setup
    eng = engines[name]
    tokens0 = eng.stats["generated_tokens"]
    main = (
        OracleMainEngine(eng, bundle.tokenizer, records, cfg.agent.think_prefix) if oracle else eng
    )
    runner = AgentRunner(main, bundle, cfg)
    t0 = time.perf_counter()
    done = runner.rollout(samples, [K] * len(samples), group_size=G, seed=0)
    groups = done.groups
    dt = time.perf_counter() - t0
    n = sum(len(g.trajectories) for g in groups)
    return dt, n, dataclasses.asdict(done.stats), eng.stats["generated_tokens"] - tokens0


def _best(setup, name: str, oracle: bool, rounds: int = 2):
    return min((_run(setup, name, oracle) for _ in range(rounds)), key=lambda r: r[0])


def test_bench_vllm_vs_hf_engine_rollout(benchmark, setup):
    for name in ("hf", "vllm"):  # warm-up: vLLM's first call compiles / allocates
        _run(setup, name, True)
    hf = _best(setup, "hf", True)
    vl = benchmark.pedantic(_run, args=(setup, "vllm", True), rounds=2, iterations=1)
    vl_dt = benchmark.stats.stats.min
    hf_main, vl_main = _best(setup, "hf", False), _best(setup, "vllm", False)
    n = hf[1]
    assert vl[1] == n and hf[2]["crops"] == vl[2]["crops"] > 0  # same crops, same sub-agents
    assert hf[2]["sub_engine_calls"] == vl[2]["sub_engine_calls"]
    info = {
        "episodes": n,
        "prompts": PROMPTS,
        "G": G,
        "K": K,
        "crops": hf[2]["crops"],
        "oracle_main_hf_episodes_per_s": n / hf[0],
        "oracle_main_vllm_episodes_per_s": n / vl_dt,
        "oracle_main_speedup_vllm_vs_hf": hf[0] / vl_dt,
        "oracle_main_tokens_hf": hf[3],
        "oracle_main_tokens_vllm": vl[3],
        "model_main_hf_episodes_per_s": n / hf_main[0],
        "model_main_vllm_episodes_per_s": n / vl_main[0],
        "model_main_speedup_vllm_vs_hf": hf_main[0] / vl_main[0],
        "model_main_tokens_hf": hf_main[3],
        "model_main_tokens_vllm": vl_main[3],
    }
    benchmark.extra_info.update(info)
    print(
        f"\nrollout, {PROMPTS} prompts x G={G}, K={K} (tiny Qwen3-VL head 32, fp32, CPU):\n"
        f"  oracle main agents + real sub-agents ({hf[2]['crops']} crops): HF "
        f"{n / hf[0]:.2f} ep/s, vLLM {n / vl_dt:.2f} ep/s -> {hf[0] / vl_dt:.2f}x "
        f"(generated tokens {hf[3]} vs {vl[3]})\n"
        f"  model main agents: HF {n / hf_main[0]:.2f} ep/s, vLLM {n / vl_main[0]:.2f} ep/s -> "
        f"{hf_main[0] / vl_main[0]:.2f}x (generated tokens {hf_main[3]} vs {vl_main[3]})"
    )
