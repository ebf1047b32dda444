"""``paravt.files``: what paravt writes into folders it did not create (a run folder, an
evaluation's ``--out``) never goes through a planted symlink, and what it reads is split into
JSONL rows one way. The viewer's pages have their test in ``test_view.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paravt.config import load_config
from paravt.eval.runner import EvalSettings, run_eval
from paravt.files import NotRegularFile
from paravt.metrics import MetricsLogger
from paravt.runfolder import record_run
from paravt.types import Sample


def _victim(tmp_path: Path) -> Path:
    v = tmp_path / "victim"
    v.write_text("precious\n")
    return v


def _settings() -> EvalSettings:
    return EvalSettings("synth", "x", "m", "hf", 4, "subagent", 0.0, 1.0, 0.0, 3, 5, 24)


class _NoEngine:
    """A runner that is never asked to roll out: every sample's video is missing."""

    def rollout(self, *a, **k):
        raise AssertionError("no sample had a video")


def _missing(tmp_path: Path, n: int = 2) -> list[Sample]:
    return [Sample(f"s{i}", str(tmp_path / f"none{i}.mp4"), "q?", "A") for i in range(n)]


def test_run_records_replace_a_planted_symlink(tmp_path) -> None:
    """run.json of a training run and run.json / summary.json / results.jsonl of an
    evaluation are written through a temporary and a rename: a link planted at one (or at the
    old fixed temporary name) is replaced, the file it points to untouched."""
    victim = _victim(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    for name in ("run.json", ".run.json.tmp"):
        (run / name).symlink_to(victim)
    cfg = load_config("tiny_cpu", overrides=[f"train.out_dir={run}"])
    record_run(cfg)
    assert victim.read_text() == "precious\n" and not (run / "run.json").is_symlink()
    assert json.loads((run / "run.json").read_text())["config"]["train"]["out_dir"] == str(run)

    out = tmp_path / "eval"
    out.mkdir()
    for name in ("run.json", "summary.json", "results.jsonl.tmp"):
        (out / name).symlink_to(victim)
    summary = run_eval(_missing(tmp_path), _NoEngine(), out, _settings(), show_progress=False)
    assert summary["n"] == 2 and summary["n_errors"] == 2
    assert victim.read_text() == "precious\n"
    assert json.loads((out / "run.json").read_text())["benchmark"] == "synth"
    assert json.loads((out / "summary.json").read_text())["n"] == 2
    assert not any((out / n).is_symlink() for n in ("run.json", "summary.json"))


def test_appended_files_refuse_a_symlink_or_fifo(tmp_path) -> None:
    """metrics.jsonl and an evaluation's results.jsonl are appended a line at a time: a link
    (or a FIFO) in their place is refused with the path, what it is and the fix."""
    import os

    victim = _victim(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(victim)
    logger = MetricsLogger(run, tensorboard=False)
    with pytest.raises(NotRegularFile, match="metrics.jsonl is a symbolic link") as e:
        logger.log(1, {"loss": 0.5})
    assert "remove it" in str(e.value)
    assert victim.read_text() == "precious\n"

    out = tmp_path / "eval"
    out.mkdir()
    os.mkfifo(out / "results.jsonl")
    with pytest.raises(NotRegularFile, match=r"results.jsonl is a FIFO \(named pipe\)"):
        run_eval(_missing(tmp_path), _NoEngine(), out, _settings(), show_progress=False)
