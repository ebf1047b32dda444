"""A background checkpoint (``train.async_save``) commits at the end of the step in which every
rank's write is done, agreed in the step's one all-reduce (``StepStats``' ``save_written``),
not at the next save (issue 61 item 4).

A real ``python -m paravt.train`` process on the tiny run (6 steps, a checkpoint every 3, in
the background) SIGKILLs itself inside step 6's update (``paravt.preempt``'s test hook), before
step 6's own save: step 3's write finished during step 4 (or 5, on a busy machine: two steps of
slack), so that step's end made it ``latest`` and ``--resume`` continues from step 3,
reproducing the killed run's step-4 row bitwise. Before this change the
step-3 save was committed only by step 6's save: the kill left a ``.tmp-step_000003`` and the
resume started over at step 0. About 30 s, most of it the two process start-ups.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_checkpoint_trust import _trainer
from test_train_resume import tiny_overrides
from train_runs import ROOT, assert_same_row, train_rows

from paravt import checkpoint as C


def _argv(assets: dict[str, str], out: Path, *extra: str) -> list[str]:
    over = [*tiny_overrides(assets, out, 6), "train.save_every=3", "train.async_save=true"]
    return [sys.executable, "-m", "paravt.train", *extra, *over]


def test_kill_9_after_a_background_save_finished_resumes_from_it(assets, tmp_path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "PARAVT_PREEMPT_TEST_SIGNAL": "SIGKILL:6:update", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        _argv(assets, out), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-3000:] + proc.stderr[-3000:]
    killed = train_rows(out)
    assert sorted(killed) == [1, 2, 3, 4, 5]
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


@pytest.mark.parametrize("background", [False, True])
def test_the_export_is_on_disk_before_the_checkpoint_is_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, background: bool
) -> None:
    """Every file of the HF export (``model.safetensors``, ``config.json`` ...) is fsynced
    before the folder is renamed into place (``save_model_dir``'s ``_fsync_files``), in the
    foreground and from the background save's export thread; on main only
    ``trainer_state.pt`` was (a crash after the commit could leave a ``latest`` whose export is
    still in the page cache, lost)."""
    synced: set[str] = set()
    at_commit: list[set[str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        synced.add(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        if Path(src).name.startswith(".tmp-step_"):
            at_commit.append(set(synced))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    tr = _trainer(tmp_path)
    tr.cfg.train.async_save = background
    assert tr.checkpoint(1)
    tr.finish_checkpoint()
    ckpt = tmp_path / C.CKPT_DIR / "step_000001"
    assert ckpt.is_dir() and len(at_commit) == 1
    done = at_commit[0]
    assert {"model.safetensors", C.STATE_FILE, "__0_0.distcp"} <= done, sorted(done)
    assert any(n.startswith(f".{C.MANIFEST}.") for n in done), sorted(done)  # (atomic_file's)
