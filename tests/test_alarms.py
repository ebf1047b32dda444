"""Collapse alarms (paravt.alarms) on synthetic metric streams: each fires on its collapse, at
the step the rolling mean crosses, once, and never on a healthy (noisy) stream."""

from __future__ import annotations

import random
import re

import pytest

from paravt.alarms import CollapseDetector, detect_alarms
from paravt.config import ConfigError, load_config

KW = {"window": 4, "tool_frac": 0.5, "closure_frac": 0.5, "parse_rise": 0.25}


def healthy(n: int, seed: int = 0) -> list[dict]:
    """Noisy but stable rates (tool ~0.7, K8 ~0.6 every other step, closure ~0.9, errors ~0.1)."""
    rng = random.Random(seed)
    rows = []
    for s in range(1, n + 1):
        r = {
            "step": s,
            "kind": "train",
            "tool_call_rate": 0.7 + rng.uniform(-0.15, 0.15),
            "think_closure_rate": 0.9 + rng.uniform(-0.1, 0.1),
            "parse_error_rate": 0.1 + rng.uniform(-0.08, 0.08),
            "tool_rate/K4": 0.8 + rng.uniform(-0.1, 0.1),
        }
        if s % 2 == 0:
            r["tool_rate/K8"] = 0.6 + rng.uniform(-0.1, 0.1)
        rows.append(r)
    return rows


def test_healthy_stream_never_alarms() -> None:
    rows = healthy(60)
    rows.insert(10, {"step": 10, "kind": "eval_before", "tool_call_rate": 0.0})  # not a step
    rows[20]["tool_call_rate"] = None  # a NaN logged as null is skipped
    assert detect_alarms(rows, **KW) == []


def test_overall_tool_rate_collapse_fires_once_at_the_crossing() -> None:
    rows = healthy(40)
    for r in rows[19:]:  # steps 20.. : tool use gone
        r["tool_call_rate"] = 0.0
    alarms = detect_alarms(rows, **KW)
    assert [a.metric for a in alarms] == ["tool_call_rate"]
    a = alarms[0]
    base = sum(r["tool_call_rate"] for r in rows[:4]) / 4
    assert a.baseline == pytest.approx(base) and a.threshold == pytest.approx(0.5 * base)
    # The first step whose last-4 mean is below half the start: 2-3 zero steps in (step 21
    # or 22, depending on the noise of the two ~0.7 values still in the window).
    expect = next(
        r["step"]
        for i, r in enumerate(rows)
        if i >= 4 and sum(x["tool_call_rate"] for x in rows[i - 3 : i + 1]) / 4 < 0.5 * base
    )
    assert a.step == expect and 21 <= a.step <= 22
    assert "tool-call rate collapsed" in a.message and a.value < a.threshold


def test_per_k_collapse_fires_for_that_k_only() -> None:
    rows = healthy(60)
    for r in rows[30:]:
        if "tool_rate/K8" in r:
            r["tool_rate/K8"] = 0.05
    alarms = detect_alarms(rows, **KW)
    assert [a.metric for a in alarms] == ["tool_rate/K8"]
    # K8 is observed every other step: its window spans 8 steps, and it crosses after two of
    # its own collapsed observations (steps 32 and 34).
    assert alarms[0].step == 34
    assert "K8" in alarms[0].message


def test_closure_collapse_and_parse_error_rise() -> None:
    rows = healthy(40)
    for r in rows[15:]:
        r["think_closure_rate"] = 0.1
    for r in rows[25:]:
        r["parse_error_rate"] = 0.9
    alarms = detect_alarms(rows, **KW)
    assert [(a.metric, a.step) for a in alarms] == [
        ("think_closure_rate", 18),
        ("parse_error_rate", 27),
    ]
    assert "</think> closure collapsed" in alarms[0].message
    assert "parse-error rate rose" in alarms[1].message


def test_alarm_rearms_after_recovery_and_disabled_checks_stay_silent() -> None:
    rows = healthy(50)
    for r in rows[10:20] + rows[35:]:
        r["tool_call_rate"] = 0.0
    first, second = (a.step for a in detect_alarms(rows, **KW))
    assert 12 <= first <= 13 and 37 <= second <= 38  # 2-3 collapsed steps into each
    assert detect_alarms(rows, **{**KW, "tool_frac": 0.0}) == []


def test_replay_equals_streaming() -> None:
    rows = healthy(40)
    for r in rows[20:]:
        r["tool_call_rate"] = 0.0
    det = CollapseDetector(**KW)
    streamed = [a for r in rows for a in det.update(r["step"], r)]
    assert streamed == detect_alarms(rows, **KW) and len(streamed) == 1
    # Resume: replaying the first 22 rows, then streaming the rest, fires nothing twice.
    det2 = CollapseDetector(**KW)
    before = det2.replay(rows[:22])
    after = [a for r in rows[22:] for a in det2.update(r["step"], r)]
    assert before + after == streamed and after == []


@pytest.mark.parametrize(
    "kv, msg",
    [
        ("train.alarm_window=0", "train.alarm_window=0 must be >= 1"),
        ("train.alarm_tool_frac=1.5", "train.alarm_tool_frac=1.5 must be in [0, 1)"),
        ("train.alarm_closure_frac=-0.1", "train.alarm_closure_frac=-0.1 must be in [0, 1)"),
        ("train.alarm_parse_rise=0", "train.alarm_parse_rise=0.0 must be > 0"),
        ("train.viewer_max_mb=-1", "train.viewer_max_mb=-1.0 must be >= 0"),
    ],
)
def test_alarm_config_errors(kv: str, msg: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(msg)):
        load_config(overrides=[kv])
