"""Stand-ins for an evaluation without a model, for tests that exercise ``run_eval``'s files
(not a test module: tests import it by name).

* ``eval_settings()``: the ``EvalSettings`` of a small synth evaluation.
* ``missing_samples(tmp_path, n)``: ``n`` samples whose video does not exist (error rows of
  kind "missing": no rollout is asked for).
* ``NoEngine``: a runner that fails the test if it is asked to roll out; ``FailingRunner``:
  one whose every rollout fails (engine error rows), recording what it was asked for.
"""

from __future__ import annotations

from pathlib import Path

from paravt.eval.runner import EvalSettings
from paravt.types import Sample


def eval_settings() -> EvalSettings:
    return EvalSettings("synth", "x", "m", "hf", 4, "subagent", 0.0, 1.0, 0.0, 3, 5, 24)


def missing_samples(tmp_path: Path, n: int = 2) -> list[Sample]:
    return [Sample(f"s{i}", str(tmp_path / f"none{i}.mp4"), "q?", "A") for i in range(n)]


class NoEngine:
    """A runner that is never asked to roll out: every sample's video is missing."""

    def rollout(self, *a, **k):
        raise AssertionError("no sample had a video")


class FailingRunner:
    """A runner whose every rollout fails as a lost engine does (engine error rows, retried by
    a rerun); ``asked``: the ids of the samples it was asked for, in order."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def rollout(self, samples, *a, **k):
        self.asked += [s.id for s in samples]
        raise RuntimeError("no engine here")
