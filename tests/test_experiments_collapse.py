"""``python -m paravt.experiments collapse``: the all-tool cold start's records
(``paravt.data.cold_start``), the tool-vs-no-tool advantage (a ``paravt.train`` step metric),
and a shrunken end-to-end run whose arms are ``paravt.train`` runs and that resumes (its
``collapse.json`` read back by the phase diagram). The summary's statistics, schema and bars:
``tests/test_experiments_report.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from paravt.config import ConfigError, load_config
from paravt.data.cold_start import all_tool_records, replay_records
from paravt.data.sft_records import SFTRecord
from paravt.experiments import main
from paravt.experiments.arms import ARMS as ARM_NAMES
from paravt.experiments.arms import run_finished
from paravt.experiments.collapse import ARMS
from paravt.metrics import read_metrics, rollout_metrics, trajectory_record
from paravt.types import ToolCall, Trajectory, Turn

# The spot task, shrunk: 4 videos of 20 s (3 train, 1 held-out).
TASK = {
    "data.synth_task": "spot",
    "data.synth_num_videos": 4,
    "data.synth_min_duration": 20.0,
    "data.synth_max_duration": 20.0,
}


@pytest.fixture(scope="module")
def spot_task(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    from paravt.data.synth import generate_from_config

    d = tmp_path_factory.mktemp("collapse-synth")
    cfg = load_config(
        "tiny_cpu",
        overrides=[f"{k}={v}" for k, v in TASK.items()]
        + [f"data.synth_dir={d}", "video.frame_budgets=[2,4]", "video.fixed_frames=4"]
        # The stage-1 oracle of the collapse protocols (configs/collapse.yaml pins it too).
        + ["data.synth_call_share_missed=1.0", "data.synth_call_share_seen=0.0"],
    )
    return generate_from_config(cfg), cfg


def test_every_cold_start_record_calls_the_tool_and_answers_right(spot_task) -> None:
    data, cfg = spot_task
    train = [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines()]
    plans = {v["name"]: v for v in json.loads((data / "manifest.json").read_text())["videos"]}
    recs = all_tool_records(data, cfg, [2, 3])
    assert len(recs) == len(train) * 2  # one per training row and budget K in {2, 4}
    assert sorted({r.num_frames for r in recs}) == [2, 4]
    by_id = {r["id"]: r for r in train}
    counts = set()
    for r in recs:
        first, tool, last = r.turns
        calls = first.content.count("<tool_call>")
        counts.add(calls)
        assert calls in (2, 3) and len(tool.content) == calls  # a summary per call
        assert "crop_video" in first.content and tool.role == "tool"
        row = by_id[r.sample_id]
        assert last.content.endswith(f"<answer>{row['answer']}</answer>")
        tgt = plans[Path(row["video"]).stem]["target"]
        name = f"{tgt['colour']} {tgt['shape']}"
        # Whatever K, the windows tile the whole video and one summary names the square.
        assert '"start_time": 0.0' in first.content and '"end_time": 20.0' in first.content
        assert sum(name in s for s in tool.content) >= 1
    assert counts == {2, 3}  # both window counts occur (stable hash per row and K)
    assert recs == all_tool_records(data, cfg, [2, 3])  # deterministic
    with pytest.raises(ConfigError, match="1..agent.max_parallel"):
        all_tool_records(data, cfg, [9])
    # The fragile-format knob: that share of tool turns never closes <think>; calls unchanged.
    half = all_tool_records(data, cfg, [2, 3], unclosed_think=0.5)
    broken = [h for h, r in zip(half, recs) if h != r]
    assert 0 < len(broken) < len(recs)
    for h in broken:
        first = h.turns[0].content
        assert "</think>" not in first and first.count("<tool_call>") in (2, 3)
    assert all_tool_records(data, cfg, [2, 3], unclosed_think=1.0) != recs
    assert all(
        "</think>" not in r.turns[0].content
        for r in all_tool_records(data, cfg, [2, 3], unclosed_think=1.0)
    )


def test_replay_keeps_a_share_of_stage_1s_direct_answers(spot_task) -> None:
    data, cfg = spot_task
    lines = (data / "sft.jsonl").read_text().splitlines()
    oracle = [SFTRecord.from_dict(json.loads(x)) for x in lines]
    direct = [r for r in oracle if len(r.turns) == 1 and not r.turns[0].forced]
    assert direct  # the spot oracle answers from the overview where it shows the square
    tool = all_tool_records(data, cfg, [2, 3], unclosed_think=1.0)
    assert replay_records(data, len(tool), 0.0) == []
    for share in (0.25, 0.5, 0.75):
        rep = replay_records(data, len(tool), share)
        assert len(rep) == round(len(tool) * share / (1 - share))
        assert abs(len(rep) / (len(rep) + len(tool)) - share) < 0.1
        for r in rep:  # each is one of stage 1's own direct answers, unchanged
            assert r in direct and "<tool_call>" not in r.turns[0].content
            assert r.turns[0].content.endswith("</answer>") and "</think>" in r.turns[0].content
        assert rep == replay_records(data, len(tool), share)  # deterministic
    # more asked for than exist: every direct answer is used before any repeats
    many = replay_records(data, len(direct) * 3, 0.5)
    assert len(many) == len(direct) * 3 and all(many.count(r) == 3 for r in direct)
    for bad in (-0.1, 1.0):
        with pytest.raises(ConfigError, match="--replay"):
            replay_records(data, len(tool), bad)


def test_the_cold_start_evaluation_is_redone_for_a_missing_k(tmp_path) -> None:
    from paravt.experiments.collapse import _evaluated_at

    d = tmp_path / "sft_eval"
    assert not _evaluated_at(d, [4])  # nothing there
    d.mkdir()
    (d / "metrics.jsonl").write_text(
        json.dumps({"kind": "eval_after", "step": 0, "K4_tools/accuracy": 0.5}) + "\n"
    )
    assert _evaluated_at(d, [4]) and not _evaluated_at(d, [2, 4])


def _group(gid: int, rewards: list[float], used: list[bool]) -> SimpleNamespace:
    """A scored group of main trajectories; ``used``: whether each executed a crop."""
    trajs = []
    for i, (r, u) in enumerate(zip(rewards, used)):
        calls = [ToolCall(raw="{}", name="crop_video", status="ok")] if u else []
        turn = Turn(text="x</think><answer>red</answer>", prefix="<think>\n", calls=calls)
        t = Trajectory(f"g{gid}t{i}", "main", f"s{gid}", gid, [1], [1], [0.0], 0, turns=[turn])
        t.reward, t.reward_breakdown = r, {"acc": r}
        trajs.append(t)
    return SimpleNamespace(trajectories=trajs, sub_trajectories=[], group_id=gid, num_frames=32)


def test_tool_advantage_compares_tool_and_no_tool_rollouts_in_mixed_groups() -> None:
    """``adv/*``: an ordinary step metric (``paravt.train._learn`` passes each rollout's group
    advantage to ``trajectory_record``; ``rollout_metrics`` reduces them)."""
    from paravt.algo.advantages import build_units

    algo = load_config("tiny_cpu").algo
    # Group 1: tool rollouts score 0, no-tool 1 -> A = -/+ 1/sqrt(4/3) (unbiased std 0.577).
    # Group 2: every rollout used the tool: not mixed, left out.
    groups = [
        _group(0, [0.0, 0.0, 1.0, 1.0], [True, True, False, False]),
        _group(1, [2.0, 0.0, 1.0, 1.0], [True, True, True, True]),
    ]

    def metrics(gs: list) -> dict[str, float]:
        adv = {u.main.uid: u.advantage for u in build_units(gs, algo)}  # as the trainer does
        return rollout_metrics(
            [trajectory_record(t, g.num_frames, adv[t.uid]) for g in gs for t in g.trajectories]
        )

    m = metrics(groups)
    a = 0.5 / math.sqrt(1 / 3)
    assert m["adv/tool"] == pytest.approx(-a, rel=1e-4)
    assert m["adv/no_tool"] == pytest.approx(a, rel=1e-4)
    assert m["adv/mixed_groups"] == 0.5
    none = metrics([groups[1]])  # no mixed group: no advantage to log
    assert "adv/tool" not in none and none["adv/mixed_groups"] == 0.0
    # adv/nonzero_groups: both groups' rewards differ (group 2's not by the tool) -> 1.0; a
    # group whose rewards are all equal (the old default's every group) teaches nothing.
    assert m["adv/nonzero_groups"] == none["adv/nonzero_groups"] == 1.0
    flat = _group(2, [1.0, 1.0, 1.0, 1.0], [True, False, True, False])
    assert metrics([flat])["adv/nonzero_groups"] == 0.0
    assert metrics([flat, groups[0]])["adv/nonzero_groups"] == 0.5
    # Records without advantages (the held-out evaluation's) log none of these.
    assert not any(k.startswith("adv/") for k in rollout_metrics(
        [trajectory_record(t, 32) for t in groups[0].trajectories]))  # fmt: skip


def _args(spot_task, assets: dict[str, str], out: Path) -> list[str]:
    data, _ = spot_task
    kv = {
        **TASK,
        "data.synth_task": "spot_late",  # protocol 3's task; each seed makes its own instance
        "data.synth_dir": str(data),
        "model.tiny_dir": assets["model"],
        "train.prompts_per_step": 2,
        "train.steps": 2,
        "train.eval_prompts": 1,
        "train.eval_samples": 1,
        "train.log_trajectories": 0,
        "rollout.group_size": 2,
        "rollout.max_new_tokens": 8,
        "rollout.sub_max_new_tokens": 4,
        "agent.max_turns": 1,
        "agent.max_tool_response_tokens": 8,
        "video.frame_budgets": "[2,4]",
        "video.fixed_frames": 4,
        "sft.steps": 2,
        "sft.batch_size": 2,
        "algo.kl_coef": 0.0,  # no reference model: one model load per arm run, not two
    }
    return [
        "--out", str(out), "--eval-k", "2,4", "--eval-every", "1", "--windows", "1,2",
        "--base-steps", "2",
        *[f"{k}={v}" for k, v in kv.items()],
    ]  # fmt: skip


def test_collapse_runs_the_arms_from_one_cold_start_and_resumes(
    spot_task, assets, tmp_path, capsys
) -> None:
    out = tmp_path / "collapse"
    # vanilla_ref (the reference's vanilla, no pinned <think>) stands for the ungated arms.
    args = ["collapse", "--arms", "vanilla_ref,paragrpo", "--seeds", "1", "--first-seed", "7"]
    args += _args(spot_task, assets, out)
    # --cold-only (protocol 5's tuning): the cold start and its evaluation, no arm run.
    assert main([*args, "--cold-only"]) == 0
    printed = capsys.readouterr().out
    assert "## Regime cold start" in printed and "| P3 call rate, needing prompts |" in printed
    assert (out / "cold" / "seed7" / "sft_eval" / "heldout.jsonl").is_file()
    assert not (out / "collapse.json").exists() and not (out / "paragrpo").exists()
    assert main(args) == 0  # reuses that cold start and its evaluation
    printed = capsys.readouterr().out
    assert "| vanilla_ref |" in printed and "| paragrpo |" in printed
    res = json.loads((out / "collapse.json").read_text())
    assert set(res["arms"]) == {"vanilla_ref", "paragrpo"} and res["seeds"] == [7]
    for arm, a in res["arms"].items():
        for key in ("kappa_start", "kappa_end", "format_start", "format_end"):
            assert set(a[key]) == {"mean", "std"} and a[key]["mean"] >= 0.0
        assert set(a["acc_end_k"]) == {"2", "4"}
        assert all(0.0 <= a["acc_end_k"][k]["mean"] <= 1.0 for k in ("2", "4"))
        assert [s["seed"] for s in a["seeds"]] == [7]
        curves = a["curves"]
        assert curves["tool_calls_per_rollout"]["step"] == [1, 2]
        # the band of collapse.png: the std across seeds at each step (one seed: 0)
        assert curves["tool_calls_per_rollout"]["std"] == [0.0, 0.0]
        assert curves["format_compliance"]["step"] == [1, 2]
        # Held-out accuracy per K: the cold start's (step 0), step 1 (--eval-every 1), after RL.
        assert curves["eval/K2"]["step"] == [0, 1, 2] and curves["eval/K4"]["step"] == [0, 1, 2]
        run = out / arm / "seed7"
        cfg_text = (run / "config.yaml").read_text()
        cold = out / "cold" / "seed7"  # the seed's own cold start and task instance
        assert f"path: {cold / 'sft'}" in cfg_text and "seed: 7" in cfg_text
        assert f"synth_dir: {out / 'data' / 'seed7'}" in cfg_text and "synth_seed: 7" in cfg_text
        # The arm is a paravt.train run (run.json, the run folder's record, is train.run's),
        # and every number the summary reads is that run's own metrics file.
        assert (run / "run.json").is_file() and "eval_every: 1" in cfg_text
        rows = read_metrics(run / "metrics.jsonl")
        train = [r for r in rows if r["kind"] == "train"]
        assert len(train) == 2 and all("adv/mixed_groups" in r for r in train)
        assert curves["adv/mixed_groups"]["mean"] == [r["adv/mixed_groups"] for r in train]
        assert [r["step"] for r in rows if r["kind"] == "eval_step"] == [1]  # train.eval_every
        evals = {r["kind"]: r for r in rows if r["kind"].startswith("eval_")}
        assert curves["eval/K2"]["mean"][1:] == [
            evals[k]["K2_tools/accuracy"] for k in ("eval_step", "eval_after")
        ]
        # ... and its per-prompt held-out records: one prompt, two conditions, two evaluations
        held = read_metrics(run / "heldout.jsonl")
        assert [(r["kind"], r["step"], r["condition"]) for r in held] == [
            ("eval_step", 1, "K2_tools"), ("eval_step", 1, "K4_tools"),
            ("eval_after", 2, "K2_tools"), ("eval_after", 2, "K4_tools"),
        ]  # fmt: skip
        assert all(r["samples"] == 1 and r["K"] in (2, 4) for r in held)
        assert held[-1]["tool_call_rate"] == evals["eval_after"]["K4_tools/tool_call_rate"]
    # Vanilla trains at the largest K only; PARA-GRPO's arm is gated.
    assert "tool_rate/K2" not in res["arms"]["vanilla_ref"]["curves"]
    van_cfg = (out / "vanilla_ref" / "seed7" / "config.yaml").read_text()
    assert "gating: false" in van_cfg and "lambda_anchor: 0.0" in van_cfg
    assert "think_prefix: ''" in van_cfg and "base_format: reference" in van_cfg
    # The cold start: stage 1 (the preset's own SFT recipe, --base-steps) then stage 2 on the
    # all-tool records from stage 1's checkpoint, once for every arm.
    cold = out / "cold" / "seed7"
    assert (cold / "base_sft" / "config.json").is_file()
    base_params = json.loads((cold / "base_sft_params.json").read_text())
    assert base_params["sft"]["steps"] == 2 and base_params["sft"]["data"] == ""
    assert base_params["seed"] == 7 and base_params["think"] == "untagged"
    # Stage 1 learns the task without <think> (the format prior of its own).
    base_text = (cold / "base_data.jsonl").read_text()
    assert base_text and "<think>" not in base_text and "</think>" not in base_text
    stage2 = json.loads((cold / "sft_params.json").read_text())
    assert stage2["model_path"] == str(cold / "base_sft") and stage2["sft"]["steps"] == 2
    assert (cold / "sft" / "config.json").is_file() and stage2["seed"] == 7
    # Both stamps hold the code that trained them (compared on reuse) and where it came from.
    from paravt.experiments.arms import code_stamp

    assert stage2["code"] == base_params["code"] == code_stamp()
    assert set(stage2["made_by"]) == {"commit", "paravt_edited", "torch", "transformers"}
    # Stage 2's data by default: a share u = 0.75 of the tool turns leaves <think> open, and a
    # quarter of the records are stage 1's direct answers (replayed).
    assert stage2["replay"] == 0.25 and stage2["unclosed_think"] == 0.75
    recs = [json.loads(x) for x in (cold / "sft_data.jsonl").read_text().splitlines()]
    calls = [r for r in recs if "<tool_call>" in r["turns"][0]["content"]]
    assert calls and all(r["turns"][0]["content"].startswith("<think>\n") for r in calls)
    assert len(recs) - len(calls) == round(len(calls) / 3)
    # Every arm measured at the same K, split prompt by prompt by need; the bars judged.
    for a in res["arms"].values():
        for k in ("2", "4"):
            assert set(a["same_k"][k]) >= {"tool_rate_need", "acc_need", "tool_turn_closure"}
    assert set(res["same_k_start"]) == {"2", "4"} and len(res["bars"]) == 8
    assert res["task"] == "spot_late" and "Every arm at the same K = 4" in printed
    assert res["decoy_share"] is None  # q: spot_decoy's only
    # Protocol 5's paired reading of the same folder: the same per-seed values.
    assert main(["paired", f"L={out}", "--k", "4", "--json", str(tmp_path / "p.json")]) == 0
    capsys.readouterr()
    rep = json.loads((tmp_path / "p.json").read_text())["regimes"]["L"]
    start = res["same_k_start_seeds"][0]["same_k"]["4"]
    assert rep["cold"]["7"]["tool_rate_need"] == start["tool_rate_need"]
    assert (
        rep["arms"]["paragrpo"]["7"]["acc_need"]
        == (res["arms"]["paragrpo"]["seeds"][0]["same_k"]["4"]["acc_need"])
    )
    # The phase diagram (item 7) reads this folder as one (u, q) cell: the same numbers.
    assert main(["phase", str(out), "--out", str(tmp_path / "phase")]) == 0
    assert "| u | q | seeds |" in capsys.readouterr().out
    ph = json.loads((tmp_path / "phase" / "phase.json").read_text())
    (c,) = ph["cells"]
    assert c["u"] == 0.75 and c["q"] is None and c["seeds"] == [7] and c["ks"] == [2, 4]
    assert set(c["adv_k32"]) == {"vanilla_ref"}  # the ungated arm run here
    v, a = res["arms"]["vanilla_ref"], c["adv_k32"]["vanilla_ref"]
    assert a["mixed_steps"] == v["mixed_steps"]["mean"]
    if v["mixed_steps"]["mean"]:  # a mixed group: the sign of the mean advantages' difference
        adv = v["adv_tool_mixed"]["mean"] - v["adv_no_tool_mixed"]["mean"]
        assert a["diff"] == pytest.approx(adv) and a["sign"] == "+-"[adv < 0]
    else:  # none in 2 steps of 1 prompt: nothing compared
        assert a["sign"] == "n/a" and v["adv_tool_mixed"]["mean"] is None
    for k in ("2", "4"):
        for key in ("tool_rate_need", "acc_need"):
            want = res["arms"]["paragrpo"]["same_k"][k][key]["mean"]
            got = c["arms"]["paragrpo"][k][key]
            assert got == pytest.approx(want, nan_ok=True) or (got is None and want != want)
    assert main(["phase", str(tmp_path / "nothing")]) == 2
    assert "no collapse.json" in capsys.readouterr().err
    assert set(res["sft"]) == {"2", "4"} and res["sft"]["4"]["kappa"] >= 0.0
    assert (out / "collapse.png").stat().st_size > 1000
    # Other cold-start settings into the same folder are refused, not silently mixed.
    assert main([*args, "--windows", "3"]) == 2
    assert "other cold-start settings" in capsys.readouterr().err
    assert main([*args, "--replay", "0.5"]) == 2
    assert "other cold-start settings" in capsys.readouterr().err
    assert main([*args, "video.crop_max_frames=8"]) == 2  # the oracle's crops changed
    assert "other cold-start settings" in capsys.readouterr().err
    md = (out / "collapse.md").read_text()
    assert "κ start" in md and "| vanilla_ref |" in md
    assert "tool rate K2 end" in md and "Held-out tool-call rate after RL" in md
    for a in res["arms"].values():  # every arm's held-out tool use at the same K
        assert set(a["tool_rate_heldout_k"]) == {"2", "4"}
        assert 0.0 <= a["tool_rate_heldout_k"]["4"]["mean"] <= 1.0

    # A rerun keeps the SFT, its evaluation and the finished runs (nothing is rerun) ...
    logs = {p: p.stat().st_mtime_ns for p in out.glob("*/seed*/train.log")}
    evals = (cold / "sft_eval" / "metrics.jsonl").stat().st_mtime_ns
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert printed.count("finished before, kept") == 2 and "SFT checkpoint" in printed
    assert f"SFT checkpoint {cold / 'base_sft'} exists: reused" in printed
    assert all(p.stat().st_mtime_ns == t for p, t in logs.items()) and len(logs) == 2
    assert (cold / "sft_eval" / "metrics.jsonl").stat().st_mtime_ns == evals
    # ... and one cut short (no eval_after row, as if preempted before it) holding a checkpoint
    # is resumed from it (python -m paravt.train --resume), as a training run is.
    para = out / "paragrpo" / "seed7"
    kept_rows = [r for r in read_metrics(para / "metrics.jsonl") if r["kind"] != "eval_after"]
    (para / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept_rows))
    assert not run_finished(para) and run_finished(out / "vanilla_ref" / "seed7")
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert f"paragrpo seed 7: cut short, resumed from {para / 'checkpoints'}" in printed
    assert "vanilla_ref seed 7: finished before, kept" in printed
    assert f"[train] resumed from {para / 'checkpoints'}" in (para / "train.log").read_text()
    rows = read_metrics(para / "metrics.jsonl")
    assert [r["kind"] for r in rows] == [r["kind"] for r in kept_rows] + ["eval_after"]
    # A rerun with other RL settings redoes the cold start's evaluation and the arm runs (their
    # stamp.json: the resolved config), where it used to keep them and report the old numbers.
    assert main([*args, "--arms", "vanilla_ref", "algo.clip_high=0.5"]) == 0
    printed = capsys.readouterr().out
    assert "cold start's evaluation made with other settings (algo.clip_high: " in printed
    assert "vanilla_ref seed 7: made with other settings (algo.clip_high: " in printed
    assert "clip_high: 0.5" in (out / "vanilla_ref" / "seed7" / "config.yaml").read_text()
    assert (
        json.loads((cold / "sft_eval" / "stamp.json").read_text())["config"]["algo"]["clip_high"]
        == 0.5
    )


