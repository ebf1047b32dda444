"""Collapse alarms (paravt.alarms) on synthetic metric streams: each fires on its collapse, at
the step the rolling mean crosses, once, and never on a healthy (noisy) stream."""

from __future__ import annotations

import random
import re

import pytest

from paravt.alarms import CollapseDetector, detect_alarms
from paravt.config import ConfigError, load_config

KW = {"window": 4, "tool_frac": 0.5, "closure_frac": 0.5, "parse_rise": 0.25}


def set_rate(row: dict, key: str, value: float, prompts: int = 8, sd: float = 0.15) -> None:
    """A tool-call rate as a step row carries it: the mean of ``prompts`` per-prompt rates
    whose spread is ``sd`` (none at 0 or 1), as ``prompts/key`` and ``prompt_sq/key``."""
    sd = min(sd, value, 1 - value) if 0 < value < 1 else 0.0
    row[key] = value
    row[f"prompts/{key}"] = float(prompts)
    row[f"prompt_sq/{key}"] = value * value + sd * sd


def healthy(n: int, seed: int = 0) -> list[dict]:
    """Noisy but stable rates (tool ~0.7, K8 ~0.6 every other step, closure ~0.9, errors ~0.1),
    the tool-call rates over 8 prompts a step."""
    rng = random.Random(seed)
    rows = []
    for s in range(1, n + 1):
        r = {
            "step": s,
            "kind": "train",
            "think_closure_rate": 0.9 + rng.uniform(-0.1, 0.1),
            "parse_error_rate": 0.1 + rng.uniform(-0.08, 0.08),
        }
        set_rate(r, "tool_call_rate", 0.7 + rng.uniform(-0.15, 0.15))
        set_rate(r, "tool_rate/K4", 0.8 + rng.uniform(-0.1, 0.1))
        if s % 2 == 0:
            set_rate(r, "tool_rate/K8", 0.6 + rng.uniform(-0.1, 0.1))
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
        set_rate(r, "tool_call_rate", 0.0)
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
            set_rate(r, "tool_rate/K8", 0.05, sd=0.05)
    alarms = detect_alarms(rows, **KW)
    assert [a.metric for a in alarms] == ["tool_rate/K8"]
    # K8 is observed every other step: its window spans 8 steps. Its mean crosses after two
    # of its own collapsed observations (steps 32 and 34: 0.6, 0.6, 0.05, 0.05), which is not
    # yet significant over 16 + 16 prompts; the third (step 36) is.
    assert alarms[0].step == 36
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
        set_rate(r, "tool_call_rate", 0.0)
    first, second = (a.step for a in detect_alarms(rows, **KW))
    assert 13 <= first <= 14 and 38 <= second <= 39  # 3-4 collapsed steps into each
    assert detect_alarms(rows, **{**KW, "tool_frac": 0.0}) == []


def test_replay_equals_streaming() -> None:
    rows = healthy(40)
    for r in rows[20:]:
        set_rate(r, "tool_call_rate", 0.0)
    det = CollapseDetector(**KW)
    streamed = [a for r in rows for a in det.update(r["step"], r)]
    assert streamed == detect_alarms(rows, **KW) and len(streamed) == 1
    # Resume: replaying the first 26 rows, then streaming the rest, fires nothing twice.
    det2 = CollapseDetector(**KW)
    before = det2.replay(rows[:26])
    after = [a for r in rows[26:] for a in det2.update(r["step"], r)]
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


# ------------------------------------------------------------------- sample size (issue 27.14)
def default_run_rows(seed: int, rate, steps: int = 40) -> list[dict]:
    """Metric rows of a run sized like the embedded default (preset tiny_cpu: 4 prompts a
    step, K drawn per prompt from {4, 8, 16, 32}, G = 4 rollouts), built by
    ``rollout_metrics`` from trajectory records. A prompt's tool-call propensity is drawn
    from a Beta with mean ``rate(step, K)`` and concentration ``CONC`` (prompts differ a lot, as
    they do: some need the tool, some do not); its G rollouts call with that propensity."""
    from paravt.metrics import rollout_metrics

    rng = random.Random(seed)
    rows = []
    for step in range(1, steps + 1):
        recs = []
        for j in range(4):
            k = rng.choice([4, 8, 16, 32])
            m = min(max(rate(step, k), 0.01), 0.99)
            p = rng.betavariate(CONC * m, CONC * (1 - m))
            recs += [
                {"K": k, "prompt": f"{step}:{j}", "reward": 0.0, "breakdown": {},
                 "compliant": 1.0, "closed": [1.0], "n_calls": 1, "bad_calls": 0,
                 "used_tool": float(rng.random() < p), "response_tokens": 1}
                for _ in range(4)
            ]  # fmt: skip
        rows.append({"step": step, "kind": "train", **rollout_metrics(recs)})
    return rows


