"""Does RL beat its own cold start (issue 60)? The bars of ``paravt.experiments.rl_learns``,
the held-out evaluation's split by need, the before/after table paired by prompt, and the
greedy conditions, on hand-made rows whose answers are known."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from paravt.config import ConfigError, load_config
from paravt.eval.conditions import EvalCondition, eval_conditions
from paravt.eval.heldout import before_after_table, need_split, paired_difference
from paravt.experiments.rl_learns import Bars, bars, markdown, rl_learns
from paravt.experiments.rl_learns import main as rl_learns_main
from paravt.metrics import read_metrics


def _rec(prompt: str, need: bool | None, acc: float, calls: int) -> dict:
    """A held-out ``trajectory_record`` as ``evaluate`` builds it (the fields it reads)."""
    return {
        "K": 4,
        "prompt": prompt,
        "need": need,
        "reward": acc,
        "breakdown": {"acc": acc},
        "compliant": 1.0,
        "closed": [1.0] * (1 + bool(calls)),
        "closed_tool": [1.0] if calls else [],
        "n_calls": calls,
        "bad_calls": 0,
        "used_tool": float(calls > 0),
        "response_tokens": 10,
    }


def test_need_split_reports_each_part_over_its_own_prompts() -> None:
    recs = [_rec("a", True, 1.0, 5), _rec("a", True, 0.0, 0), _rec("b", False, 1.0, 0)]
    recs += [_rec("b", False, 1.0, 5)]
    out = need_split("K4_tools", recs)
    assert out["K4_tools/need/tool_call_rate"] == 0.5
    assert out["K4_tools/need/accuracy"] == 0.5
    assert out["K4_tools/need/tool_calls_per_rollout"] == 2.5
    assert out["K4_tools/need/prompts"] == 1.0
    assert out["K4_tools/seen/tool_call_rate"] == 0.5 and out["K4_tools/seen/accuracy"] == 1.0
    # Prompts that record no need (not a spot task): nothing to split.
    assert need_split("K4_tools", [_rec("c", None, 1.0, 0)]) == {}


def _heldout(kind: str, cond: str, prompt: str, need: bool, acc: float, rate: float) -> dict:
    return {"step": 0, "kind": kind, "condition": cond, "prompt": prompt, "K": 4,
            "accuracy": acc, "tool_call_rate": rate, "tool_calls_per_rollout": 5 * rate,
            "format_compliance": 1.0, "think_closure_rate": 1.0,
            "extra": {"need_K4": need}}  # fmt: skip


def test_paired_difference_and_the_table() -> None:
    rows = []
    for p, (b, a) in {"p1": (0.0, 1.0), "p2": (0.5, 1.0), "p3": (0.25, 0.25)}.items():
        rows.append(_heldout("eval_before", "K4_tools", p, True, b, b))
        rows.append(_heldout("eval_after", "K4_tools", p, True, a, a))
    rows.append(_heldout("eval_before", "K4_tools", "q", False, 1.0, 0.5))
    rows.append(_heldout("eval_after", "K4_tools", "q", False, 1.0, 0.0))
    rows.append(_heldout("eval_after", "K4_tools", "only_after", True, 0.0, 0.0))  # unpaired
    b, a, d, h, n = paired_difference(rows, "K4_tools", "accuracy", True)
    diffs = [1.0, 0.5, 0.0]
    sd = math.sqrt(sum((x - 0.5) ** 2 for x in diffs) / 2)
    assert (b, a, d, n) == (pytest.approx(0.25), pytest.approx(0.75), pytest.approx(0.5), 3)
    assert h == pytest.approx(1.96 * sd / math.sqrt(3))
    assert paired_difference(rows, "K4_tools", "tool_call_rate", False)[:3] == (0.5, 0.0, -0.5)
    assert paired_difference(rows, "K8_tools", "accuracy", None)[4] == 0  # no such condition
    conds = [EvalCondition("K4_tools", 4, True), EvalCondition("K4_notools", 4, False)]
    table = before_after_table(rows, conds, guess=0.25)
    line = next(x for x in table.splitlines() if "need (n=3)" in x and "accuracy" in x)
    assert line.split()[-4:] == ["0.750", "+0.500", "+/-", f"{1.96 * sd / math.sqrt(3):.3f}"]
    assert "uniform guess" in table and "seen (n=1)" in table


def test_eval_conditions_take_a_greedy_suffix() -> None:
    cfg = load_config(overrides=["train.eval_conditions=[4:tools,4:tools:greedy,8:notools:greedy]"])
    assert eval_conditions(cfg) == [
        EvalCondition("K4_tools", 4, True, False),
        EvalCondition("K4_tools_greedy", 4, True, True),
        EvalCondition("K8_notools_greedy", 8, False, True),
    ]
    with pytest.raises(ConfigError, match="'4:tools:hot' is not"):
        load_config(overrides=["train.eval_conditions=[4:tools:hot]"])


def _eval_row(kind: str, need_call: float, need_acc: float, seen_call: float, seen_acc: float):
    c = "K4_tools"
    return {"step": 0, "kind": kind,
            f"{c}/need/tool_call_rate": need_call, f"{c}/need/accuracy": need_acc,
            f"{c}/need/prompts": 20.0, f"{c}/seen/tool_call_rate": seen_call,
            f"{c}/seen/accuracy": seen_acc, f"{c}/seen/prompts": 12.0}  # fmt: skip


@pytest.mark.parametrize(
    "after, failed",
    [
        ((0.9, 0.9, 0.05, 1.0), []),  # learnt when to call
        ((0.2, 0.9, 0.05, 1.0), ["need_call_gain"]),  # calls too rarely still
        ((0.9, 0.3, 0.05, 1.0), ["need_acc_gain"]),  # calls, but the answer does not follow
        ((1.0, 1.0, 1.0, 1.0), ["seen_call_after"]),  # "always call" fails
        ((0.9, 0.9, 0.05, 0.9), ["seen_acc_change"]),  # lost what the overview showed
        ((0.1, 0.3, 0.2, 1.0), ["need_call_gain", "need_acc_gain", "seen_call_after"]),  # 0 steps
    ],
)
def test_bars_pass_only_when_rl_learns_when_to_call(after, failed) -> None:
    before = _eval_row("eval_before", 0.1, 0.3, 0.2, 1.0)
    got = bars(before, _eval_row("eval_after", *after), "K4_tools", Bars())
    assert sorted(k for k, (_, ok) in got.items() if not ok) == sorted(failed)


def test_rl_learns_reads_runs_and_exits_by_the_bars(tmp_path: Path, capsys) -> None:
    runs = []
    for seed, after in enumerate([(0.9, 0.9, 0.05, 1.0), (1.0, 0.95, 0.0, 1.0)]):
        run = tmp_path / f"s{seed}"
        run.mkdir()
        rows = [_eval_row("eval_before", 0.1, 0.3, 0.2, 1.0), _eval_row("eval_after", *after)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(str(run))
    res = rl_learns(runs)
    c = res["conditions"]["K4_tools"]
    assert c["passed"] and res["n_runs"] == 2
    assert c["mean"]["need/tool_call_rate/diff"] == pytest.approx(0.85)
    assert c["std"]["need/tool_call_rate/diff"] == pytest.approx(math.sqrt(0.005))
    assert "0.100 -> 0.900 (+0.800)" in markdown(res)
    assert rl_learns_main([*runs, "--json", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["n_runs"] == 2
    # One seed that learnt to always call: the command fails (exit 1) and names the bar.
    bad = tmp_path / "always"
    bad.mkdir()
    rows = [_eval_row("eval_before", 0.1, 0.3, 0.2, 1.0), _eval_row("eval_after", 1, 1, 1, 1)]
    (bad / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert rl_learns_main([*runs, str(bad)]) == 1
    assert "seen_call_after" in capsys.readouterr().out
    assert rl_learns_main([str(tmp_path / "missing")]) == 2


# ------------------------------------------------------------------------ a tiny world, run
#: The tiny world: the default's task and recipe, shrunk to test time. Every square is lemon
#: (``data.synth_colours``), so no answer needs a colour read from the pixels, which a cold
#: start short enough for the suite does not learn (measured: 600-800 SFT steps on 16-60
#: four-colour videos answered 0.19-0.44, with and without calls). What remains is the
#: default's question: a guess is right one time in four, a crop always names the colour, and
#: the budget K says whether the overview shows the square (at K = 2 it almost never does, at
#: 32 always). One crop window instead of five, 40 videos (8 held out), a 300-step cold start
#: that calls in half of its first turns either way, 45 RL steps.
WORLD = {
    "data.synth_num_videos": 40,
    "data.synth_colours": ["lemon"],
    "data.synth_call_share_missed": 0.5,
    "data.synth_call_share_seen": 0.5,
    "video.frame_budgets": [2, 32],
    "agent.max_parallel": 1,
    "sft.steps": 300,
    "sft.lr": 3e-3,
    "sft.save_every": 0,
    "algo.lr": 2e-4,
    "train.steps": 45,
    "train.save_every": 0,
    "train.eval_prompts": 8,
    "train.eval_samples": 4,
    "train.eval_conditions": ["2:tools", "32:tools"],
    "train.progress": False,
    "train.summary_plot": False,
    "train.log_trajectories": 0,
}


def _world(assets: dict[str, str], out: Path, **extra: object) -> list[str]:
    kv = {
        **WORLD,
        "data.synth_dir": str(out.parent / "world-synth"),
        "model.tiny_dir": assets["model"],
        "train.out_dir": str(out),
        **extra,
    }
    return [f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in kv.items()]


def _failed(res: dict) -> list[str]:
    """The bars that fail: the needing prompts' at K = 2 (a prompt or two of which the K = 2
    overview shows the square is too few to judge), the others' at K = 32."""
    got = bars(res["before"], res["after"], "K2_tools")
    out = [f"K2_tools:{k}" for k, (_, ok) in got.items() if k.startswith("need") and not ok]
    got = bars(res["before"], res["after"], "K32_tools")
    return out + [f"K32_tools:{k}" for k, (_, ok) in got.items() if not ok]