def test_bad_arguments_fail_before_anything_runs(tmp_path, capsys) -> None:
    x = tmp_path / "x"
    assert main(["collapse", "--arms", "vanilla,nope", "--out", str(x)]) == 2
    assert "unknown arm 'nope'" in capsys.readouterr().err and not x.exists()
    assert main(["collapse", "--seeds", "0", "--out", str(x)]) == 2
    assert "--seeds 0 must be >= 1" in capsys.readouterr().err
    assert main(["collapse", "--windows", "2,x", "--out", str(x)]) == 2
    assert "--windows" in capsys.readouterr().err
    assert main(["collapse", "--replay", "1.0", "--out", str(x)]) == 2
    assert "--replay 1.0 must be in [0, 1)" in capsys.readouterr().err and not x.exists()
    assert main(["collapse", "--out", str(x), "data.synth_task=cue"]) == 2
    assert "'spot_late' task" in capsys.readouterr().err and not x.exists()
    assert set(ARMS) == {
        "vanilla", "vanilla_ref", "anchoring", "gating", "paragrpo", "paragrpo_no_rtool"
    }  # fmt: skip
    assert list(ARMS) == list(ARM_NAMES)  # the collapse describes the shared arms, no others
    # train.eval_every: the synchronous loop only; train.steps=0: an evaluation-only run
    with pytest.raises(ConfigError, match="train.eval_every=5 needs the synchronous loop"):
        load_config("tiny_cpu", overrides=["train.eval_every=5", "rollout.workers=1"])
    from paravt.validate import validate_run

    with pytest.raises(ConfigError, match="train.steps=0 must be >= 1 .0 only evaluates"):
        validate_run(
            load_config("tiny_cpu", overrides=["train.steps=0", "train.eval_prompts=0"]), 1
        )


