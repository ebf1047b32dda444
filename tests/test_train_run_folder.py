"""One run per run folder (``paravt.runfolder``): a second run into a used folder and a
``--resume`` with other settings are refused with the way out; ``--resume`` without a
checkpoint, after a preemption during the first evaluation, and of a finished run logs every
step and every evaluation once.

Real ``python -m paravt.train`` runs (``paravt.train.main``, in this process) on the tiny config
of test_train_resume.py: one RL step of ~1 s, no SFT.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from test_train_resume import tiny_overrides
from train_runs import train_steps

from paravt.metrics import read_metrics
from paravt.preempt import TEST_SIGNAL_ENV


def _kinds(out: Path) -> dict[str, list[int]]:
    """The steps of each kind of row of ``out/metrics.jsonl``, in file order."""
    kinds: dict[str, list[int]] = {}
    for r in read_metrics(out / "metrics.jsonl"):
        kinds.setdefault(r["kind"], []).append(r["step"])
    return kinds


def _base(assets: dict[str, str], out: Path) -> list[str]:
    return [*tiny_overrides(assets, out, 1), "train.save_every=0"]


@pytest.fixture(scope="module")
def first_run(assets: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished one-step run (checkpoint step 1); tests work on copies of it."""
    from paravt.train import main

    out = tmp_path_factory.mktemp("run_folder") / "run"
    assert main(_base(assets, out)) == 0
    assert train_steps(out) == [1]
    return out


