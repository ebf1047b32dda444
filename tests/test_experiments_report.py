"""The collapse experiment's report (``paravt.experiments.report``): one run's summary, the
summary over arms and seeds, every arm at the same K split by need, the pre-registered bars,
and ``collapse.json`` read back (``CollapseResult.from_dict``: the on-disk format unchanged,
an older file without the later fields still read)."""

from __future__ import annotations

import json
import math

import pytest

from paravt.experiments.collapse import ARMS
from paravt.experiments.report import (
    CollapseResult,
    MeanStd,
    RunInfo,
    bars,
    format_markdown,
    same_k,
    seed_values,
    summarise,
)
from paravt.metrics import json_safe


def _rows(kappas: list[float], acc4: float) -> list[dict]:
    rows = [
        {"kind": "train", "step": i + 1, "tool_calls_per_rollout": k, "format_compliance": 0.5,
         "tool_call_rate": k / 3, "tool_rate/K4": k / 3}
        for i, k in enumerate(kappas)
    ]  # fmt: skip
    after = {"kind": "eval_after", "step": len(kappas), "K4_tools/accuracy": acc4}
    return [*rows, {**after, "K4_tools/tool_call_rate": acc4 / 2}]


def test_summary_values_and_schema() -> None:
    v = seed_values(_rows([2.5, 2.0, 1.0, 0.5, 0.0, 0.0, 0.0], 0.75), [4])
    assert v.kappa_start == 2.5 and v.kappa_end == pytest.approx(0.3)  # last 5 steps
    assert v.format_start == 0.5 and v.acc_end_k == {"4": 0.75}
    assert v.tool_rate_end_k == {"4": pytest.approx(0.1)}  # per K the run trained at
    assert v.mixed_steps == 0.0 and math.isnan(v.adv_tool_mixed)
    mixed = _rows([2.0, 1.0, 0.0], 1.0)
    mixed[0].update({"adv/mixed_groups": 0.5, "adv/tool": -1.0, "adv/no_tool": 0.5})
    mixed[2].update({"adv/mixed_groups": 0.25, "adv/tool": -0.5, "adv/no_tool": 1.5})
    mixed[1].update({"adv/mixed_groups": 0.0, "adv/tool": float("nan")})
    d = seed_values(mixed, [4])
    assert d.tool_rate_heldout_k == {"4": 0.5}
    assert d.mixed_steps == 2.0 and d.adv_tool_mixed == -0.75
    assert d.adv_no_tool_mixed == 1.0
    cold = {"K4_tools/tool_calls_per_rollout": 2.5, "K4_tools/accuracy": 0.25}
    res = summarise(
        {"vanilla": {0: _rows([2.0, 0.0], 0.5), 1: _rows([3.0, 1.0], 1.0)}},
        [4],
        {0: cold, 1: cold},  # each seed's own cold start (equal here)
    )
    van = res.arms["vanilla"]
    assert van.kappa_start.to_dict() == {"mean": 2.5, "std": pytest.approx(math.sqrt(0.5))}
    assert van.acc_end_k["4"].mean == 0.75
    assert [s.seed for s in van.seeds] == [0, 1]
    kappa = van.curves["tool_calls_per_rollout"]
    assert kappa.step == [1, 2] and kappa.mean == [2.5, 0.5]
    assert kappa.std == [pytest.approx(math.sqrt(0.5)), pytest.approx(math.sqrt(0.5))]
    # Held-out accuracy: the cold starts' at step 0, then the runs' (mean over seeds).
    assert van.curves["eval/K4"].step == [0, 2]
    assert van.curves["eval/K4"].mean == [0.25, 0.75]
    assert res.sft["4"].kappa == 2.5
    assert van.tool_rate_heldout_k["4"].mean == pytest.approx(0.375)  # same K, held out
    assert van.tool_rate_end_k["4"].mean == pytest.approx(0.5)  # (1/3 + 2/3) / 2
    # A K that one seed's last steps never drew is left out of that K's mean, not zeroed.
    other = _rows([1.5, 1.5], 1.0)
    for r in other:
        if r["kind"] == "train":
            r["tool_rate/K8"] = r.pop("tool_rate/K4")
    res2 = summarise({"gating": {0: _rows([3.0], 1.0), 1: other}}, [4], {})
    assert res2.arms["gating"].tool_rate_end_k["4"] == MeanStd(1.0, 0.0)
    assert res2.arms["gating"].tool_rate_end_k["8"].mean == 0.5
    assert set(res.to_dict()["arms"]["vanilla"]["mixed_steps"]) == {"mean", "std"}


def _held(k: int, rates: list[tuple[bool, float, float]], step: int = 5) -> list[dict]:
    """``heldout.jsonl`` rows of one evaluation at K: per prompt (needs the tool, tool-call
    rate, accuracy); an earlier evaluation's rows and another K's are mixed in to be ignored."""
    rows = [
        {"kind": "eval_after", "step": step, "condition": f"K{k}_tools", "K": k,
         "tool_call_rate": t, "accuracy": a, "format_compliance": 1.0 - t / 2,
         "tool_turn_closure": float("nan") if t == 0 else 0.5,
         "extra": {f"need_K{k}": need, "need_K99": not need}}
        for need, t, a in rates
    ]  # fmt: skip
    old = {**rows[0], "kind": "eval_step", "step": 1, "tool_call_rate": 0.123}
    other = {**rows[0], "condition": "K99_tools", "K": 99, "tool_call_rate": 0.456}
    return [old, *rows, other]