def test_phase_advantage_sign_and_q_of_an_older_cell(tmp_path) -> None:
    from paravt.experiments.phase import _manifest_q, advantage_sign

    # A collapse.json from before q was recorded: q from its task's manifest (none there:
    # the fixed 0.25 of that time); disagreeing manifests are an error, not a guess.
    for seed, params in ((1, {"version": 6}), (2, {"version": 6})):
        (tmp_path / "data" / f"seed{seed}").mkdir(parents=True)
        path = tmp_path / "data" / f"seed{seed}" / "manifest.json"
        path.write_text(json.dumps({"params": params}))
    assert _manifest_q(tmp_path, "spot_decoy", [1, 2]) == 0.25
    path.write_text(json.dumps({"params": {"decoy_share": 0.5}}))
    with pytest.raises(ConfigError, match="manifests give"):
        _manifest_q(tmp_path, "spot_decoy", [1, 2])
    assert _manifest_q(tmp_path, "spot_late", [1]) is None

    assert advantage_sign(-0.5, 0.2, 10) == "-" and advantage_sign(0.3, -0.1, 3) == "+"
    assert advantage_sign(0.1, 0.1, 2) == "0"
    assert advantage_sign(0.3, -0.1, 0) == "n/a"  # no mixed group: nothing compared
    assert advantage_sign(float("nan"), 0.0, 4) == "n/a"


