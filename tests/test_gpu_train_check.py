"""scripts/gpu_train_check.sh (issue 36's prepared device run) on a machine without CUDA: every
GPU step reported skipped, the files the device tool brings back written and well-formed, exit
0; DALI's wheel split into parts, staged and joined back byte for byte (a missing part is
named); the step scripts' pieces that run anywhere (varlen_attn_check's SDPA path and its skip
reason, gpu_real_size's phase clock). The CPU dry run of the steps: tests/test_gpu_scripts.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_train_check.sh"
STEPS = ["kernel_tests", "kernel_targets", "real_size_2b", "varlen"]  # PARAVT_GPU_CALL=main


def _run(args: list[str], env: dict[str, str], timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PY": sys.executable, **env},
    )  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs for real")
def test_without_cuda_every_step_is_skipped_and_the_output_is_well_formed(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    r = _run([], {"OUT": str(out), "PARAVT_GPU_WORK": str(work)})
    assert r.returncode == 0, r.stdout + r.stderr
    files = sorted(p.name for p in out.iterdir())
    # What the device tool returns: at most 8 files, names of letters, digits, '.', '_', '-'.
    assert files == sorted(["summary.json", "summary.txt", "setup.log", "steps.log"] +
                           [f"{s}.json" for s in STEPS])  # fmt: skip
    assert len(files) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files)
    s = json.loads((out / "summary.json").read_text())
    assert s["cuda"] is False and s["dry"] is False and s["failed"] == []
    assert s["call"] == "main" and s["gpu"] is None
    assert list(s["steps"]) == STEPS
    log = (out / "steps.log").read_text().splitlines()
    assert log == [f"[{n}] skipped: no CUDA" for n in STEPS]
    for name, st in s["steps"].items():
        assert st["status"] == "skipped" and st["reason"] == "no CUDA", name
        assert st["log"] == "steps.log" and st["rc"] is None
        assert json.loads((out / f"{name}.json").read_text()) == {
            "status": "skipped", "reason": "no CUDA"}  # fmt: skip
    assert (out / "summary.txt").read_text().splitlines()[1:] == [
        f"{n}: skipped: no CUDA" for n in STEPS
    ]
    setup = (out / "setup.log").read_text()
    assert "gpu False" in setup and "cuda=0" in setup


def test_an_unknown_call_is_refused(tmp_path):
    r = _run([], {"OUT": str(tmp_path / "o"), "PARAVT_GPU_CALL": "everything"})
    assert r.returncode == 2 and "PARAVT_GPU_CALL=everything is not one of main, video" in r.stderr


def test_dali_wheel_parts_are_joined_back_and_a_missing_part_is_named(tmp_path):
    whl = tmp_path / "src" / "nvidia_dali_fake-1.0-py3-none-any.whl"
    whl.parent.mkdir()
    whl.write_bytes(os.urandom(50_000))
    env = {
        "PARAVT_DALI_PART_SIZE": "20K",
        "PARAVT_DALI_PARTS": str(tmp_path / "parts"),
        "PARAVT_DALI_STAGE": str(tmp_path / "stage"),
        "PARAVT_GPU_WORK": str(tmp_path / "work"),
    }
    assert _run(["--split-dali", str(whl)], env).returncode == 0
    parts = sorted(p.name for p in (tmp_path / "parts").iterdir())
    assert parts == [f"{whl.name}.part0{i}" for i in range(3)] + [f"{whl.name}.sha256"]
    # One call per part on the device: each moves its part out of the tree into the stage.
    assert _run(["--stage-dali"], env).returncode == 0
    assert not any((tmp_path / "parts").iterdir())
    r = _run(["--join-dali"], env)
    assert r.returncode == 0, r.stderr
    joined = Path(r.stdout.strip())
    assert joined == tmp_path / "work" / "dali_wheel" / whl.name
    assert joined.read_bytes() == whl.read_bytes()
    (tmp_path / "stage" / f"{whl.name}.part01").unlink()
    r = _run(["--join-dali"], env)
    assert r.returncode == 1
    assert "the joined parts (2) do not match its sha256: a part is missing or damaged" in r.stderr


def test_varlen_check_compares_with_the_sdpa_path_or_says_why_not(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import varlen_attn_check
    finally:
        sys.path.pop(0)
    out = tmp_path / "v.json"
    assert varlen_attn_check.main(["--size", "tiny", "--device", "cpu", "--reps", "1",
                                   "--json", str(out)]) == 0  # fmt: skip
    r = json.loads(out.read_text())
    lm, vis = r["cases"]["lm"], r["cases"]["vision"]
    assert (lm["tokens"], lm["sequences"], lm["causal"]) == (112, 4, True)
    assert (vis["tokens"], vis["causal"]) == (168, False)
    # fp32 on the CPU: the per-sequence SDPA path IS the reference computation.
    assert lm["sdpa_vs_fp32"]["rel"] < 1e-6 and vis["sdpa_vs_fp32"]["rel"] < 1e-6
    if r["status"] == "skipped":  # CPU torch: varlen_attn has no CPU kernel
        assert "varlen_attn does not run on cpu" in r["reason"]
        assert "NotImplementedError" in r["reason"]
    else:
        assert lm["varlen"]["within_tolerance"] and vis["varlen"]["within_tolerance"]


def test_phase_clock_times_each_phase_it_is_told_of():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from gpu_real_size import PhaseClock
    finally:
        sys.path.pop(0)
    c = PhaseClock(cuda=False)
    c.enter(1, "rollout")
    time.sleep(0.05)
    c.enter(1, "update")
    c.enter(1, "end")
    assert [(r["step"], r["phase"]) for r in c.rows] == [(0, "startup"), (1, "rollout"),
                                                          (1, "update")]  # fmt: skip
    assert c.rows[1]["seconds"] >= 0.05 > c.rows[2]["seconds"]
    assert c.should_abandon() is False
