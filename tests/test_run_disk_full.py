"""Issue 34 item 15: the disk fills after a checkpoint. Every run-folder write (metrics rows,
TensorBoard, trajectories, thumbnails, the summary plot) then handles ``ENOSPC`` as checkpoints
do: ``train.on_save_error=fail`` exits 1 naming the file, the free space and the way out;
``continue`` warns once per kind of write and trains to the end.

The full disk is simulated as in ``test_checkpoint_disk_full.py``: ``OSError(ENOSPC)`` from
every write into the run folder once step 1's checkpoint is written."""

from __future__ import annotations

import builtins
import errno
import os
from pathlib import Path

import pytest
from test_train import small_overrides

from paravt import checkpoint as C
from paravt.metrics import DiskFullError, MetricsLogger


def _enospc(path: object) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def _fill_disk_after_step1(out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From the end of step 1's checkpoint on, every write under ``out`` fails."""
    import matplotlib.figure
    import torch
    from torch.utils.tensorboard import SummaryWriter

    import paravt.run as R

    full = {"on": False}
    real_save, real_open = R.save_trainer, builtins.open
    real_write_bytes, real_write_text = Path.write_bytes, Path.write_text
    real_torch_save, real_flush = torch.save, SummaryWriter.flush

    def save_trainer(tr, step, **k):
        ok = real_save(tr, step, **k)
        full["on"] = True
        return ok

    def inside(p: object) -> bool:
        return full["on"] and str(out) in os.path.abspath(str(p))

    def open_(file, mode="r", *a, **k):
        if any(c in mode for c in "wax") and inside(file):
            raise _enospc(file)
        return real_open(file, mode, *a, **k)

    def write_bytes(self, data):
        if inside(self):
            raise _enospc(self)
        return real_write_bytes(self, data)

    def write_text(self, data, *a, **k):
        if inside(self):
            raise _enospc(self)
        return real_write_text(self, data, *a, **k)

    def torch_save(obj, f, *a, **k):
        if full["on"]:
            raise _enospc(getattr(f, "name", f))
        return real_torch_save(obj, f, *a, **k)

    def flush(self):
        if full["on"]:
            raise _enospc(self.log_dir)
        return real_flush(self)

    def savefig(self, fname, *a, **k):
        if inside(fname):
            raise _enospc(fname)
        raise AssertionError("unreachable: the plot is only saved into the run folder")

    monkeypatch.setattr(R, "save_trainer", save_trainer)
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    monkeypatch.setattr(Path, "write_text", write_text)
    monkeypatch.setattr(torch, "save", torch_save)
    monkeypatch.setattr(SummaryWriter, "flush", flush)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)


def test_continue_warns_once_per_write_and_trains_on(
    assets, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from paravt.train import main

    out = tmp_path / "run"
    _fill_disk_after_step1(out, monkeypatch)
    rc = main(
        [
            *small_overrides(assets, out, **{"train.steps": 3, "train.dump_batches": "true"}),
            "train.on_save_error=continue",
        ]
    )
    cap = capsys.readouterr()
    assert rc == 0, cap.err[-3000:]
    assert "[train] 3 steps in" in cap.out  # trained to the end
    for what in ("metrics.jsonl", "trajectories.jsonl", "thumbs", "tb", "summary.png", "debug"):
        warns = [ln for ln in cap.err.splitlines() if "warning" in ln and f"{out}/{what}" in ln]
        assert len(warns) == 1, (what, cap.err[-3000:])
        assert "No space left on device" in warns[0] and "bytes are free" in warns[0]
    # What was written before the disk filled is whole: step 1's row, no torn line.
    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert [r[:11] for r in rows] == ['{"step": 1,']
    assert C.latest_checkpoint(out).name == "step_000001"


def test_fail_exits_1_naming_the_file(
    assets, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from paravt.train import main

    out = tmp_path / "run"
    _fill_disk_after_step1(out, monkeypatch)
    rc = main(small_overrides(assets, out))
    err = capsys.readouterr().err
    assert rc == 1, err[-3000:]
    line = [ln for ln in err.splitlines() if ln.startswith("error:")][0]
    assert str(out) in line and "No space left on device" in line and "bytes are free" in line
    assert "train.on_save_error=continue" in line and "--resume" in line
    assert "Traceback" not in err
    assert C.latest_checkpoint(out).name == "step_000001"


def test_a_failed_append_leaves_no_torn_row(tmp_path: Path, monkeypatch) -> None:
    """A metrics row cut short by a full disk is removed (the next row starts its own line);
    the default policy raises ``DiskFullError`` naming the file."""
    from paravt.metrics import read_metrics

    real_open = builtins.open

    class Torn:  # writes part of the row, then the disk is full
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, s):
            self.f.write(s[:7])
            self.f.flush()
            raise _enospc(self.f.name)

    def torn_open(f, m="r", *a, **k):
        return Torn(real_open(f, m, *a, **k)) if "a" in m else real_open(f, m, *a, **k)

    for policy in ("continue", "fail"):
        d = tmp_path / policy
        log = MetricsLogger(d, tensorboard=False, on_disk_full=policy)
        log.log(1, {"a": 1.0})
        monkeypatch.setattr(builtins, "open", torn_open)
        if policy == "fail":
            with pytest.raises(
                DiskFullError, match=rf"{d / 'metrics.jsonl'} could not be written: No space left"
            ):
                log.log(2, {"a": 2.0})
        else:
            log.log(2, {"a": 2.0})
        monkeypatch.setattr(builtins, "open", real_open)
        log.log(3, {"a": 3.0})
        assert [r["step"] for r in read_metrics(d / "metrics.jsonl")] == [1, 3]
        assert (d / "metrics.jsonl").read_text().count("\n") == 2
