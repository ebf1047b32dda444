"""An evaluation and a training run never share a folder: both keep a ``run.json`` (of other
contents), so ``python -m paravt.eval --out RUN`` would replace a training run's record (its
``--resume`` then fails on a misleading diff of the eval's settings) and a training run into an
evaluation's folder would mix metric rows with its results. Each refuses the other's folder
before writing anything. Hand-made folders, no model: seconds."""

from __future__ import annotations

import json

import pytest
from eval_stubs import FailingRunner, NoEngine, eval_settings, missing_samples

from paravt.config import ConfigError, load_config
from paravt.eval.runner import EvalError, run_eval, settings_refusal
from paravt.runfolder import check_run_folder, record_run
from paravt.types import Sample


@pytest.mark.parametrize("started", [False, True])
def test_an_evaluation_into_a_training_run_folder_is_refused(tmp_path, started) -> None:
    """``started``: the run has logged a step; without, only its run.json is there (a run
    that has just begun)."""
    run = tmp_path / "run"
    cfg = load_config("tiny_cpu", overrides=[f"train.out_dir={run}"])
    record_run(cfg)
    if started:
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "kind": "train"}) + "\n")
    before = (run / "run.json").read_bytes()
    said = settings_refusal(run, eval_settings())
    assert f"{run} holds a training run" in said and "pass another --out" in said
    with pytest.raises(EvalError, match="holds a training run"):
        run_eval(missing_samples(tmp_path), NoEngine(), run, eval_settings(), show_progress=False)
    assert (run / "run.json").read_bytes() == before  # its record is untouched
    assert not (run / "results.jsonl").exists() and not (run / "summary.json").exists()
    # A folder inside the run is the evaluation's own.
    summary = run_eval(
        missing_samples(tmp_path), NoEngine(), run / "eval", eval_settings(), show_progress=False
    )
    assert summary["n"] == 2


@pytest.mark.parametrize("resume", [False, True])
def test_a_training_run_into_an_evaluation_folder_is_refused(tmp_path, resume) -> None:
    out = tmp_path / "eval"
    run_eval(missing_samples(tmp_path), NoEngine(), out, eval_settings(), show_progress=False)
    before = (out / "run.json").read_bytes()
    cfg = load_config("tiny_cpu", overrides=[f"train.out_dir={out}", f"train.resume={resume}"])
    with pytest.raises(ConfigError, match=f"{out} holds an evaluation") as e:
        check_run_folder(cfg)
    assert "train.out_dir" in str(e.value)
    assert (out / "run.json").read_bytes() == before


def test_rows_scored_against_changed_annotations_are_redone(tmp_path, capsys) -> None:
    """A rerun after the benchmark's annotations changed (another gold answer, question or
    options) redoes those samples instead of keeping rows scored against the old answers
    ("4 of 4 already done"); unchanged samples stay done."""
    from paravt.eval.runner import load_results, result_row

    video = tmp_path / "v.mp4"
    video.write_bytes(b"not read: the runner is scripted")
    old = [Sample(f"s{i}", str(video), f"q{i}?", "A", "mcq", options=["A. x", "B. y"])
           for i in range(4)]  # fmt: skip
    out = tmp_path / "eval"
    out.mkdir()
    # Finished rows (an error kind that is not retried counts as done) of the old annotations.
    rows = [result_row(s, None, frames=4, error="done", kind="unsupported") for s in old]
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "run.json").write_text(json.dumps(eval_settings().__dict__))
    new = [Sample(s.id, s.video, s.question, s.answer, "mcq", options=list(s.options))
           for s in old]  # fmt: skip
    new[1].answer = "B"  # the gold answer was fixed
    new[2].question = "q2, reworded?"
    new[3].options = ["A. x", "B. z"]
    runner = FailingRunner()
    run_eval(new, runner, out, eval_settings(), show_progress=False, stream=None)
    assert sorted(set(runner.asked)) == ["s1", "s2", "s3"]
    said = capsys.readouterr().out
    assert "3 of 4 finished rows were scored against other annotations" in said
    got = load_results(out)
    assert got["s1"]["answer"] == "B" and got["s2"]["question"] == "q2, reworded?"
    assert got["s0"]["error"] == "done"  # unchanged: kept, not redone