def test_same_k_splits_prompt_by_prompt_by_need_and_the_bars_are_judged() -> None:
    v = same_k(_held(32, [(True, 1.0, 1.0), (True, 0.5, 0.5), (False, 0.0, 1.0)]), [32])["32"]
    assert v.tool_rate_need == 0.75 and v.acc_need == 0.75
    assert v.tool_rate_no_need == 0.0 and v.acc_no_need == 1.0
    assert v.share_need == pytest.approx(2 / 3) and v.prompts == 3.0
    assert v.format == pytest.approx((0.5 + 0.75 + 1.0) / 3)
    assert v.tool_turn_closure == 0.5  # prompts without a tool turn left out
    assert math.isnan(same_k([], [32])["32"].tool_rate_need)
    # Seeds: the cold start calls on needing prompts (rate 1.0, accuracy 0.5); vanilla stops
    # calling there (0.0, accuracy 0.25), PARA-GRPO keeps calling (1.0, accuracy 1.0).
    start = {s: _held(32, [(True, 1.0, 0.5), (False, 1.0, 1.0)]) for s in (0, 1)}
    held = {
        "vanilla": {s: _held(32, [(True, 0.0, 0.25 + s / 100), (False, 0.0, 1.0)]) for s in (0, 1)},
        "paragrpo": {s: _held(32, [(True, 1.0, 1.0), (False, 1.0, 1.0)]) for s in (0, 1)},
    }
    runs = {a: {s: _rows([1.0, 0.0], 0.5) for s in (0, 1)} for a in held}
    res = summarise(runs, [32], {0: {}, 1: {}}, held, start, same_ks=[32])
    assert res.same_k_start["32"].tool_rate_need == MeanStd(1.0, 0.0)
    van = res.arms["vanilla"].same_k["32"]
    assert van.acc_need.mean == pytest.approx(0.255)
    assert [s.same_k["32"].acc_need for s in res.arms["vanilla"].seeds] == [0.25, 0.26]
    judged = {b.id: b.met for b in res.bars}
    assert judged["a1"] and judged["a2"] and judged["a3"] and judged["a4"] and judged["a5"]
    assert judged["b1"] is None and judged["b2"] is None  # anchoring, gating not run
    assert judged["c1"]  # the cold start's accuracy on needing prompts: 0.5
    assert [(b.id, b.met) for b in bars(res)] == list(judged.items())
    # A vanilla that keeps calling fails its bars.
    held["vanilla"] = held["paragrpo"]
    res = summarise(runs, [32], {0: {}, 1: {}}, held, start, same_ks=[32])
    judged = {b.id: b.met for b in res.bars}
    assert judged["a1"] is False and judged["a4"] is False


def _summary() -> CollapseResult:
    """A summary of two arms and two seeds at K = 32 with the cold starts' values."""
    start = {s: _held(32, [(True, 1.0, 0.5), (False, 1.0, 1.0)]) for s in (0, 1)}
    held = {
        "vanilla": {s: _held(32, [(True, 0.0, 0.25 + s / 100), (False, 0.0, 1.0)]) for s in (0, 1)},
        "paragrpo": {s: _held(32, [(True, 1.0, 1.0), (False, 1.0, 1.0)]) for s in (0, 1)},
    }
    runs = {a: {s: _rows([1.0, 0.0, 2.0], 0.5) for s in (0, 1)} for a in held}
    cold = {"K32_tools/tool_calls_per_rollout": 2.5, "K32_tools/accuracy": 0.25}
    return summarise(runs, [32], {0: cold, 1: cold}, held, start, [32], ARMS)


def test_collapse_json_reads_back_to_the_same_file() -> None:
    """``collapse.json`` is the interface between a run and the phase diagram: written from
    the typed result, read back, written again, the same bytes (NaN: ``null`` both times)."""
    res = _summary()
    res.run = RunInfo([0, 1], "spot_late", None, [2, 3], 0.75, 0.25, 25, 1.5)
    text = json.dumps(json_safe(res.to_dict()), indent=1, allow_nan=False)
    back = CollapseResult.from_dict(json.loads(text))
    assert json.dumps(json_safe(back.to_dict()), indent=1, allow_nan=False) == text
    assert format_markdown(back) == format_markdown(res)
    assert back.arms["vanilla"].description == ARMS["vanilla"]
    assert back.run is not None and back.run.decoy_share is None and back.run.q_recorded
    assert math.isnan(back.arms["vanilla"].adv_tool_mixed.mean)  # written as null
    assert [b.met for b in back.bars] == [b.met for b in res.bars]


def test_an_older_collapse_json_still_reads() -> None:
    """A file written before q, the run's knobs and the same-K fields were recorded: the
    missing values read as NaN / None / absent, and ``to_dict`` writes no key it lacked."""
    res = _summary()
    old = json_safe(res.to_dict())
    for arm in old["arms"].values():
        del arm["same_k"]["32"]["tool_turn_closure"]
    old.update({"seeds": [0, 1], "task": "spot_decoy", "unclosed_think": 0.5})
    back = CollapseResult.from_dict(json.loads(json.dumps(old)))
    assert back.run is not None and not back.run.q_recorded and back.run.windows is None
    assert "decoy_share" not in back.to_dict()
    assert math.isnan(back.arms["paragrpo"].same_k["32"].tool_turn_closure.mean)
    assert back.arms["paragrpo"].same_k["32"].tool_rate_need == MeanStd(1.0, 0.0)
    assert CollapseResult.from_dict({"arms": {}, "same_k_start": {}}).run is None
