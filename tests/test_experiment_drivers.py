"""Issue 34 item 19: the experiment drivers (``python -m paravt.experiments ablation`` and
``collapse``, their shared ``paravt.experiments.arms``) redo a finished arm run made with other settings (keeping the old one in superseded/),
forward SIGTERM to the arm run's process group, refuse a folder a live run holds, and refuse an
empty ``--arms`` list."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_train import small_overrides

from paravt.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def test_an_empty_arms_list_is_refused(tmp_path: Path, capsys) -> None:
    from paravt.experiments import main

    assert main(["ablation", "--arms", ",", "--out", str(tmp_path / "a"), "sft.steps=0"]) == 2
    assert "--arms ',' names no arm; give a comma list of vanilla" in capsys.readouterr().err
    rc = main(["collapse", "--arms", " ", "--out", str(tmp_path / "c"), "data.synth_task=colour"])
    assert rc == 2
    assert "--arms ' ' names no arm" in capsys.readouterr().err


def test_kept_run_compares_the_resolved_config(tmp_path: Path) -> None:
    from paravt.config import to_yaml
    from paravt.experiments.arms import STAMP, kept_run, run_stamp, write_stamp

    a = load_config("tiny_cpu")
    b = load_config("tiny_cpu", overrides=["algo.lr=0.001", "rollout.group_size=3"])
    run = tmp_path / "run"
    run.mkdir()
    write_stamp(run, run_stamp(a, eval_every=5))
    assert kept_run(run, run_stamp(a, eval_every=5)) == (False, "not finished")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 4, "kind": "eval_after"}) + "\n")
    assert kept_run(run, run_stamp(a, eval_every=5))[0]
    keep, why = kept_run(run, run_stamp(b, eval_every=5))
    assert not keep
    lr, g = a.algo.lr, a.rollout.group_size
    assert f"algo.lr: {lr} -> 0.001" in why and f"rollout.group_size: {g} -> 3" in why, why
    assert "eval_every: 5 -> 25" in kept_run(run, run_stamp(a, eval_every=25))[1]
    # A run made before stamps: its config.yaml (the resolved config it wrote) decides.
    (run / STAMP).unlink()
    (run / "config.yaml").write_text(to_yaml(a))
    assert kept_run(run, run_stamp(a, eval_every=5))[0]
    assert f"algo.lr: {lr} -> 0.001" in kept_run(run, run_stamp(b))[1]


def _ablation_args(assets, tmp_path: Path, out: Path, *extra: str, steps: int = 1) -> list[str]:
    kv = small_overrides(
        assets, tmp_path / "x", **{"train.steps": steps, "train.eval_prompts": 1,
                                   "train.eval_samples": 1,
                                   "algo.kl_coef": 0.0}  # no reference model to load
    )  # fmt: skip
    return ["ablation", "--seeds", "1", "--arms", "vanilla", "--eval-k", "2", "--out", str(out),
            *kv, *extra]  # fmt: skip


def test_a_rerun_with_other_rl_settings_redoes_the_arm_run(assets, tmp_path, capsys) -> None:
    from paravt.experiments import main

    out = tmp_path / "abl"
    out.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (out / ".lock").write_text(json.dumps({"pid": dead.pid}))  # stale: taken over
    assert main(_ablation_args(assets, tmp_path, out)) == 0, capsys.readouterr().err[-3000:]
    first = capsys.readouterr().out
    assert "finished before" not in first and not (out / ".lock").exists()
    assert main(_ablation_args(assets, tmp_path, out)) == 0
    assert "vanilla seed 0: finished before, kept" in capsys.readouterr().out
    finished = (out / "vanilla" / "seed0" / "metrics.jsonl").read_bytes()
    assert main(_ablation_args(assets, tmp_path, out, "algo.lr=0.001")) == 0
    again = capsys.readouterr().out
    assert "vanilla seed 0: made with other settings (algo.lr: 0.0001 -> 0.001): redone" in again
    cfg = (out / "vanilla" / "seed0" / "config.yaml").read_text()
    assert "lr: 0.001" in cfg
    # The finished run is kept, not deleted (issue 66 item 4g; on main it was rmtree'd).
    kept = out / "vanilla" / "superseded" / "seed0.1"
    assert f"vanilla seed 0: its earlier run is kept in {kept}" in again
    assert (kept / "metrics.jsonl").read_bytes() == finished
    assert "lr: 0.0001" in (kept / "config.yaml").read_text()
    # A third setting sets the second run aside beside the first; the ablation's own
    # folders (OUT/ARM/seedN) are the new run's.
    assert main(_ablation_args(assets, tmp_path, out, "algo.lr=0.002")) == 0
    assert "lr: 0.001" in (out / "vanilla" / "superseded" / "seed0.2" / "config.yaml").read_text()
    assert (kept / "metrics.jsonl").read_bytes() == finished
    assert sorted(p.name for p in out.glob("*/seed*")) == ["seed0"]


def _pids_of(run_dir: Path) -> list[int]:
    """The processes whose command line names ``run_dir`` (the arm run)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if f"train.out_dir={run_dir}".encode() in cmd:
                pids.append(int(p.name))
    return pids


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_sigterm_to_the_driver_reaches_the_arm_run(assets, tmp_path) -> None:
    out = tmp_path / "abl"
    run_dir = out / "vanilla" / "seed0"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = _ablation_args(assets, tmp_path, out, steps=500)
    drv = subprocess.Popen(
        [sys.executable, "-m", "paravt.experiments", *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    children: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not children:
            assert drv.poll() is None, drv.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the arm run never started"
            children = _pids_of(run_dir)
            time.sleep(0.1)
        drv.send_signal(signal.SIGTERM)
        _, err = drv.communicate(timeout=120)
        assert drv.returncode == 128 + signal.SIGTERM, err[-3000:]
        assert "SIGTERM: forwarded to ablation run vanilla seed 0" in err, err[-3000:]
        assert all(_gone(p) for p in children), [p for p in children if not _gone(p)]
        assert not (out / ".lock").exists()
    finally:
        drv.kill()
        for p in children + _pids_of(run_dir):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_folder_a_live_run_holds_is_refused(assets, tmp_path, capsys) -> None:
    """The lock names a live process: the command stops before touching the folder."""
    from paravt.experiments import main

    out = tmp_path / "abl"
    (out / "vanilla" / "seed0").mkdir(parents=True)
    (out / "vanilla" / "seed0" / "sentinel").write_text("the live run's")
    holder = subprocess.Popen(["sleep", "60"])
    try:
        (out / ".lock").write_text(json.dumps({"pid": holder.pid}))
        assert main(_ablation_args(assets, tmp_path, out)) == 2
        err = capsys.readouterr().err
        assert f"{out} is held by a live run (its driver: pid {holder.pid}" in err, err[-2000:]
        assert "kill -TERM" in err
        assert (out / "vanilla" / "seed0" / "sentinel").read_text() == "the live run's"
        assert not (out / "sft").exists()
    finally:
        holder.kill()
        holder.wait()
