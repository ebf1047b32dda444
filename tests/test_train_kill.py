"""kill -9 mid-step, then ``--resume``: the run continues as if it had never been killed.

Three real ``python -m paravt.train`` processes on the tiny config of test_train_resume.py
(4 steps, checkpoint every 2): an uninterrupted run and, at the same time, a run SIGKILLed
inside step 4 (after the step-2 checkpoint and after it has logged step 3); then its
``--resume``. On CPU the resumed steps 3-4 reproduce the uninterrupted run's metrics bitwise
(wall-clock keys aside), and so does the killed process's own step-3 row. About 40 s on an
idle 2-core machine, most of it process start-up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from test_train_resume import tiny_overrides
from train_runs import ROOT, assert_same_row, train_rows

from paravt.metrics import read_metrics


def _argv(assets: dict[str, str], out: Path, *extra: str) -> list[str]:
    over = [*tiny_overrides(assets, out, 4), "train.save_every=2"]
    return [sys.executable, "-m", "paravt.train", *extra, *over]


def test_kill_9_mid_step_then_resume_matches_uninterrupted_run(assets, tmp_path) -> None:
    full, cut = tmp_path / "full", tmp_path / "cut"
    pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, "cwd": ROOT}
    ref = subprocess.Popen(_argv(assets, full), **pipe)  # uninterrupted, alongside
    # The run SIGKILLs itself as it enters step 4's update (paravt.preempt's test hook: the
    # real signal, which no handler can catch), after the step-2 checkpoint and step 3's row.
    # A kill from here after seeing step 3's row raced the run (~1 s a step) on a busy machine.
    env = {**os.environ, "PARAVT_PREEMPT_TEST_SIGNAL": "SIGKILL:4:update"}
    proc = subprocess.Popen(_argv(assets, cut), **pipe, env=env)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == -signal.SIGKILL, out[-3000:]
    assert "sends itself SIGKILL at step 4 (update)" in out
    assert (cut / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert not (cut / "checkpoints" / "step_000004").exists(), "the run finished before the kill"
    before_kill = train_rows(cut)
    assert 4 not in before_kill
    ref_out, _ = ref.communicate(timeout=180)
    assert ref.returncode == 0, ref_out[-3000:]

    resumed = subprocess.run(
        _argv(assets, cut, "--resume"), cwd=ROOT, capture_output=True, text=True, timeout=180
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "(step 2)" in resumed.stdout

    a, b = train_rows(full), train_rows(cut)
    lines = [r for r in read_metrics(cut / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]  # the killed run's step-3 row dropped
    assert sorted(a) == [1, 2, 3, 4]
    for step, rb in [*b.items(), (3, before_kill[3])]:
        assert_same_row(step, a[step], rb, "kill + resume")  # bitwise on CPU
    assert a[3]["loss"] != a[4]["loss"] or a[3]["grad_norm"] != a[4]["grad_norm"]
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["latest", "step_000004"]
