"""Folders that a run, an evaluation or the viewer cannot use as they expect (issue 66 items
5b, 5d, 4e, 4f): a stray ``RANK`` with no distributed job, a full disk, a file system without
``flock``, a read-only folder. Each gets one line naming the folder and the fix, or (no flock)
a claim that still holds.

Honesty of the set-ups: a full file system and a read-only mount are real where the machine
allows it (``unshare -rm``: a user and mount namespace of the test's own, a 16 KiB tmpfs filled
with zeros, a read-only bind mount; gone with its process), and skipped with the reason where
it does not. The tests run as root here, where ``chmod`` blocks nothing; a non-root run uses
``chmod 0o555`` instead. A full disk is also simulated in-process (``os.pwrite`` raising
``ENOSPC``, as it does on a full disk) so that the claim's cleanup is tested everywhere. A file
system without ``flock`` cannot be made here (tmpfs, ext4 and overlayfs all have it): its
``flock`` is patched to raise ``ENOLCK`` / ``EOPNOTSUPP``, what NFS without lockd and FUSE
mounts raise; the lock files, pids and processes around it are real."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from namespaces import namespaced, run_in

from paravt.files import FolderBusy, FolderClaim, FolderError, claim_folder, writes_as_rank0

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ item 5d: a stray RANK
@pytest.mark.parametrize(
    "env, rank0",
    [
        ({}, True),
        ({"RANK": "0", "WORLD_SIZE": "4"}, True),
        ({"RANK": "1"}, True),  # a shell inside a torchrun/k8s job: no job to be rank 1 of
        ({"RANK": "1", "WORLD_SIZE": "1"}, True),
        ({"RANK": "3", "WORLD_SIZE": "junk"}, True),
        ({"RANK": "1", "WORLD_SIZE": "2"}, False),
    ],
)
def test_who_writes_as_rank0(env: dict, rank0: bool) -> None:
    assert writes_as_rank0(env) is rank0


def test_two_single_process_runs_with_a_stray_rank_cannot_share_a_folder(
    tmp_path: Path, monkeypatch
) -> None:
    # On main claim_folder returned None for RANK=1: both runs went on into the folder.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    first = claim_folder(tmp_path, "a paravt.train run")
    assert first is not None
    try:
        with pytest.raises(FolderBusy, match=rf"pid {os.getpid()}, a paravt.train run"):
            claim_folder(tmp_path, "a paravt.train run")
    finally:
        first.release()
    monkeypatch.setenv("WORLD_SIZE", "2")  # a real rank 1 of two: rank 0 holds the folder
    assert claim_folder(tmp_path, "a paravt.train run") is None


# --------------------------------------------------------------- item 5b: a full disk
def test_a_lock_record_that_hits_a_full_disk_is_one_line_and_leaves_no_lock(
    tmp_path: Path, monkeypatch
) -> None:
    # On main: a raw OSError [Errno 28] and an empty .lock left in the folder.
    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(FolderError) as e:
        FolderClaim(tmp_path, "a paravt.eval evaluation").acquire()
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path}: no space left") and "\n" not in msg
    assert "ENOSPC" in msg and "free space" in msg
    assert not isinstance(e.value, FolderBusy)
    assert not (tmp_path / FolderClaim.NAME).exists()
    monkeypatch.undo()
    with FolderClaim(tmp_path, "the next one"):  # nothing stale blocks the next claim
        pass


def test_a_really_full_file_system_is_one_line_and_leaves_no_lock(tmp_path: Path) -> None:
    if why := namespaced():
        pytest.skip(why)
    d = tmp_path / "full"
    d.mkdir()
    code = f"""
        import os
        from paravt.files import FolderClaim, FolderError
        fd = os.open({str(d / "fill")!r}, os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, bytes(4096))
        except OSError as e:
            assert e.errno == 28, e
        os.close(fd)
        out = {str(d / "out")!r}
        os.mkdir(out)
        try:
            FolderClaim(out, "a paravt.train run").acquire()
        except FolderError as e:
            print("ERR", e)
        print("LEFT", sorted(os.listdir(out)))
        """
    r = run_in(f"mount -t tmpfs -o size=16k tmpfs {d}", code)
    assert r.returncode == 0, r.stderr
    err = next(line for line in r.stdout.splitlines() if line.startswith("ERR"))
    assert f"{d / 'out'}: no space left on its file system" in err, r.stdout
    assert "LEFT []" in r.stdout, r.stdout  # no empty .lock


# ------------------------------------------------------------ item 4e: no flock
@pytest.fixture
def no_flock(monkeypatch):
    calls = []

    def flock(fd: int, op: int) -> None:
        calls.append(op)
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", flock)
    return calls


def test_without_flock_an_exclusive_lock_file_holds_the_folder(
    tmp_path: Path, no_flock, caplog
) -> None:
    # On main: a raw OSError [Errno 37] from every train and eval on such a mount.
    with caplog.at_level(logging.WARNING, logger="paravt.files"):
        first = FolderClaim(tmp_path, "a paravt.train run").acquire()
    assert no_flock and "does not support flock (ENOLCK)" in caplog.text
    rec = json.loads((tmp_path / ".lock").read_text())
    assert rec["pid"] == os.getpid() and rec["host"] == os.uname().nodename
    with pytest.raises(FolderBusy) as e:
        FolderClaim(tmp_path, "another run").acquire()
    assert f"pid {os.getpid()}, a paravt.train run" in str(e.value)
    assert f"if that process is gone, delete {tmp_path / '.lock'}" in str(e.value)
    first.release()
    assert not (tmp_path / ".lock").exists()
    FolderClaim(tmp_path, "the next run").acquire().release()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_without_flock_a_dead_holder_s_lock_is_taken_over(tmp_path: Path, no_flock) -> None:
    lock = tmp_path / ".lock"
    lock.write_text(json.dumps({"pid": _dead_pid(), "host": os.uname().nodename}))
    with FolderClaim(tmp_path, "a run") as c:  # kill -9'd holder: stale, removed
        assert json.loads(lock.read_text())["pid"] == os.getpid() and not c.flock
    # Another host's holder cannot be checked: refused, naming the host and the fix.
    lock.write_text(json.dumps({"pid": _dead_pid(), "host": "node-7", "what": "a run"}))
    with pytest.raises(FolderBusy, match=r"on host node-7, a run.*delete .*\.lock"):
        FolderClaim(tmp_path, "b").acquire()
    # A lock file with no record: a holder between creating and writing it (busy), or one
    # that died there (stale once _EMPTY_LOCK_STALE_S old).
    lock.write_text("")
    t0 = time.monotonic()
    with pytest.raises(FolderBusy):
        FolderClaim(tmp_path, "b").acquire()
    assert time.monotonic() - t0 < 5
    old = time.time() - 60
    os.utime(lock, (old, old))
    FolderClaim(tmp_path, "b").acquire().release()
    assert not lock.exists()


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.ENOSYS])
def test_other_no_flock_errors_fall_back_too(tmp_path: Path, monkeypatch, code: int) -> None:
    def flock(fd: int, op: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", flock)
    with FolderClaim(tmp_path, "a run") as c:
        assert not c.flock and (tmp_path / ".lock").exists()


# ---------------------------------------------------------- item 4f: read-only folders
def _read_only(tmp_path: Path) -> tuple[Path, str]:
    """A folder nobody may write (and the sh setup that makes it so, in a namespace)."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        return d, ""
    if why := namespaced():
        pytest.skip(f"running as root, where chmod blocks nothing, and {why}")
    return d, f"mount --bind {d} {d} && mount -o remount,bind,ro {d}"


