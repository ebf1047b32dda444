"""scripts/gpu_train_check.sh (the prepared device calls) on a machine without CUDA: every GPU
step reported skipped, the files the device tool brings back written and well-formed, exit 0;
the time plan (a step left under half its budget is skipped by name; a step cut mid-run shows
as running, then timeout); DALI's wheel split into parts, staged and joined back byte for byte
(a missing part is named); the step scripts' pieces that run anywhere (varlen_attn_check's SDPA
path and its skip reason, gpu_real_size's phase clock, gpu_realscale's probes and its push
measurement). The CPU dry run of the documented calls: tests/test_gpu_scripts.py."""

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
STEPS = ["probe", "real_size_2b", "kernel_targets", "gpu_tests", "varlen"]  # PARAVT_GPU_CALL=main


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
    assert files == ["steps.log", "summary.json", "summary.txt"]
    s = json.loads((out / "summary.json").read_text())
    assert s["cuda"] is False and s["dry"] is False and s["failed"] == []
    assert s["call"] == "main" and s["gpu"] is None and s["setup_ok"]
    assert s["plan_s"] == {"setup": 100, "probe": 30, "real_size_2b": 180, "kernel_targets": 85,
                           "gpu_tests": 35, "varlen": 20}  # fmt: skip
    assert s["deadline_s"] == 450 and s["timeout_s"] == 480
    assert list(s["steps"]) == STEPS
    log = (out / "steps.log").read_text().splitlines()
    assert log[0].startswith("==== [setup] call=main") and "gpu False" in "\n".join(log)
    assert [x for x in log if x.startswith("==== [") and "skipped" in x] == [
        f"==== [{n}] skipped: no CUDA" for n in STEPS
    ]
    for name, st in s["steps"].items():
        assert st["status"] == "skipped" and st["reason"] == "no CUDA", name
        assert st["log"] == "steps.log" and st["rc"] is None and st["budget_s"] == s["plan_s"][name]
    assert (out / "summary.txt").read_text().splitlines()[1:] == [
        f"{n}: skipped: no CUDA" for n in STEPS
    ]


def test_an_unknown_call_is_refused(tmp_path):
    r = _run([], {"OUT": str(tmp_path / "o"), "PARAVT_GPU_CALL": "everything"})
    assert r.returncode == 2
    assert "PARAVT_GPU_CALL=everything is not one of main, extra, video" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs for real")
def test_a_step_left_under_half_its_budget_is_skipped_by_name(tmp_path):
    """PARAVT_GPU_DEADLINE_S=20: the setup's import check and varlen leave gpu_tests (budget
    35 s) under 17 s: skipped, named, and the call still exits 0 (nothing failed)."""
    out = tmp_path / "out"
    r = _run([], {"OUT": str(out), "PARAVT_GPU_WORK": str(tmp_path / "work"),
                  "PARAVT_GPU_DRY": "1", "PARAVT_GPU_STEPS": "varlen,gpu_tests",
                  "PARAVT_GPU_DEADLINE_S": "20", "PARAVT_GPU_STATE": str(tmp_path / "st")},
             timeout=300)  # fmt: skip
    s = json.loads((out / "summary.json").read_text())
    assert r.returncode == 0 and s["failed"] == [], r.stdout[-3000:] + r.stderr[-2000:]
    assert list(s["steps"]) == ["varlen", "gpu_tests"] and s["deadline_s"] == 20
    g = s["steps"]["gpu_tests"]
    assert g["status"] == "skipped" and g["rc"] is None
    assert re.fullmatch(r"not run: \d+ s left for it, under half its budget of 35 s "
                        r"\(deadline 20 s\)", g["reason"]), g["reason"]  # fmt: skip
    assert "==== [gpu_tests] skipped: " in (out / "steps.log").read_text()


