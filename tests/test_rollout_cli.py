"""``python -m paravt.rollout``: a real subprocess run on the synthetic task + tiny model."""

from __future__ import annotations

import re
import subprocess
import sys

from paravt.rollout.__main__ import OracleMainEngine, main


def test_cli_prints_turns_calls_crops_rewards(synth_dir, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "paravt.rollout",
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
