"""Issue 34 item 20, the smaller hostile-input findings, one test each."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from paravt.config import load_config


# --------------------------------------------------- a question longer than the context
def test_a_question_longer_than_the_context_is_an_error_row_of_its_own(
    assets, synth_dir, tmp_path
) -> None:
    from test_eval_runner import FAST, _settings

    from paravt.agent.loop import AgentRunner
    from paravt.engines.hf import HFEngine
    from paravt.eval.benchmarks import load_benchmark
    from paravt.eval.runner import RETRYABLE, load_results, run_eval
    from paravt.models import load_model

    tiny = load_model(assets["model"], dtype="float32", device="cpu")
    cfg = load_config("tiny_cpu", overrides=FAST)
    samples = load_benchmark("synth", synth_dir)[:2]
    samples[1].question = "Which colour is the square? " + "Think of every frame. " * 800
    runner = AgentRunner(HFEngine(tiny, seed=0, max_model_len=1500), tiny, cfg)
    summary = run_eval(samples, runner, tmp_path, _settings(), show_progress=False)
    rows = load_results(tmp_path)
    bad = rows[samples[1].id]
    assert bad["error_kind"] == "context" and "context" not in RETRYABLE
    assert f"sample {samples[1].id}: turn 0: the prompt alone (" in bad["error"]
    assert "leaves no room in the engine's context (1500 tokens)" in bad["error"]
    assert bad["unparseable"] is False and bad["score"] == 0.0
    assert rows[samples[0].id]["error"] is None
    assert summary["n_errors"] == 1


# ----------------------------------------------------------------------- > 26 options
def test_more_than_26_options_name_the_row(tmp_path: Path) -> None:
    from eval_fixtures import write_benchmark

    from paravt.data.readers import DatasetError, load_samples
    from paravt.eval.benchmarks import BenchmarkFormatError, load_benchmark

    write_benchmark("videomme", tmp_path, video=False)
    p = tmp_path / "videomme/test-00000-of-00001.parquet"
    rows = pq.read_table(p).to_pylist()
    rows[1]["options"] = [f"{chr(65 + j) if j < 26 else 'AA'}. x{j}" for j in range(27)]
    pq.write_table(pa.Table.from_pylist(rows), p)
    with pytest.raises(BenchmarkFormatError) as e:
        load_benchmark("videomme", tmp_path)
    msg = str(e.value)
    assert "row 1" in msg and rows[1]["question_id"] in msg, msg
    assert "'options' has 27 options, more than the 26 letters A..Z" in msg or (
        "field 'options'" in msg and "has 27 options" in msg
    ), msg

    d = tmp_path / "train"
    d.mkdir()
    (d / "v.mp4").write_bytes(b"x")
    row = {"id": "r7", "video": "v.mp4", "question": "q", "answer": "A",
           "options": [f"o{j}" for j in range(27)]}  # fmt: skip
    (d / "train.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(DatasetError, match=r"train.jsonl:1: 'options' has 27 options"):
        load_samples(str(d), split="train")


# ------------------------------------------------------- a FIFO, a directory, a symlink loop
def test_a_fifo_a_directory_and_a_symlink_loop_are_named_as_such(tmp_path: Path) -> None:
    import os

    from paravt.eval.runner import evaluate_samples
    from paravt.types import Sample

    os.mkfifo(tmp_path / "pipe.mp4")
    (tmp_path / "dir.mp4").mkdir()
    os.symlink(tmp_path / "loop.mp4", tmp_path / "loop.mp4")
    os.symlink(tmp_path / "gone.mp4", tmp_path / "dangling.mp4")
    names = ["pipe", "dir", "loop", "dangling", "nope"]
    samples = [Sample(n, str(tmp_path / f"{n}.mp4"), "q", "A") for n in names]
    rows: list[dict] = []
    evaluate_samples(samples, None, frames=4, batch_size=2, seed=0, write=rows.append)
    got = {r["id"]: (r["error_kind"], r["error"]) for r in rows}
    assert got["pipe"] == ("video", f"video is a FIFO (named pipe), not a video file: it cannot "
                                    f"be probed or seeked: {tmp_path / 'pipe.mp4'}")  # fmt: skip
    assert got["dir"][0] == "video" and got["dir"][1].startswith("video is a directory, not a")
    assert got["loop"][0] == "video" and got["loop"][1].startswith("video is a symlink loop")
    assert got["dangling"][1].startswith("video is a symlink to a missing file (")
    assert got["nope"] == ("missing", f"video not found: {tmp_path / 'nope.mp4'}")


# ------------------------------------------------------ a deterministic aspect-ratio failure
def test_an_extreme_aspect_ratio_is_not_a_retryable_engine_error(
    assets, make_clip, synth_dir, tmp_path
) -> None:
    """A real 8x1632 H.264 file (aspect 204 > the model's 200): the eval's row says so, of a
    kind a rerun does not retry; the other sample of its batch is evaluated."""
    from test_eval_runner import FAST, _settings

    from paravt.agent.loop import AgentRunner
    from paravt.engines.hf import HFEngine
    from paravt.eval.benchmarks import load_benchmark
    from paravt.eval.runner import RETRYABLE, load_results, run_eval
    from paravt.models import load_model

    tiny = load_model(assets["model"], dtype="float32", device="cpu")
    cfg = load_config("tiny_cpu", overrides=FAST)
    samples = load_benchmark("synth", synth_dir)[:2]
    samples[1].video = make_clip(size=(8, 1632), duration=4.0)
    runner = AgentRunner(HFEngine(tiny, seed=0), tiny, cfg)
    run_eval(samples, runner, tmp_path, _settings(), show_progress=False)
    rows = load_results(tmp_path)
    bad = rows[samples[1].id]
    assert bad["error_kind"] == "unsupported" and "unsupported" not in RETRYABLE, bad
    assert "aspect ratio of 8x1632 exceeds 200" in bad["error"], bad["error"]
    assert rows[samples[0].id]["error"] is None


# ----------------------------------------------- hostile records in the viewer and --resume
def test_the_viewer_survives_non_object_lines_and_string_turns(tmp_path: Path) -> None:
    from paravt.view import write_report

    d = tmp_path / "run"
    d.mkdir()
    rows = [{"step": 1, "kind": "train", "tool_call_rate": 0.5}, [1, 2], 3, "text", None]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    trajs = [
        [1, 2],
        "a string",
        {"uid": "u-str", "step": 1, "turns": "<answer>A</answer>", "breakdown": [1]},
        {"uid": "u-mixed", "step": 1, "turns": [{"text": "t", "calls": "x"}, "y", 5],
         "thumbs": "t.jpg", "frame_times": "12", "breakdown": {"acc": 1.0}},
    ]  # fmt: skip
    (d / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trajs))
    page = (write_report(d).parent / "trajectories.html").read_text()
    assert "u-str" in page and "u-mixed" in page

    e = tmp_path / "eval"
    e.mkdir()
    res = [7, {"id": "e1", "question": "q", "answer": "A", "trace": "oops", "score": 1.0}]
    (e / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in res))
    assert "e1" in (write_report(e).parent / "trajectories.html").read_text()


def test_resume_truncation_survives_a_text_step(tmp_path: Path) -> None:
    from paravt.metrics import MetricsLogger, read_metrics

    rows = [{"step": 1, "kind": "train"}, {"step": "two", "kind": "train"},
            {"step": 3, "kind": "train"}, {"kind": "alarm"}, {"step": 2.0, "kind": "train"}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    MetricsLogger(tmp_path, tensorboard=False).truncate_after(2)
    # A row whose step is not a number cannot be placed: dropped with the later steps.
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 1, "kind": "train"}, {"kind": "alarm"}, {"step": 2.0, "kind": "train"}
    ]  # fmt: skip


# ------------------------------------------------------------------ command lines, configs
def test_train_takes_overrides_on_both_sides_of_resume() -> None:
    from paravt.train import parse_args

    cfg, _ = parse_args(["train.steps=3", "--resume", "train.seed=5"])
    assert (cfg.train.steps, cfg.train.seed, cfg.train.resume) == (3, 5, True)


def test_behav_cap_null_is_said_to_be_uncapped() -> None:
    from paravt.config import ConfigError

    with pytest.raises(ConfigError, match=r"or null: no cap, the importance weight applies"):
        load_config(overrides=["algo.loss=decoupled", "algo.behav_cap=0.5"])


def test_vllm_greedy_with_top_p_is_refused_by_the_training_config() -> None:
    from paravt.config import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(
            overrides=["rollout.engine=vllm", "rollout.sub_temperature=0", "rollout.top_p=0.9"]
        )
    msg = str(e.value)
    assert "rollout.top_p=0.9 with rollout.engine=vllm and rollout.sub_temperature=0" in msg
    assert "set rollout.top_p=1, or rollout.sub_temperature>0" in msg
    # The HF engine scores greedy rows under the nucleus as sampled: allowed.
    load_config(overrides=["rollout.sub_temperature=0", "rollout.top_p=0.9"])


def test_sft_and_the_experiments_check_the_required_model_path(tmp_path, capsys) -> None:
    """The 8B presets mark model.path required: sft and the experiments refuse it empty
    before anything loads or is written, as train does."""
    from paravt.experiments import main as experiments
    from paravt.sft import main as sft

    out = tmp_path / "x"
    assert sft(["--preset", "qwen3vl_8b_paragrpo", "--out", str(out)]) == 2
    assert "preset 'qwen3vl_8b_paragrpo' needs model.path" in capsys.readouterr().err
    args = ["--preset", "qwen3vl_8b_paragrpo", "--out", str(out)]
    assert experiments(["ablation", *args]) == 2
    assert "needs model.path" in capsys.readouterr().err
    assert experiments(["collapse", *args]) == 2
    assert "needs model.path" in capsys.readouterr().err
    assert not out.exists()


def test_sft_keeps_the_old_checkpoint_until_the_new_one_is_in_place(
    assets, tmp_path, monkeypatch
) -> None:
    import os

    from test_sft import _cfg

    from paravt.sft import run_sft

    out = tmp_path / "sft"
    out.mkdir()
    (out / "config.json").write_text('{"old": true}')
    real = os.replace

    def replace(src, dst):  # the move of the new checkpoint into place fails (a kill, EXDEV)
        if Path(dst) == out and Path(src).name == "sft.tmp":
            raise OSError(18, "Invalid cross-device link")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError):
        run_sft(_cfg(assets, tmp_path, **{"sft.steps": 1}), model_dir=assets["model"],
                data_dir=assets["data"], out_dir=out)  # fmt: skip
    assert (out / "config.json").read_text() == '{"old": true}'
    monkeypatch.setattr(os, "replace", real)
    run_sft(_cfg(assets, tmp_path, **{"sft.steps": 1}), model_dir=assets["model"],
            data_dir=assets["data"], out_dir=out)  # fmt: skip
    assert "old" not in (out / "config.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("sft")) == ["sft"]
