"""``paravt.train.run``'s typed result (``paravt.run.RunResult``) from real short runs of the
tiny config of test_train_resume.py: a run that finishes, one that a SIGTERM stops at a step
boundary and one whose step a SIGTERM abandons (``paravt.run._stop``, the one stop path).
The lost-worker stop is test_train_async.py's (a torchrun job)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from test_train_resume import tiny_overrides

from paravt.config import load_config
from paravt.metrics import read_metrics
from paravt.preempt import TEST_SIGNAL_ENV


def _rows(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]


def test_a_finished_run_returns_its_fields(assets, tmp_path: Path) -> None:
    from paravt.run import RunResult
    from paravt.train import run

    out = tmp_path / "run"
    res = run(load_config(overrides=tiny_overrides(assets, out, 2)))
    assert isinstance(res, RunResult)
    assert res.out_dir == str(out) and res.stopped is None and res.ok
    assert res.before == {} and res.after == {}  # train.eval_prompts=0: no evaluation
    assert res.worker is None and res.worker_totals == {}
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert res.last["loss"] == rows[-1]["loss"] and res.last["time/step"] > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.last = {}  # type: ignore[misc]


def test_a_sigterm_at_a_step_boundary_is_a_signal_stop(
    assets, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """SIGTERM during step 2's update (the default 30 s grace: the step is finished): the
    next boundary stops the run, step 2 is checkpointed, and the result says so."""
    from paravt.run import StopReason
    from paravt.train import run

    monkeypatch.setenv(TEST_SIGNAL_ENV, "SIGTERM:2:update")
    out = tmp_path / "run"
    res = run(load_config(overrides=tiny_overrides(assets, out, 3)))
    stop = res.stopped
    assert stop is not None and stop.ok and res.ok
    assert stop.reason is StopReason.SIGNAL
    assert (stop.step, stop.outcome) == (2, "finished step 2")
    assert stop.checkpoint == str(out / "checkpoints" / "step_000002")
    assert (Path(stop.checkpoint) / "config.json").is_file()
    assert (stop.signal, stop.signal_step, stop.phase, stop.ranks) == ("SIGTERM", 2, "update", (0,))
    assert 0 < stop.seconds < 30
    assert stop.message.startswith(
        f"[preempt] SIGTERM at step 2 (update): finished step 2, checkpoint {stop.checkpoint}"
        " written in "
    )
    said = capsys.readouterr()
    assert "; exiting 0 " in stop.message and stop.message in said.out + said.err
    assert res.after == {} and res.last["loss"] == _rows(out)[-1]["loss"]
    assert [r["step"] for r in _rows(out)] == [1, 2]


def test_a_sigterm_past_the_grace_abandons_the_step(
    assets, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """SIGTERM during step 2's rollout with a grace no step fits: step 2 is abandoned and
    step 1 checkpointed (step 1 itself wrote none: train.save_every=3)."""
    from paravt.run import StopReason
    from paravt.train import run

    monkeypatch.setenv(TEST_SIGNAL_ENV, "SIGTERM:2:rollout")
    out = tmp_path / "run"
    over = [*tiny_overrides(assets, out, 3), "train.preempt_grace_s=0.001"]
    res = run(load_config(overrides=over))
    stop = res.stopped
    assert stop is not None and stop.ok
    assert stop.reason is StopReason.ABANDONED and stop.step == 1
    assert stop.outcome.startswith("abandoned step 2 after its rollout")
    assert stop.checkpoint == str(out / "checkpoints" / "step_000001")
    assert (stop.signal, stop.signal_step, stop.phase) == ("SIGTERM", 2, "rollout")
    assert ", past the grace of 0.001 s" in stop.message
    said = capsys.readouterr()
    assert stop.message in said.out + said.err
    assert [r["step"] for r in _rows(out)] == [1] and res.last["loss"] == _rows(out)[0]["loss"]