def test_a_second_run_into_a_used_folder_is_refused(
    assets: dict[str, str], first_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`make train` twice: refused, naming both ways out; nothing of the first run touched."""
    from paravt.train import main

    out = tmp_path / "run"
    shutil.copytree(first_run, out)
    capsys.readouterr()
    assert main(_base(assets, out)) == 2
    err = capsys.readouterr().err
    assert f"{out} already holds a training run" in err, err
    assert "metrics.jsonl with 1 rows, steps up to 1" in err and "step_000001" in err, err
    assert "--resume (make train ARGS=--resume)" in err and "another train.out_dir" in err, err
    assert train_steps(out) == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000001"]


def test_a_resume_with_other_settings_is_refused(
    assets: dict[str, str], first_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--resume with another lr, group size, reward weight or model: refused, each key named
    old -> new, config.yaml not rewritten; train.steps (extending the run) and logistics may
    change (the folder itself too: this is a copy of the run)."""
    from paravt.train import main

    out = tmp_path / "run"
    shutil.copytree(first_run, out)
    base = _base(assets, out)
    config = (out / "config.yaml").read_text()
    capsys.readouterr()
    other = ["algo.lr=2e-3", "rollout.group_size=3", "reward.w_fmt=0.5"]
    assert main([*base, *other, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--resume: the run in" in err, err
    for line in (
        "algo.lr: 0.001 -> 0.002",
        "rollout.group_size: 2 -> 3",
        "reward.w_fmt: 1.0 -> 0.5",
    ):
        assert f"  {line}\n" in err, err
    assert "resume with the same settings" in err and "another train.out_dir" in err, err
    assert (out / "config.yaml").read_text().replace(str(out), str(first_run)) == config

    # Another model.path (another tiny model): the path and the files' fingerprint.
    from paravt.models import build_tiny_checkpoint

    other_model = build_tiny_checkpoint(tmp_path / "other", seed=1)
    assert main([*base, f"model.path={other_model}", "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"  model.path: '' -> '{other_model}'" in err, err
    assert f"  weights of {other_model}: " in err, err

    more = [*base, "train.steps=2", "train.preempt_grace_s=5", "train.keep_last=2", "--resume"]
    assert main(more) == 0
    assert "(step 1)" in capsys.readouterr().out
    assert train_steps(out) == [1, 2]
    assert "steps: 2" in (out / "config.yaml").read_text()


def test_resume_of_a_run_folder_reads_its_own_config(
    assets: dict[str, str], first_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--resume RUN_DIR``: RUN_DIR/config.yaml is the base (nothing retyped; the folder may
    have moved), a key=value that changes a setting is refused as on any resume, and a bare
    ``--resume`` followed by an override still means the run in train.out_dir."""
    from paravt.train import main, parse_args

    out = tmp_path / "moved"  # a copy elsewhere: its config.yaml names first_run
    shutil.copytree(first_run, out)
    cfg, _ = parse_args(["--resume", str(out)])
    # The run's settings, not the tiny_cpu preset's (G 4, lr 1e-4, 4000 SFT steps, 30 steps).
    assert (cfg.rollout.group_size, cfg.algo.lr, cfg.sft.steps, cfg.train.steps) == (
        2, 1e-3, 0, 1,
    )  # fmt: skip
    assert cfg.train.resume and cfg.train.out_dir == str(out)
    assert cfg.model.tiny_dir == assets["model"]
    bare, _ = parse_args(["--resume", "train.steps=7", "algo.lr=0.5"])  # make train ARGS=...
    assert bare.train.resume and bare.train.steps == 7 and bare.algo.lr == 0.5
    assert bare.train.out_dir == "runs/train/default"

    capsys.readouterr()
    assert main(["--resume", str(out), "algo.lr=2e-3"]) == 2
    err = capsys.readouterr().err
    assert "--resume: the run in" in err and "  algo.lr: 0.001 -> 0.002\n" in err, err
    assert main(["--resume", str(tmp_path / "nowhere")]) == 2
    assert "nowhere: is not a folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["--resume", str(tmp_path / "empty")]) == 2
    assert "empty: holds no config.yaml" in capsys.readouterr().err
    assert main(["--resume", str(out), f"train.out_dir={first_run}"]) == 2
    assert "drop train.out_dir" in capsys.readouterr().err

    assert main(["--resume", str(out), "train.steps=2"]) == 0  # extend it: one key retyped
    printed = capsys.readouterr()
    assert "(step 1)" in printed.out and "random weights" not in printed.err
    assert train_steps(out) == [1, 2] and train_steps(first_run) == [1]
    assert f"out_dir: {out}\n" in (out / "config.yaml").read_text()


def test_resume_logs_every_step_and_evaluation_once(
    assets: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGTERM as the first evaluation starts skips it (the run stops, exit 0); --resume
    (no checkpoint yet) evaluates once; --resume of the finished run adds nothing; --resume
    after the checkpoint is gone (a kill before the first checkpoint) drops the rows past
    step 0 and redoes step 1, reusing the evaluation before RL."""
    from paravt.train import main

    out = tmp_path / "run"
    base = [
        *tiny_overrides(assets, out, 1),
        "train.save_every=0",
        "train.eval_prompts=1",
        "train.eval_samples=1",
    ]
    monkeypatch.setenv(TEST_SIGNAL_ENV, "SIGTERM:0:eval")
    assert main(base) == 0
    monkeypatch.delenv(TEST_SIGNAL_ENV)
    assert _kinds(out) == {}  # the evaluation was skipped, no step ran
    assert not (out / "checkpoints").exists()

    assert main([*base, "--resume"]) == 0
    done = {"eval_before": [0], "train": [1], "eval_after": [1]}
    assert _kinds(out) == done
    rows = read_metrics(out / "metrics.jsonl")

    assert main([*base, "--resume"]) == 0  # finished: nothing more to log
    assert _kinds(out) == done
    assert read_metrics(out / "metrics.jsonl") == rows

    shutil.rmtree(out / "checkpoints")
    assert main([*base, "--resume"]) == 0
    assert _kinds(out) == done
    again = read_metrics(out / "metrics.jsonl")
    assert again[0] == rows[0]  # the evaluation before RL was kept, not redone


def test_an_older_run_folder_is_checked_against_its_config_yaml(tmp_path: Path) -> None:
    """A run folder of an older paravt has no run.json: --resume compares its config.yaml. A
    folder that holds nothing of a run (it died before its first row) is not refused."""
    from paravt.config import ConfigError, load_config, to_yaml
    from paravt.runfolder import RUN_FILE, check_run_folder, record_run

    out = tmp_path / "run"
    old = load_config(overrides=[f"train.out_dir={out}", "algo.lr=1e-3"])
    out.mkdir()
    (out / "config.yaml").write_text(to_yaml(old))
    new = load_config(overrides=[f"train.out_dir={out}", "algo.lr=3e-3", "train.resume=true"])
    check_run_folder(new)  # no metric row, no checkpoint: nothing would be continued
    (out / "metrics.jsonl").write_text('{"step": 1, "kind": "train"}\n')
    with pytest.raises(ConfigError) as e:
        check_run_folder(new)
    assert f"({out / 'config.yaml'} (no run.json: an older paravt))" in str(e.value)
    assert "  algo.lr: 0.001 -> 0.003\n" in str(e.value)
    longer = load_config(overrides=[f"train.out_dir={out}", "algo.lr=1e-3", "train.steps=9"])
    check_run_folder(replace(longer, train=replace(longer.train, resume=True)))
    record_run(longer)
    assert (out / RUN_FILE).is_file()
    with pytest.raises(ConfigError, match="already holds a training run"):
        check_run_folder(longer)  # no --resume
