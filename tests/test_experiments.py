"""``python -m paravt.experiments ablation``: arms from one SFT checkpoint, the table, the
curves, and a rerun that keeps finished runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from paravt.experiments import aggregate, main
from paravt.experiments.arms import ABLATION_ARMS, ARMS, arm_overrides, run_finished
from paravt.metrics import read_metrics


def _args(assets: dict[str, str], out: Path) -> list[str]:
    kv = {
        # Its own task folder (the default task, at these settings): the session's shared
        # assets["data"] is never regenerated under other tests.
        "data.synth_dir": str(out.parent / f"{out.name}-synth"),
        "data.synth_num_videos": 2,
        "model.tiny_dir": assets["model"],
        "train.prompts_per_step": 2,
        "train.steps": 2,
        "train.eval_prompts": 2,
        "train.eval_samples": 1,
        "rollout.group_size": 2,
        "rollout.max_new_tokens": 8,
        "rollout.sub_max_new_tokens": 4,
        "agent.max_turns": 1,
        "agent.max_tool_response_tokens": 8,
        "video.frame_budgets": "[2,4]",
        "video.fixed_frames": 2,
        "sft.steps": 2,
        "sft.batch_size": 2,
        "algo.kl_coef": 0.0,  # no reference model: one model load per arm run, not two
    }
    return ["--out", str(out), "--eval-k", "2,4", *[f"{k}={v}" for k, v in kv.items()]]


def test_arms_differ_from_the_config_only_where_they_should() -> None:
    from paravt.config import ConfigError, load_config

    cfg = load_config("tiny_cpu")
    assert arm_overrides("paragrpo", cfg) == []
    assert set(arm_overrides("vanilla", cfg)) == {
        "reward.lambda_anchor=0.0",
        "video.gating=false",
        "video.fixed_frames=32",
    }
    assert arm_overrides("paragrpo_no_rtool", cfg) == ["reward.tool_bonus=0.0"]
    # The reference's vanilla: vanilla's overrides, no pinned <think>, the reference's rewards.
    ref = load_config("tiny_cpu", overrides=arm_overrides("vanilla_ref", cfg))
    assert set(arm_overrides("vanilla", cfg)) < set(arm_overrides("vanilla_ref", cfg))
    assert ref.agent.think_prefix == "" and ref.reward.base_format == "reference"
    assert ref.reward.answer_extraction == "reference" and ref.reward.tool_mode == "reference"
    assert (ref.reward.lambda_anchor, ref.video.gating, ref.reward.w_fmt) == (0.0, False, 1.0)
    assert "vanilla_ref" in ARMS and "vanilla_ref" not in ABLATION_ARMS
    assert "video.gating=false" in arm_overrides("anchoring", cfg)
    assert arm_overrides("gating", cfg) == ["reward.lambda_anchor=0.0"]
    with pytest.raises(ConfigError, match="unknown arm 'nope'"):
        arm_overrides("nope", cfg)
    agg = aggregate([{"a": 1.0, "b": float("nan")}, {"a": 3.0, "b": float("nan")}])
    assert agg["a"] == (2.0, math.sqrt(2.0)) and math.isnan(agg["b"][0])


def test_ablation_runs_every_arm_from_one_sft_and_resumes(assets, tmp_path, capsys) -> None:
    out = tmp_path / "abl"
    args = ["ablation", "--arms", "vanilla,paragrpo", "--seeds", "1", *_args(assets, out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "| vanilla |" in printed and "| paragrpo |" in printed
    res = json.loads((out / "ablation.json").read_text())
    assert set(res["per_seed"]) == {"vanilla", "paragrpo"} and res["seeds"] == 1
    for arm in ("vanilla", "paragrpo"):
        for seed in (0,):
            run = out / arm / f"seed{seed}"
            cfg_text = (run / "config.yaml").read_text()
            # Every run starts from the shared SFT checkpoint and trains no SFT of its own.
            assert f"path: {out / 'sft'}" in cfg_text and not (run / "sft").exists()
            assert f"seed: {seed}" in cfg_text
            rows = read_metrics(run / "metrics.jsonl")
            after = [r for r in rows if r["kind"] == "eval_after"]
            assert "K2_tools/accuracy" in after[0] and "K4_tools/accuracy" in after[0]
            assert not [r for r in rows if r["kind"] == "eval_before"]  # train.eval_before
        row = res["per_seed"][arm][0]
        assert 0.0 <= row["accuracy/K2"] <= 1.0 and row["tool_calls_per_rollout"] >= 0.0
    # Ungated vanilla draws only the largest budget: no tool rate at K2 (null in the JSON).
    van, para = res["per_seed"]["vanilla"][0], res["per_seed"]["paragrpo"][0]
    assert van["tool_rate/K2"] is None and van["tool_rate/K4"] is not None
    assert para["tool_rate/K2"] is not None or para["tool_rate/K4"] is not None
    assert (out / "ablation.png").stat().st_size > 1000
    table = (out / "ablation.md").read_text()
    assert "mean ± std over 1 seed(s)" in table and "| vanilla | " in table

    # A rerun keeps what finished and continues a run cut short from its checkpoint
    # (paravt.experiments.arms.run_arms, the collapse experiment's driver too); without a
    # checkpoint it is redone from scratch.
    logs = {p: p.stat().st_mtime_ns for p in out.glob("*/seed*/train.log")}
    (out / "paragrpo" / "seed0" / "metrics.jsonl").write_text("")  # as if killed mid-run
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert printed.count("finished before, kept") == 1 and "SFT checkpoint" in printed
    assert "paragrpo seed 0: cut short, resumed from" in printed
    redone = [p for p, t in logs.items() if p.stat().st_mtime_ns != t]
    assert redone == [out / "paragrpo" / "seed0" / "train.log"]
    assert run_finished(out / "paragrpo" / "seed0")
    # The shared sft/ carries its settings (issue 50 item 5): another SFT lr is refused, not
    # silently reused by every arm.
    assert main([*args, "sft.lr=5e-3"]) == 2
    err = capsys.readouterr().err
    assert f"{out / 'sft'} was trained with other cold-start settings" in err, err


def test_bad_arguments_fail_before_anything_runs(tmp_path, capsys) -> None:
    assert main(["ablation", "--arms", "vanilla,nope", "--out", str(tmp_path / "x")]) == 2
    assert "unknown arm 'nope'" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main(["ablation", "--seeds", "0"]) == 2
    assert "--seeds 0 must be >= 1" in capsys.readouterr().err
    assert set(ARMS) >= {"vanilla", "paragrpo"}


def test_no_second_training_loop_under_paravt_experiments() -> None:
    """Issue 38 item 1: every arm run is ``paravt.train``'s (``python -m paravt.train`` through
    ``arms.run_arms``, or ``train.run`` for the cold start's evaluation). No experiment module
    imports a step's parts (``train_step``, ``build_trainer``, the agent loop, the engines,
    the algorithm) to drive a loop of its own."""
    import ast

    pkg = Path(__file__).resolve().parents[1] / "paravt" / "experiments"
    stages = ("paravt.agent", "paravt.engines", "paravt.algo", "paravt.eval", "paravt.workers")
    seen = set()
    for path in sorted(pkg.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = {a.name for a in node.names}
                if node.module == "paravt.train":
                    assert names == {"run"}, (path.name, names)
                    seen.add(path.name)
                assert not node.module.startswith(stages), (path.name, node.module)
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith((*stages, "paravt.train")) for a in node.names)
    assert seen == {"collapse.py"}  # the cold start's evaluation: train.run itself
    assert "paravt.train" in (pkg / "arms.py").read_text()  # the arm runs: python -m paravt.train


def test_a_stamp_from_before_sft_save_every_left_it_still_matches(tmp_path, capsys) -> None:
    """Stamps written while ``sft_stamp`` still recorded ``sft.save_every`` (how often the
    SFT's state is saved, not what it trains) match today's; any other difference refuses."""
    from paravt.config import ConfigError, load_config
    from paravt.experiments.arms import code_stamp, reused_checkpoint, sft_stamp

    dst = tmp_path / "sft"
    dst.mkdir()
    (dst / "config.json").write_text("{}")
    made = {"sft": sft_stamp(load_config("tiny_cpu").sft), "seed": 0}
    assert "save_every" not in made["sft"]
    stamp = tmp_path / "sft_params.json"
    code = {"code": code_stamp()}
    stamp.write_text(json.dumps({**made, **code, "sft": {**made["sft"], "save_every": 500}}))
    assert reused_checkpoint(dst, "t", stamp, made) is True
    stamp.write_text(json.dumps({**made, **code, "sft": {**made["sft"], "steps": 1}}))
    with pytest.raises(ConfigError, match=r"other cold-start settings or code .*sft.steps: 1 ->"):
        reused_checkpoint(dst, "t", stamp, made)


def test_a_cold_start_made_by_other_code_is_not_reused(tmp_path) -> None:
    """Issue 62 item 1: the reuse stamp records the code that trained the checkpoint (a hash
    of the package's files) beside its settings; a checkpoint made by other code, or with a
    stamp from before the code was recorded, is refused naming the code; where the code came
    from (``made_by``: commit, edited tree, versions) is recorded and never compared."""
    import shutil

    from paravt.config import ConfigError, load_config
    from paravt.experiments import arms
    from paravt.experiments.arms import code_stamp, reused_checkpoint, sft_stamp

    # The hash covers every .py/.json file of the package, by path and bytes, and nothing else.
    pkg = tmp_path / "pkg"
    shutil.copytree(Path(arms.__file__).parents[1], pkg, ignore=shutil.ignore_patterns("*.so"))
    first = code_stamp(pkg)["paravt"]
    assert first == code_stamp(Path(arms.__file__).parents[1])["paravt"]  # the same files
    (pkg / "__pycache__").mkdir(exist_ok=True)
    (pkg / "__pycache__" / "x.json").write_text("{}")
    (pkg / "notes.txt").write_text("not code")
    assert code_stamp.__wrapped__(pkg)["paravt"] == first
    sft = pkg / "sft.py"
    sft.write_text(sft.read_text() + "\n# an edit\n")
    edited = code_stamp.__wrapped__(pkg)["paravt"]
    assert edited != first
    (pkg / "models" / "arch" / "qwen3vl_2b.json").write_text("{}")
    assert code_stamp.__wrapped__(pkg)["paravt"] not in (first, edited)

    dst = tmp_path / "sft"
    dst.mkdir()
    (dst / "config.json").write_text("{}")
    made = {"sft": sft_stamp(load_config("tiny_cpu").sft), "seed": 0}
    stamp = tmp_path / "sft_params.json"
    mine = {**made, "code": code_stamp(), "made_by": {"commit": "x", "paravt_edited": True}}
    stamp.write_text(json.dumps(mine))
    assert reused_checkpoint(dst, "t", stamp, made) is True  # made_by is not compared
    stamp.write_text(json.dumps({**made, "code": {"paravt": edited}}))
    with pytest.raises(ConfigError, match=f"code.paravt: {edited} -> {code_stamp()['paravt']}"):
        reused_checkpoint(dst, "t", stamp, made)
    stamp.write_text(json.dumps(made))  # written before the code was recorded
    with pytest.raises(ConfigError, match=r"code.paravt: \(absent\) ->"):
        reused_checkpoint(dst, "t", stamp, made)


def test_an_arm_run_made_by_other_code_is_redone(tmp_path) -> None:
    """The arm runs' and the cold-start evaluation's stamp (``run_stamp``) carries the code
    too: a finished run made by other code is not kept."""
    from paravt.config import load_config
    from paravt.experiments.arms import code_stamp, kept_run, run_stamp, write_stamp

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "eval_after", "step": 1}) + "\n")
    stamp = run_stamp(load_config("tiny_cpu"), eval_every=5)
    assert stamp["code"] == code_stamp()
    write_stamp(run, stamp)
    assert kept_run(run, stamp)[0]
    write_stamp(run, {**stamp, "code": {"paravt": "0" * 64}})
    keep, why = kept_run(run, stamp)
    assert not keep and f"code.paravt: {'0' * 64} -> {code_stamp()['paravt']}" in why
