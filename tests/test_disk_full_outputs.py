"""A full disk outside training (whose run folder has its own test, test_run_disk_full.py):
the evaluation's results.jsonl, run.json and summary.json, the viewer's pages and
TensorBoard's writer thread each end in the one-line error training gives (the path, the free
bytes, the fix), with every finished row intact and no 0-byte page. Writes are failed by
patching ``open``, as test_run_disk_full.py does: no model, seconds."""

from __future__ import annotations

import builtins
import errno
import json
import os
from pathlib import Path

import pytest
from eval_stubs import FailingRunner, eval_settings

from paravt.eval.runner import load_results, run_eval
from paravt.metrics import DiskFullError, read_metrics
from paravt.types import Sample


def _enospc(path: object) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _Half:
    """A file whose writes put half their text on disk, then fail as a full disk does."""

    def __init__(self, f) -> None:
        self.f = f

    def write(self, text):
        self.f.write(text[: len(text) // 2])
        self.f.flush()
        raise _enospc(self.f.name)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def _fill(monkeypatch, under: Path, *, after: int = 0, name: str = "") -> None:
    """Writes under ``under`` (to files named ``name``, when given) fail from the ``after``-th
    open for writing on: half their text written first."""
    real_open = builtins.open
    seen = {"n": 0}

    def open_(file, mode="r", *a, **k):
        f = real_open(file, mode, *a, **k)
        if any(c in mode for c in "wax") and str(under) in os.path.abspath(str(file)):
            if not name or Path(file).name == name or name in Path(file).name:
                seen["n"] += 1
                if seen["n"] > after:
                    return _Half(f)
        return f

    monkeypatch.setattr(builtins, "open", open_)


def _samples(tmp_path: Path, n: int = 3) -> list[Sample]:
    video = tmp_path / "v.mp4"
    video.write_bytes(b"never read")
    return [Sample(f"s{i}", str(video), "q?", "A") for i in range(n)]


def _one_line(msg: str, path: Path) -> None:
    assert "\n" not in msg, msg
    assert str(path) in msg and "No space left on device (ENOSPC)" in msg, msg
    assert " bytes are free on the file system of " in msg and "rerun" in msg, msg


def test_eval_results_row_on_a_full_disk_keeps_every_finished_row(tmp_path, monkeypatch):
    out = tmp_path / "eval"
    samples = _samples(tmp_path)
    with monkeypatch.context() as m:
        _fill(m, out, after=1, name="results.jsonl")  # the second row's write fails
        with pytest.raises(DiskFullError) as e:
            run_eval(
                samples, FailingRunner(), out, eval_settings(), batch_size=1, show_progress=False
            )
    _one_line(str(e.value), out / "results.jsonl")
    lines = (out / "results.jsonl").read_bytes().split(b"\n")
    assert lines[-1] == b"" and [json.loads(x)["id"] for x in lines[:-1]] == ["s0"]
    # Room again: the same command resumes and finishes.
    summary = run_eval(samples, FailingRunner(), out, eval_settings(), show_progress=False)
    assert summary["n"] == 3 and sorted(load_results(out)) == ["s0", "s1", "s2"]


@pytest.mark.parametrize("name", ["run.json", "summary.json", "results.jsonl.tmp"])
def test_eval_records_on_a_full_disk_are_one_line(tmp_path, monkeypatch, name):
    out = tmp_path / "eval"
    samples = _samples(tmp_path, 2)
    if name != "run.json":  # a first run with room: the rows are there
        run_eval(samples, FailingRunner(), out, eval_settings(), show_progress=False)
        before = (out / "results.jsonl").read_bytes()
    with monkeypatch.context() as m:
        _fill(m, out, name=name.removesuffix(".tmp"))
        with pytest.raises(DiskFullError) as e:
            run_eval(samples, FailingRunner(), out, eval_settings(), show_progress=False)
    _one_line(str(e.value), out / name.removesuffix(".tmp"))
    if name != "run.json":
        assert len(load_results(out)) == 2
        if name == "results.jsonl.tmp":  # the merge's rewrite: the old file is intact
            assert (out / "results.jsonl").read_bytes().startswith(before)
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_view_on_a_full_disk_is_one_line_and_leaves_no_empty_page(tmp_path, monkeypatch, capsys):
    from paravt.view import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "kind": "train"}) + "\n")
    with monkeypatch.context() as m:
        _fill(m, run / "view")
        assert main([str(run)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    _one_line(err.strip(), run / "view" / "index.html")
    assert not (run / "view" / "index.html").exists()  # no 0-byte page
    assert main([str(run)]) == 0 and (run / "view" / "index.html").stat().st_size > 0


def test_tensorboard_s_writer_thread_on_a_full_disk_prints_no_traceback(
    tmp_path, capsys, monkeypatch
):
    """TensorBoard writes from a thread of its own: a full disk there raised in that thread
    (a traceback of its own on stderr, through ``threading.excepthook``) and again at the next
    flush. Now the thread is quiet and the run's one-line DiskFullError names the tb/ folder."""
    import threading

    from tensorboard.summary.writer import record_writer

    from paravt.metrics import MetricsLogger

    unhandled: list[BaseException] = []  # what the thread would print (pytest's hook hides it)
    monkeypatch.setattr(threading, "excepthook", lambda a: unhandled.append(a.exc_value))
    logger = MetricsLogger(tmp_path, tensorboard=True)
    real = record_writer.RecordWriter.write

    def write(self, data):
        raise _enospc("events")

    record_writer.RecordWriter.write = write
    try:
        with pytest.raises(DiskFullError) as e:
            logger.log(1, {"loss": 0.5})
        worker = logger._tb.file_writer.event_writer._async_writer._worker
        worker.join(10)
    finally:
        record_writer.RecordWriter.write = real
    assert str(tmp_path / "tb") in str(e.value) and "bytes are free" in str(e.value)
    err = capsys.readouterr().err
    assert unhandled == [] and "Traceback" not in err, (unhandled, err)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]  # row kept
