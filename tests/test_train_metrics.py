"""Run-folder metrics: rollout behaviour metrics on hand-built trajectories, the jsonl /
TensorBoard logger, resume truncation, the summary plot and the final table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paravt.metrics import (
    MetricsLogger,
    format_table,
    plot_summary,
    read_metrics,
    rollout_metrics,
    trajectory_record,
)
from paravt.types import ToolCall, Trajectory, Turn

P = "<think>\n"


def _traj(turns: list[Turn], acc: float, reward: float) -> Trajectory:
    return Trajectory(
        uid="u", role="main", sample_id="s", group_id=0, tokens=[1, 2, 3], loss_mask=[0, 1, 1],
        logprobs=[0.0, -1.0, -1.0], prompt_len=1, turns=turns, reward=reward,
        reward_breakdown={"acc": acc, "fmt": 1.0, "total": reward},
    )  # fmt: skip


def test_rollout_metrics_on_known_trajectories() -> None:
    ok = ToolCall(raw="...", status="ok")
    bad = ToolCall(raw="...", status="bad_json")
    good = _traj(
        [
            Turn("plan\n</think>\n<tool_call>{}</tool_call>", calls=[ok, bad], prefix=P),
            Turn("seen\n</think>\n<answer>A</answer>", prefix=P),
        ],
        acc=1.0,
        reward=2.0,
    )
    unclosed = _traj([Turn("rambling without closing", prefix=P)], acc=0.0, reward=-0.5)
    forced = _traj(
        [
            Turn("x\n</think>\n<tool_call>{}</tool_call>", calls=[bad], prefix=P),
            Turn("B</answer>", prefix=P + "\nI must answer now.\n</think>\n<answer>",
                 forced_answer=True),
        ],
        acc=0.0,
        reward=0.5,
    )  # fmt: skip
    recs = [trajectory_record(good, 8), trajectory_record(unclosed, 8)]
    recs.append(trajectory_record(forced, 16))
    m = rollout_metrics(recs)
    assert m["format_compliance"] == pytest.approx(1 / 3)  # only `good` is well-formed end to end
    assert m["think_closure_rate"] == pytest.approx(3 / 4)  # non-forced turns: 2 + 0 + 1 of 4
    assert m["tool_calls_per_rollout"] == pytest.approx(3 / 3)
    assert m["tool_call_rate"] == pytest.approx(1 / 3)  # only `good` executed a valid crop
    assert m["parse_error_rate"] == pytest.approx(2 / 3)
    assert m["accuracy"] == pytest.approx(1 / 3)
    assert m["reward/total"] == pytest.approx(2 / 3)
    assert m["acc/K8"] == 0.5 and m["acc/K16"] == 0.0
    assert m["tool_rate/K8"] == 0.5 and m["count/K16"] == 1.0


def test_calls_are_counted_per_tool_and_logged_with_their_tool() -> None:
    """``tool_calls/<name>``: per rollout, every call naming a tool of the run (whatever its
    status); a call naming none (bad JSON, a name no tool has: model text) only in the totals.
    Each logged call carries the tool it names."""
    from paravt.metrics import call_record

    crop = ToolCall(raw="c", name="crop_video", status="ok", start=1.0, end=3.0)
    bad_crop = ToolCall(raw="c", name="crop_video", status="bad_range")
    zoom = ToolCall(raw="z", name="zoom_frame", status="ok", start=5.0, end=5.0)
    made_up = ToolCall(raw="p", name="<b>pan</b>", status="unknown_tool")
    no_json = ToolCall(raw="{", status="bad_json")
    t1 = _traj([Turn("a", calls=[crop, zoom, bad_crop], prefix=P)], acc=1.0, reward=1.0)
    t2 = _traj([Turn("b", calls=[crop, made_up, no_json], prefix=P)], acc=0.0, reward=0.0)
    t3 = _traj([Turn("c", prefix=P)], acc=0.0, reward=0.0)
    recs = [trajectory_record(t, 4) for t in (t1, t2, t3)]
    assert recs[0]["tool_calls"] == {"crop_video": 2, "zoom_frame": 1}
    assert recs[1]["tool_calls"] == {"crop_video": 1} and recs[2]["tool_calls"] == {}
    m = rollout_metrics(recs)
    assert m["tool_calls/crop_video"] == pytest.approx(3 / 3)
    assert m["tool_calls/zoom_frame"] == pytest.approx(1 / 3)
    assert sorted(k for k in m if k.startswith("tool_calls/")) == [
        "tool_calls/crop_video",
        "tool_calls/zoom_frame",
    ]
    assert m["tool_calls_per_rollout"] == pytest.approx(6 / 3)  # every block, as before
    assert call_record(zoom)["tool"] == "zoom_frame" and call_record(no_json)["tool"] == ""
    assert "tool_calls/crop_video" not in rollout_metrics([recs[2]])


def test_logger_jsonl_tensorboard_truncate_plot_and_table(tmp_path: Path) -> None:
    log = MetricsLogger(tmp_path, tensorboard=True)
    for step in range(1, 6):
        log.log(step, {"reward/total": 0.1 * step, "kl": float("nan"), "accuracy": 0.5})
    log.log_trajectories(3, [{"uid": "a"}])
    log.log_trajectories(5, [{"uid": "b"}])
    log.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[0]["kl"] is None  # NaN is not JSON: stored as null
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))

    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "ki')  # torn by a kill
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 5
    MetricsLogger(tmp_path, tensorboard=False).truncate_after(3)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    traj = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert [t["uid"] for t in traj] == ["a"]

    png = plot_summary(tmp_path / "metrics.jsonl", tmp_path / "summary.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    table = format_table({"before RL": {"accuracy": 0.25}, "after RL": {"accuracy": 0.5}})
    lines = table.splitlines()
    assert "before RL" in lines[0] and "after RL" in lines[0]
    acc_line = next(x for x in lines if x.startswith("accuracy"))
    assert acc_line.split()[-2:] == ["0.250", "0.500"]
    assert "n/a" in next(x for x in lines if x.startswith("tool-call rate"))


def test_disabled_logger_writes_nothing(tmp_path: Path) -> None:
    log = MetricsLogger(tmp_path / "r1", enabled=False)
    log.log(1, {"loss": 1.0})
    assert not (tmp_path / "r1").exists()
