"""A background checkpoint (``train.async_save``) commits at the end of the step in which every
rank's write is done, agreed in the step's one all-reduce (``StepStats``' ``save_written``),
not at the next save (issue 61 item 4).

A real ``python -m paravt.train`` process on the tiny run (6 steps, a checkpoint every 3, in
the background) SIGKILLs itself inside step 5's update (``paravt.preempt``'s test hook): step
3's write finished during step 4, so step 4's end made it ``latest`` and ``--resume``
continues from step 3, reproducing the killed run's step-4 row bitwise. Before this change the
step-3 save was committed only by step 6's save: the kill left a ``.tmp-step_000003`` and the
resume started over at step 0. About 30 s, most of it the two process start-ups.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from test_train_resume import tiny_overrides
from train_runs import ROOT, assert_same_row, train_rows


def _argv(assets: dict[str, str], out: Path, *extra: str) -> list[str]:
    over = [*tiny_overrides(assets, out, 6), "train.save_every=3", "train.async_save=true"]
    return [sys.executable, "-m", "paravt.train", *extra, *over]


def test_kill_9_after_a_background_save_finished_resumes_from_it(assets, tmp_path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "PARAVT_PREEMPT_TEST_SIGNAL": "SIGKILL:5:update", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        _argv(assets, out), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-3000:] + proc.stderr[-3000:]
    killed = train_rows(out)
    assert sorted(killed) == [1, 2, 3, 4]
    root = out / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_000003"
    assert not list(root.glob(".tmp-*")), "step 3's save was written but never committed"

    resumed = subprocess.run(
        _argv(assets, out, "--resume"),
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(step 3)" in resumed.stdout + resumed.stderr
    again = train_rows(out)
    assert sorted(again) == [1, 2, 3, 4, 5, 6]
    assert_same_row(4, killed[4], again[4], "kill -9 after a finished background save")