def test_a_read_only_output_folder_is_one_line(tmp_path: Path) -> None:
    # On main: a raw OSError (EROFS / EACCES) from the lock file's open, in train and eval.
    d, setup = _read_only(tmp_path)
    code = f"""
        from paravt.files import FolderError, claim_folder
        for out in ({str(d)!r}, {str(d / "sub")!r}):
            try:
                claim_folder(out, "a paravt.eval evaluation")
            except FolderError as e:
                print("ERR", e)
        """
    r = run_in(setup, code)
    assert r.returncode == 0, r.stderr
    errs = [line for line in r.stdout.splitlines() if line.startswith("ERR")]
    assert len(errs) == 2, r.stdout
    for out, err in zip((d, d / "sub"), errs):
        assert err.startswith(f"ERR {out} is not writable (") or err.startswith(f"ERR {d} is not")
        assert "a paravt.eval evaluation writes its records there" in err
        assert "choose another folder" in err


def test_view_of_a_read_only_run_folder_is_one_line(tmp_path: Path) -> None:
    # On main: a raw OSError traceback from writing RUN/view.
    d, setup = _read_only(tmp_path)
    if os.geteuid() != 0:
        d.chmod(0o755)
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "kind": "train"}) + "\n")
    if os.geteuid() != 0:
        d.chmod(0o555)
    code = f"""
        import sys
        from paravt.view import main
        sys.exit(main([{str(d)!r}]))
        """
    r = run_in(setup, code)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert f"{d / 'view'}" in r.stderr and "--out DIR" in r.stderr
    assert not (d / "view").exists()


def test_an_experiment_driver_on_a_read_only_out_is_one_line(tmp_path: Path) -> None:
    # On main: a raw OSError traceback from the driver's lock (its mkdir, then its open).
    d, setup = _read_only(tmp_path)
    code = f"""
        import sys
        from paravt.experiments import main
        sys.exit(main(["ablation", "--seeds", "1", "--arms", "vanilla", "--out",
                       {str(d / "abl")!r}]))
        """
    r = run_in(setup, code)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert f"error: {d}" in r.stderr and "is not writable" in r.stderr, r.stderr
    assert not (d / "abl").exists()