def test_the_summary_shows_a_step_cut_mid_run_as_running_with_its_streamed_log(tmp_path):
    """A call killed at its timeout_s: the step had started (its marker) and written part of its
    JSON, no rc: summary.json (rewritten when the step started) says running, not absent."""
    out, work = tmp_path / "out", tmp_path / "work"
    (work / "steps").mkdir(parents=True)
    out.mkdir()
    (work / "steps" / "probe.rc").write_text("0 12 120")
    (out / "probe.json").write_text('{"status": "ok"}')
    (work / "steps" / "real_size_2b.started").touch()
    (out / "real_size_2b.json").write_text('{"status": "running", "steps": {"1": {}}}')
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_summary.py"), "--out", str(out),
                        "--work", str(work), "--call", "main", "--steps",
                        "probe real_size_2b kernel_targets", "--plan",
                        "setup:100 probe:30 real_size_2b:180 kernel_targets:85", "--deadline",
                        "395", "--timeout", "425", "--exit-status"], capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    assert list(s["steps"]) == ["probe", "real_size_2b"]  # kernel_targets not reached
    assert s["steps"]["probe"] | {"figures": None} == {
        "status": "ok", "rc": 0, "seconds": 12, "limit_s": 120, "budget_s": 30, "log": "steps.log",
        "reason": None, "figures": None}  # fmt: skip
    rs = s["steps"]["real_size_2b"]
    assert rs["status"] == "running" and rs["rc"] is None and rs["figures"]["steps"] == {"1": {}}
    (work / "steps" / "real_size_2b.rc").write_text("124 181 180")
    r = subprocess.run(r.args, capture_output=True, text=True)
    s = json.loads((out / "summary.json").read_text())
    assert r.returncode == 1 and s["failed"] == ["real_size_2b"]
    assert s["steps"]["real_size_2b"]["status"] == "timeout"
    assert s["steps"]["real_size_2b"]["reason"] == "cut at its limit of 180 s"


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


def _realscale():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_realscale
    finally:
        sys.path.pop(0)
    return gpu_realscale


def test_a_realscale_feature_the_code_lacks_is_skipped_as_not_implemented_yet(monkeypatch):
    rs = _realscale()
    f = rs.FEATURES["copy_stream"]
    monkeypatch.setitem(rs.FEATURES, "copy_stream", rs.dataclasses.replace(
        f, detect=lambda: (False, "/copy_stream/ in paravt.weight_sync")))  # fmt: skip
    r = rs.check("copy_stream", dry=True)
    assert r["status"] == "skipped" and r["detected"]["found"] is False
    assert r["reason"] == ("not implemented yet (issue 61 item 5: the weight push's dedicated copy "
                           "stream): /copy_stream/ in paravt.weight_sync not found")  # fmt: skip
    # present, but its tests select nothing and it has no measurement: skipped, the selection named
    g = rs.dataclasses.replace(rs.FEATURES["hsdp"], detect=lambda: (True, "x"),
                               tests=("tests/test_gpu_train_check.py",), select="no_such_test")  # fmt: skip
    monkeypatch.setitem(rs.FEATURES, "hsdp", g)
    r = rs.check("hsdp", dry=True)
    assert r["status"] == "skipped" and r["tests"]["selected"] == 0
    assert "-k 'no_such_test': the GPU half has no check yet" in r["reason"]
    # present but a package missing (vllm on the device image)
    v = rs.dataclasses.replace(rs.FEATURES["vllm_graphs"], detect=lambda: (True, "x"),
                               needs=("no_such_module_here",))  # fmt: skip
    monkeypatch.setitem(rs.FEATURES, "vllm_graphs", v)
    r = rs.check("vllm_graphs", dry=True)
    assert r["status"] == "skipped" and r["reason"].startswith("no_such_module_here not importable")


def test_the_push_overlap_measurement_sends_every_byte_on_the_cpu():
    r = _realscale().push_overlap(dry=True)
    # 1 MiB of bf16 in 8 tensors, plus the checksum rows (8 x 3 int64)
    assert r["device"] == "cpu" and r["sent_bytes"] == (1 << 20) + 8 * 3 * 8
    assert r["compute_s"] > 0 and r["push_s"] > 0 and r["both_s"] > 0
    assert set(r) == {
        "device",
        "push_mib",
        "sent_bytes",
        "compute_s",
        "push_s",
        "both_s",
        "overlap",
    }