def test_tool_path_counts_coverage_summaries_and_the_copy(tmp_path, capsys) -> None:
    """``tool-path`` on rows in ``paravt.eval``'s results format: a call list that stops
    before the square's window (not covered), a right summary copied, a right summary not
    copied, and a prompt answered from the overview."""
    from paravt.experiments.cli import main as cli_main
    from paravt.experiments.tool_path import COUNTS, tool_path

    opts = ["RED", "YELLOW", "CYAN", "MAGENTA"]

    def val(i: int, colour: str, start: float, need: bool) -> dict:
        return {"id": f"v{i}", "target": f"{colour} square", "event_start": start,
                "event_end": start + 5, "options": opts, "need_K4": need}  # fmt: skip

    def res(i: int, letter: str, correct: bool, calls: list) -> dict:
        trace = [{"text": "", "calls": [
            {"status": "ok", "start": s, "end": e, "response": txt} for s, e, txt in calls
        ]}]  # fmt: skip
        return {"id": f"v{i}", "frames": 4, "parsed": letter, "correct": correct, "trace": trace}

    nothing = "Nothing notable happens."
    vals = [val(0, "cyan", 45, True), val(1, "red", 21, True), val(2, "yellow", 5, True),
            val(3, "magenta", 30, False)]  # fmt: skip
    rows = [
        res(0, "A", False, [(0, 20, nothing), (20, 40, nothing)]),  # stops before 40-60 s
        res(1, "A", True, [(0, 20, nothing), (20, 40, "A red square appears at 21-26 s.")]),
        res(2, "C", False, [(0, 20, "A yellow square appears at 5-10 s.")]),  # not copied
        res(3, "D", True, []),  # answered from the overview
    ]
    got = tool_path(rows, {v["id"]: v for v in vals}, 4)
    assert got["need"].to_dict() == {"n": 3, "correct": 1, "called": 3, "covered": 2,
                                     "summary_colour": 2, "summary_right": 2, "copied": 1,
                                     "copied_right": 1}  # fmt: skip
    assert got["no_need"].n == 1 and got["no_need"].called == 0
    assert tuple(got["need"].to_dict()) == COUNTS  # the --json columns, in their order
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "val.jsonl").write_text("".join(json.dumps(v) + "\n" for v in vals))
    (tmp_path / "ev").mkdir()
    (tmp_path / "ev" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["tool-path", "--data", str(tmp_path / "task"), str(tmp_path / "ev")]
    assert cli_main(argv) == 0
    assert (
        f"| {tmp_path / 'ev'} | 4 | need | 3 | 1 | 3 | 2 | 2 | 2 | 1 | 1 |"
        in capsys.readouterr().out
    )
    assert cli_main(["tool-path", "--data", str(tmp_path), str(tmp_path / "ev")]) == 2
    assert "no val.jsonl" in capsys.readouterr().err
