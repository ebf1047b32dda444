"""``python -m paravt.episodes``: a real subprocess run on the synthetic task + tiny model."""

from __future__ import annotations

import re
import subprocess
import sys

from paravt.engines.oracle import OracleMainEngine
from paravt.episodes import main


def test_cli_prints_turns_calls_crops_rewards(synth_dir, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "paravt.episodes",
        "--num-prompts",
        "3",  # the third is temporal grounding: the oracle always crops for it
        "--group-size",
        "2",
        "--show",
        "1",
        "--main",
        "oracle",
        f"data.path={synth_dir}",
        f"model.tiny_dir={tmp_path / 'model'}",
        "rollout.sub_max_new_tokens=8",
        "video.crop_max_frames=4",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    out = p.stdout
    assert out.count("prompt ") >= 3 and "turn 0, finish=stop" in out
    assert re.search(r"call 0: crop_video \[\d+\.\d, \d+\.\d\] s -> ok", out)
    assert "summary: " in out and "crops: " in out
    # The oracle answers correctly: the accuracy reward must say so.
    assert re.search(r"reward: total=\S+  acc=1\.000", out)
    assert re.search(r"3 prompt\(s\) x G=2: 6 episodes in .* episodes/s", out)
    assert "engine calls: main 2, sub 1; planner runs 2" in out  # 2 turns: 1 of crops
    assert (tmp_path / "model" / "config.json").is_file()  # tiny model built on demand


def test_cli_rejects_bad_config(capsys):
    assert main(["--num-prompts", "1", "agent.no_such_key=3"]) == 2
    assert "agent.no_such_key" in capsys.readouterr().err


def test_oracle_engine_request_ids():
    assert OracleMainEngine.sample_id("3:synth-s0-vid_0001-mcq:r7") == "synth-s0-vid_0001-mcq"
    assert OracleMainEngine.sample_id("3:a:b:r0") == "a:b"
    assert OracleMainEngine.sample_id("3:x:r0:t1:c2") is None  # a sub-agent request


ROLL = ["--num-prompts", "1", "--group-size", "1", "--show", "1", "rollout.max_new_tokens=8",
        "rollout.sub_max_new_tokens=4", "video.crop_max_frames=4"]  # fmt: skip


def test_cli_uses_the_newest_checkpoint_of_train_out_dir(assets, synth_dir, tmp_path, capsys):
    """No --model: the newest checkpoint of train.out_dir is loaded (with its run's config);
    --model picks any other."""
    from paravt.checkpoint import save_checkpoint
    from paravt.config import load_config, to_yaml
    from paravt.models import load_model

    run = tmp_path / "run"
    bundle = load_model(assets["model"], device="cpu")
    ckpts = [
        save_checkpoint(run, step, model=bundle.model, model_state=bundle.model.state_dict(),
                        trainer_state={}, tokenizer=bundle.tokenizer,
                        source_dir=assets["model"], keep_last=0)
        for step in (2, 4)
    ]  # fmt: skip
    # The run's config: its 2 overview frames are what the rollout must then use.
    (run / "config.yaml").write_text(to_yaml(load_config(overrides=["video.fixed_frames=2"])))
    args = [*ROLL, f"data.path={synth_dir}", f"train.out_dir={run}", "video.gating=false"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"model: {ckpts[-1]}\n" in out and "untrained" not in out
    assert "K=2 overview frames" in out  # the run's config.yaml was applied
    assert main([*args, "--model", str(ckpts[0])]) == 0
    assert f"model: {ckpts[0]}\n" in capsys.readouterr().out
    # A run folder stands for its newest checkpoint; a folder that is neither is refused.
    assert main([*args, "--model", str(run)]) == 0
    assert f"model: {ckpts[-1]}\n" in capsys.readouterr().out
    assert main([*args, "--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_cli_without_a_checkpoint_says_the_model_is_untrained(assets, synth_dir, tmp_path, capsys):
    args = [*ROLL, f"data.path={synth_dir}", f"train.out_dir={tmp_path / 'none'}",
            f"model.tiny_dir={assets['model']}"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "the model is untrained" in out and "`make train`" in out
    assert "model: untrained tiny model" in out and "episode " in out
    assert main([*args, "--model", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
