"""Issue 34 item 18: a step whose every video read failed (0 groups) logs no accuracy or
reward value (not 0.0), raises an alarm row, and ``train.max_empty_steps`` empty steps in a row
stop the run with an error naming the skipped prompts' errors."""

from __future__ import annotations

import json
from pathlib import Path

from test_train import small_overrides

from paravt.metrics import read_metrics, rollout_metrics


def _unreadable_dataset(d: Path) -> Path:
    """Two rows whose .mp4 files exist but hold no video (a torn download)."""
    d.mkdir(parents=True)
    rows = []
    for i in range(2):
        (d / f"v{i}.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"junk" * 64)
        rows.append({"id": f"r{i}", "video": f"v{i}.mp4", "question": "Which colour?",
                     "answer": "A", "options": ["red", "blue"]})  # fmt: skip
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d / "train.jsonl"


def test_no_records_log_no_rollout_values() -> None:
    m = rollout_metrics([])
    assert "accuracy" not in m and "reward/total" not in m and "tool_call_rate" not in m
    assert m == {}


def test_steps_on_nothing_stop_the_run(assets, tmp_path: Path, capsys) -> None:
    from paravt.train import main

    out = tmp_path / "run"
    data = _unreadable_dataset(tmp_path / "data")
    rc = main(
        small_overrides(assets, out, **{"data.path": str(data), "sft.steps": 0,
                                         "train.steps": 5, "train.max_empty_steps": 2})
    )  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 1, err[-3000:]
    line = [ln for ln in err.splitlines() if ln.startswith("error:")][0]
    assert "2 steps in a row trained on nothing" in line, line
    assert "sample r0: skipped, its video could not be read" in line, line
    assert "train.max_empty_steps" in line
    rows = read_metrics(out / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["num_groups"] == 0.0 and r["skipped_prompts"] == 2.0
        for k in ("accuracy", "reward/total", "reward/acc", "tool_call_rate", "loss", "kl"):
            assert k not in r, (k, r)
    alarms = [r for r in rows if r["kind"] == "alarm"]
    assert [(a["step"], a["metric"]) for a in alarms] == [(1, "num_groups"), (2, "num_groups")]


def test_an_empty_step_alone_is_an_alarm_not_a_failure(assets, tmp_path: Path, capsys) -> None:
    from paravt.train import main

    out = tmp_path / "run"
    data = _unreadable_dataset(tmp_path / "data")
    rc = main(
        small_overrides(assets, out, **{"data.path": str(data), "sft.steps": 0,
                                         "train.steps": 2, "train.max_empty_steps": 0,
                                         "train.eval_prompts": 2})
    )  # fmt: skip
    assert rc == 0, capsys.readouterr().err[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows if r["kind"] == "alarm"] == [1, 2]
    # The evaluations had no rollout either: no value (null), not 0.0.
    ev = {r["kind"]: r for r in rows if r["kind"].startswith("eval")}
    assert sorted(ev) == ["eval_after", "eval_before"]
    assert all(r["accuracy"] is None and "tool_call_rate" not in r for r in ev.values())
