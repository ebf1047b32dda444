"""One live process per folder (``paravt.files.FolderClaim``, issue 50 item 2): of processes
started at the same moment into one folder exactly one holds it and the others are refused
naming it; a holder killed with SIGKILL leaves no stale claim; ``python -m paravt.train`` and
``python -m paravt.eval`` refuse a folder another process holds (exit 2, the holder named,
nothing written there), and train into it once the holder is gone.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train_resume import tiny_overrides

from paravt.files import FolderBusy, FolderClaim


def _contend(folder: str, go: mp.Event, results: mp.Queue) -> None:  # type: ignore[type-arg]
    go.wait()
    try:
        claim = FolderClaim(folder, "a contender").acquire()
    except FolderBusy as e:
        results.put(("busy", os.getpid(), str(e)))
        return
    results.put(("held", os.getpid(), ""))
    time.sleep(1.5)  # hold it while the others try
    claim.release()


def test_of_processes_started_together_one_holds_the_folder(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    go, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_contend, args=(str(tmp_path), go, results)) for _ in range(6)]
    for p in procs:
        p.start()
    go.set()
    got = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    held = [pid for kind, pid, _ in got if kind == "held"]
    assert len(held) == 1, got
    for kind, _, msg in got:
        if kind == "busy":
            assert f"pid {held[0]}, a contender" in msg, msg
    assert not (tmp_path / FolderClaim.NAME).exists()  # released: the lock file is gone


def _holder(folder: Path, what: str) -> subprocess.Popen:
    """A process that holds ``folder`` until killed (started and holding when returned)."""
    code = (
        "import sys, time\n"
        "from paravt.files import FolderClaim\n"
        f"c = FolderClaim({str(folder)!r}, {what!r}).acquire()\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def test_a_claim_killed_with_sigkill_is_free_at_once(tmp_path: Path) -> None:
    p = _holder(tmp_path, "a paravt.train run")
    with pytest.raises(FolderBusy, match=rf"pid {p.pid}, a paravt.train run"):
        FolderClaim(tmp_path, "a second run").acquire()
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert (tmp_path / FolderClaim.NAME).exists()  # the file stays; the kernel's lock does not
    with FolderClaim(tmp_path, "a second run") as c:
        assert c.holder()["pid"] == os.getpid()


def test_a_lock_file_planted_as_a_symlink_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / FolderClaim.NAME).symlink_to(target)
    with pytest.raises(OSError, match="symbolic link"):
        FolderClaim(tmp_path / "run", "a run").acquire()
    assert target.read_text() == "keep"


def test_train_and_eval_refuse_a_held_folder(
    assets: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run into a folder another live run holds exits 2 naming it, writing nothing there;
    once the holder is killed (-9) the same command runs. Eval's ``--out`` likewise."""
    from paravt.eval.__main__ import main as eval_main
    from paravt.train import main as train_main

    out = tmp_path / "run"
    args = [*tiny_overrides(assets, out, 1), "train.save_every=0"]
    p = _holder(out, "a paravt.train run")
    try:
        capsys.readouterr()
        assert train_main(args) == 2
        err = capsys.readouterr().err
        assert f"{out} is in use by another process (pid {p.pid}, a paravt.train run" in err, err
        assert "another train.out_dir" in err, err
        assert sorted(x.name for x in out.iterdir()) == [FolderClaim.NAME]
        ev = tmp_path / "eval"
        q = _holder(ev, "a paravt.eval evaluation")
        try:
            eval_args = ["--benchmark", "synth", "--data-root", assets["data"], "--model",
                         assets["model"], "--out", str(ev), "--no-progress"]  # fmt: skip
            assert eval_main(eval_args) == 2
            err = capsys.readouterr().err
            assert f"pid {q.pid}, a paravt.eval evaluation" in err and "--out" in err, err
            assert sorted(x.name for x in ev.iterdir()) == [FolderClaim.NAME]
        finally:
            q.kill()
            q.wait()
    finally:
        p.kill()
        p.wait()
    assert train_main(args) == 0  # the killed holder's claim went with it
    assert (out / "metrics.jsonl").is_file() and not (out / FolderClaim.NAME).exists()