def test_rl_beats_its_cold_start_in_a_tiny_world_and_fails_without_the_call_cost(
    assets, tmp_path
) -> None:
    """The check of issue 60 on a world small enough for the suite: from one cold start that
    calls by chance, PARA-GRPO with the default's reward (a call pays only through the answer,
    0.02 a crop) passes every bar (calls where the overview misses the square, not where it
    shows it); the same RL without the per-crop cost fails (nothing teaches it not to call
    where calling only costs), and so does no RL at all (before against itself)."""
    from paravt.train import run

    res = run(load_config(overrides=_world(assets, tmp_path / "cost")))
    assert _failed(res) == [], (_failed(res), res["before"], res["after"])
    train = [r for r in read_metrics(tmp_path / "cost" / "metrics.jsonl") if r["kind"] == "train"]
    assert sum(r["adv/nonzero_groups"] for r in train) / len(train) > 0.2  # groups are mixed
    free = run(
        load_config(
            overrides=_world(
                assets,
                tmp_path / "free",
                **{
                    "model.path": str(tmp_path / "cost" / "sft"),
                    "sft.steps": 0,
                    "reward.call_cost": 0.0,
                },  # fmt: skip
            )
        )
    )
    assert free["before"]["K2_tools/need/accuracy"] == res["before"]["K2_tools/need/accuracy"]
    assert "K32_tools:seen_call_after" in _failed(free), (free["before"], free["after"])
    still = {"before": res["before"], "after": res["before"]}
    assert "K2_tools:need_call_gain" in _failed(still)