CONC = 2.0  # Beta concentration of per-prompt propensities (2: uniform at a mean of 0.5)
DEFAULT_KW = {"window": 5, "tool_frac": 0.5, "closure_frac": 0.5, "parse_rise": 0.25}


BARE = {**DEFAULT_KW, "min_prompts": 1, "alpha": 1.0}  # the old rule: no sample size


def test_the_issue_run_raises_no_false_k8_alarm() -> None:
    """The issue: a healthy default run showed 'tool-call rate at K8 collapsed' at steps 13,
    23 and 30, from ~1 prompt per K per step. This simulated healthy run (stationary tool
    use at 0.3) shows the same under the bare mean rule (steps 12, 23, 31) and nothing now."""
    rows = default_run_rows(4, lambda step, k: 0.3)
    assert detect_alarms(rows, **DEFAULT_KW) == []
    bare_k8 = [a.step for a in detect_alarms(rows, **BARE) if a.metric == "tool_rate/K8"]
    assert bare_k8 == [12, 23, 31]


def test_healthy_runs_of_the_default_size_rarely_alarm() -> None:
    """Forty healthy runs of the default's size (tool use stationary at 0.3 or 0.5): the bare
    mean rule raises over 3 alarms a run; the prompt-level test raises at most one in
    all forty (measured: ~1 per 100 runs at ALPHA=0.005; the one here is a K32 start level
    that was 0.7 by chance over 7 prompts)."""
    runs = [
        default_run_rows(seed, lambda step, k, level=level: level)
        for level in (0.3, 0.5)
        for seed in range(20)
    ]
    assert sum(len(detect_alarms(rows, **DEFAULT_KW)) for rows in runs) <= 1
    assert sum(len(detect_alarms(rows, **BARE)) for rows in runs) >= 100


def test_collapse_at_the_default_size_still_fires() -> None:
    """Tool use gone from step 20 on (vanilla GRPO after a cold start that calls): the overall
    rate alarms in every run, 4 steps in; a collapse at K8 only alarms at K8 in most runs
    (~5 prompts a window: only a fall to nearly 0 is significant there)."""
    for seed in range(10):
        rows = default_run_rows(100 + seed, lambda step, k: 0.7 if step < 20 else 0.0)
        alarms = [a for a in detect_alarms(rows, **DEFAULT_KW) if a.metric == "tool_call_rate"]
        assert len(alarms) == 1 and 22 <= alarms[0].step <= 25, (seed, alarms)
        assert "prompts vs" in alarms[0].message and "p=" in alarms[0].message
    hits = 0
    for seed in range(10):
        rows = default_run_rows(200 + seed, lambda step, k: 0.02 if step >= 20 and k == 8 else 0.7)
        alarms = detect_alarms(rows, **DEFAULT_KW)
        assert {a.metric for a in alarms} <= {"tool_rate/K8"}, (seed, alarms)
        hits += bool(alarms)
    assert hits >= 6


def test_small_windows_need_a_unanimous_fall() -> None:
    """Two prompts on each side (the viewer test's window of one step): all calling, then none
    calling fires; a partial fall of the same mean-crossing size does not."""
    from paravt.alarms import CollapseDetector as CD

    def row(step: int, rates: list[float]) -> dict:
        r = {"step": step, "kind": "train"}
        n = len(rates)
        set_rate(r, "tool_call_rate", sum(rates) / n, prompts=n, sd=0.0)
        r["prompt_sq/tool_call_rate"] = sum(x * x for x in rates) / n
        return r

    kw = {"window": 1, "tool_frac": 0.5, "closure_frac": 0.5, "parse_rise": 0.25}
    assert [a.step for a in CD(**kw).replay([row(1, [1, 1]), row(2, [0, 0])])] == [2]
    assert CD(**kw).replay([row(1, [1, 1]), row(2, [0, 0.5])]) == []  # mean 0.25 < 0.5
    assert CD(**kw).replay([row(1, [1.0]), row(2, [0.0])]) == []  # one prompt: no variance
    # Rows without prompt counts (a run logged before them): each step is one prompt.
    assert CD(**kw).replay([{"step": 1, "tool_call_rate": 1.0},
                            {"step": 2, "tool_call_rate": 0.0}]) == []  # fmt: skip


def test_student_t_tail_matches_tables() -> None:
    from paravt.alarms import student_t_sf

    for t, df, p in [(6.314, 1, 0.05), (31.82, 1, 0.01), (2.015, 5, 0.05), (3.365, 5, 0.01),
                     (1.645, 1e6, 0.05), (0.0, 7, 0.5), (-2.015, 5, 0.95), (2.1, 4.5, None)]:  # fmt: skip
        got = student_t_sf(t, df)
        if p is not None:
            assert got == pytest.approx(p, rel=2e-3), (t, df)
        else:  # between its integer neighbours
            assert student_t_sf(2.1, 5) < got < student_t_sf(2.1, 4)
