"""``python -m paravt.eval`` end to end: the real tiny Qwen3-VL through the HF engine on the
synthetic task (both crop modes), resume after a kill, error rows, refused mixed settings."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paravt.agent import AgentRunner
from paravt.config import load_config
from paravt.engines.engine import Engine
from paravt.engines.hf import HFEngine
from paravt.engines.oracle import OracleMainEngine, load_oracle
from paravt.eval.__main__ import main
from paravt.eval.benchmarks import load_benchmark
from paravt.eval.runner import EvalSettings, load_results, run_eval
from paravt.models import load_model

FAST = ["rollout.max_new_tokens=24", "rollout.sub_max_new_tokens=8", "video.crop_max_frames=4"]


@pytest.fixture(scope="module")
def tiny(assets):
    return load_model(assets["model"], dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def oracle_task(synth_dir, tmp_path_factory) -> Path:
    """The synthetic task with its TRAIN rows as the evaluated split, so that the oracle turns
    of ``sft.jsonl`` (train rows only) can play the main agent: real crops, real sub-agents."""
    d = tmp_path_factory.mktemp("oracle_task")
    (d / "videos").symlink_to(Path(synth_dir) / "videos")
    rows = (Path(synth_dir) / "sft.jsonl").read_text().splitlines()  # one K per sample: 4
    (d / "sft.jsonl").write_text(
        "".join(x + "\n" for x in rows if json.loads(x)["num_frames"] == 4)
    )
    shutil.copy(Path(synth_dir) / "train.jsonl", d / "val.jsonl")
    return d


def _settings(**kw) -> EvalSettings:
    base = dict(
        benchmark="synth",
        data_root="x",
        model="m",
        engine="hf",
        frames=4,
        crop_mode="subagent",
        temperature=0.0,
        top_p=1.0,
        sub_temperature=0.0,
        max_turns=3,
        max_parallel=5,
        max_new_tokens=24,
    )
    base.update(kw)
    return EvalSettings(**base)


@pytest.mark.parametrize("crop_mode", ["subagent", "frames"])
def test_oracle_main_agent_crops_for_real_and_scores(tiny, oracle_task, tmp_path, crop_mode):
    """The oracle's tool calls run through the real planner, decoder and (subagent mode) the
    real tiny model's sub-agents, or (frames mode) into the main context; its answers are the
    ground truth, so mcq/oe accuracy and tvg IoU are known exactly."""
    cfg = load_config("tiny_cpu", overrides=[*FAST, f"agent.crop_mode={crop_mode}"])
    samples = load_benchmark("synth", oracle_task)
    assert {s.question_type for s in samples} == {"mcq", "oe", "tvg"}
    records = load_oracle(oracle_task)
    engine = OracleMainEngine(
        HFEngine(tiny, seed=0), tiny.tokenizer, records, cfg.agent.think_prefix
    )
    runner = AgentRunner(engine, tiny, cfg)
    rollout, done = runner.rollout, []  # each rollout's result, as the evaluation got it
    runner.rollout = lambda *a, **kw: done.append(rollout(*a, **kw)) or done[-1]
    summary = run_eval(
        samples,
        runner,
        tmp_path,
        _settings(crop_mode=crop_mode),
        batch_size=4,
        show_progress=False,
    )
    rows = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [s.id for s in samples]
    assert summary["n"] == len(samples) and summary["n_errors"] == 0
    assert summary["n_unparseable"] == 0
    # mcq/oe answers are the ground truth; a tvg answer is the window the crops showed (the
    # oracle writes only times printed in its input), so it overlaps the truth.
    assert all(r["score"] == pytest.approx(1.0) for r in rows if "-tvg" not in r["id"]), [
        (r["id"], r["parsed"], r["answer"]) for r in rows if r["score"] < 0.999
    ]
    assert all(r["score"] > 0.2 for r in rows if "-tvg" in r["id"])
    with_tools = {sid for sid, rec in records.items() if len(rec["turns"]) == 3}
    assert with_tools and summary["tools"]["tool_call_rate"] == pytest.approx(
        len(with_tools) / len(rows)
    )
    assert all(
        r["calls"] >= 1 and r["calls_ok"] == r["calls"] for r in rows if r["id"] in with_tools
    )
    responses = [c["response"] for r in rows for t in r["trace"] for c in t["calls"]]
    if crop_mode == "frames":
        assert all(x.endswith("frames of this window are shown above.") for x in responses)
        assert done[-1].stats.sub_engine_calls == 0
    else:
        assert not any("frames of this window" in x for x in responses)
        assert done[-1].stats.sub_engine_calls >= 1
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["settings"]["crop_mode"] == crop_mode and saved["n"] == summary["n"]


def _cli(synth_dir, model, out, *extra):
    return [
        "--benchmark",
        "synth",
        "--data-root",
        str(synth_dir),
        "--model",
        str(model),
        "--frames",
        "4",
        "--out",
        str(out),
        "--no-progress",
        *extra,
        *FAST,
    ]


@pytest.mark.parametrize("crop_mode", ["subagent", "frames"])
def test_cli_tiny_model_hf_engine(assets, synth_dir, tmp_path, capsys, crop_mode):
    out = tmp_path / "out"
    assert (
        main(_cli(synth_dir, assets["model"], out, "--crop-mode", crop_mode, "--limit", "3")) == 0
    )
    printed = capsys.readouterr().out
    rows = load_results(out)
    assert len(rows) == 3
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n"] == 3 and summary["settings"]["crop_mode"] == crop_mode
    assert summary["settings"]["temperature"] == 0.0  # greedy by default
    assert "| synth |" in printed and f"results in {out}" in printed
    for r in rows.values():
        assert r["error"] is None and r["turns"] >= 1 and r["prediction"]


def test_cli_own_rows_as_jsonl(assets, synth_dir, tmp_path, capsys):
    """``--benchmark jsonl --data-root DIR``: one's own dataset folder as training reads it
    (train.jsonl, val.jsonl, videos beside them) is evaluated on its val.jsonl rows, under the
    name jsonl; without --data-root it is refused (it has no embedded default)."""
    own = tmp_path / "mydata"
    own.mkdir()
    for name in ("train.jsonl", "val.jsonl"):
        shutil.copy(Path(synth_dir) / name, own / name)
    (own / "videos").symlink_to(Path(synth_dir) / "videos")
    out = tmp_path / "out"
    args = _cli(own, assets["model"], out, "--limit", "2")
    assert args[:2] == ["--benchmark", "synth"]
    assert main(["--benchmark", "jsonl", *args[2:]]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n"] == 2 and summary["settings"]["benchmark"] == "jsonl"
    val = [json.loads(x)["id"] for x in (own / "val.jsonl").read_text().splitlines()]
    assert list(load_results(out)) == val[:2]
    assert "| jsonl |" in capsys.readouterr().out
    assert main(["--benchmark", "jsonl", "--model", str(assets["model"])]) == 2
    assert "--data-root is required for --benchmark jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    helped = " ".join(capsys.readouterr().out.split())  # argparse wraps its lines
    assert "jsonl: your own rows, --data-root DIR holding val.jsonl" in helped


def test_resume_after_kill_matches_uninterrupted_run(assets, oracle_task, tmp_path):
    """A subprocess killed (SIGKILL) after some samples, then rerun, gives the uninterrupted
    run's summary and does not redo the finished samples."""
    args = ["--batch-size", "1"]
    full = tmp_path / "full"
    assert main(_cli(oracle_task, assets["model"], full, *args)) == 0
    assert len(load_results(full)) == 6
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "paravt.eval", *_cli(oracle_task, assets["model"], killed, *args)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    results = killed / "results.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:
        if results.is_file() and len(results.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    assert p.poll() is None, "the run finished before it could be killed"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    n_before = len(load_results(killed))
    assert 2 <= n_before < 6
    first = {i: r for i, r in load_results(killed).items()}
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"{n_before} of 6 samples already done, {6 - n_before} to run" in rerun.stdout
    after = load_results(killed)
    for i, r in first.items():  # finished samples were not redone (same timings)
        assert after[i]["timings"] == r["timings"]
    a = json.loads((full / "summary.json").read_text())
    b = json.loads((killed / "summary.json").read_text())
    a.pop("settings"), b.pop("settings")
    assert a == b
    assert [json.loads(x)["id"] for x in results.read_text().splitlines()] == list(
        load_results(full)
    )


def test_changed_settings_are_refused(assets, synth_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(_cli(synth_dir, assets["model"], out, "--limit", "1")) == 0
    assert main(_cli(synth_dir, assets["model"], out, "--limit", "1", "--frames", "8")) == 2
    err = capsys.readouterr().err
    assert "frames: saved 4, now 8" in err and "another --out" in err


class _Boom(Engine):  # (the protocol's no-op sleep / close)
    def generate(self, requests):
        raise RuntimeError("device lost")

    def sync_weights(self, model):
        return None


def test_missing_video_and_engine_failure_become_counted_error_rows(tiny, synth_dir, tmp_path):
    cfg = load_config("tiny_cpu", overrides=FAST)
    samples = load_benchmark("synth", synth_dir)[:3]
    samples[0].video = str(tmp_path / "nope.mp4")
    summary = run_eval(
        samples, AgentRunner(_Boom(), tiny, cfg), tmp_path, _settings(), show_progress=False
    )
    rows = load_results(tmp_path)
    assert rows[samples[0].id]["error"].startswith("video not found: ")
    assert rows[samples[0].id]["error_kind"] == "missing"
    assert all(rows[s.id]["error_kind"] == "engine" for s in samples[1:])
    assert "device lost" in rows[samples[1].id]["error"]
    assert summary["n"] == 3 and summary["n_errors"] == 3
    # A rerun retries the engine failures and the missing video (still missing: one row).
    runner = AgentRunner(HFEngine(tiny, seed=0), tiny, cfg)
    summary = run_eval(samples, runner, tmp_path, _settings(), show_progress=False)
    rows = load_results(tmp_path)
    assert summary["n"] == 3 and summary["n_errors"] == 1
    assert rows[samples[1].id]["error"] is None and rows[samples[0].id]["error_kind"] == "missing"


def test_torchrun_two_ranks_split_and_merge(assets, oracle_task, tmp_path):
    """``torchrun --nproc-per-node 2``: each rank runs every other pending sample, rank 0
    merges one ``results.jsonl`` in dataset order; the predictions equal a 1-process run's."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    args = ["--batch-size", "1"]
    one, two = tmp_path / "one", tmp_path / "two"
    cmd = [sys.executable, "-m", "paravt.eval", *_cli(oracle_task, assets["model"], one, *args)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
        "-m", "paravt.eval", *_cli(oracle_task, assets["model"], two, *args),
    ]  # fmt: skip
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("| synth |") == 1  # rank 0 prints the table once
    assert not list(two.glob("results.rank*.jsonl"))  # parts merged away
    rows = [json.loads(x) for x in (two / "results.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (one / "results.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [r["id"] for r in ref] and len(rows) == 6
    assert [r["rank"] for r in rows] == [0, 1, 0, 1, 0, 1]
    assert [r["prediction"] for r in rows] == [r["prediction"] for r in ref]
    a, b = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    a.pop("settings"), b.pop("settings")
    assert a == b


def test_cli_errors_name_the_problem(tmp_path, capsys):
    assert main(["--benchmark", "synth", f"train.out_dir={tmp_path / 'none'}"]) == 2
    err = capsys.readouterr().err
    assert "model is untrained" in err and "make train" in err
    assert main(["--benchmark", "mmvu", "--model", str(tmp_path)]) == 2
    assert "no config.json (not an HF model" in capsys.readouterr().err
    mdl = tmp_path / "model"  # looks like an HF model directory: the other inputs are checked
    mdl.mkdir()
    (mdl / "config.json").write_text("{}")
    assert main(["--benchmark", "mmvu", "--model", str(mdl)]) == 2
    assert "--data-root is required for --benchmark mmvu" in capsys.readouterr().err
    assert main(["--benchmark", "lvbench", "--model", str(mdl), "--data-root", "/nope"]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "lvb").mkdir()
    args = ["--benchmark", "lvbench", "--model", str(mdl), "--data-root"]
    assert main([*args, str(tmp_path / "lvb")]) == 2
    assert "train-00000-of-00001.parquet" in capsys.readouterr().err  # names the missing file
    assert main([*args, str(tmp_path / "lvb"), "--frames", "0"]) == 2
    assert "--frames 0 must be >= 1" in capsys.readouterr().err


def test_a_run_checkpoint_is_evaluated_with_its_run_config(assets, synth_dir, tmp_path, capsys):
    from paravt.config import to_yaml

    run = tmp_path / "run"
    shutil.copytree(assets["model"], run / "checkpoints" / "step_000003")
    trained = load_config("tiny_cpu", overrides=["video.overview_max_pixels=2048"])
    (run / "config.yaml").write_text(to_yaml(trained))
    model = run / "checkpoints" / "step_000003"
    assert main(_cli(synth_dir, model, tmp_path / "out", "--limit", "1")) == 0
    out = capsys.readouterr().out
    assert f"config {run / 'config.yaml'}" in out and "overview <= 2048 px" in out
    # --config wins over the run's own file.
    other = tmp_path / "other.yaml"
    other.write_text("video:\n  overview_max_pixels: 1536\n")
    args = ["--limit", "1", "--config", str(other)]
    assert main(_cli(synth_dir, model, tmp_path / "out2", *args)) == 0
    assert "overview <= 1536 px" in capsys.readouterr().out


def test_result_files_survive_stale_failures_and_torn_lines(tmp_path):
    from paravt.eval.runner import _Appender

    done = {"id": "x", "score": 1.0, "error_kind": ""}
    failed = {"id": "x", "score": 0.0, "error_kind": "engine"}
    (tmp_path / "results.jsonl").write_text(json.dumps(done) + "\n")
    (tmp_path / "results.rank1.jsonl").write_text(json.dumps(failed) + "\n")
    assert load_results(tmp_path)["x"]["score"] == 1.0  # a stale failure never wins
    # A killed run's torn last line: the next row starts on its own line and is kept.
    (tmp_path / "results.jsonl").write_text(json.dumps(done) + "\n" + '{"id": "y", "sco')
    w = _Appender(tmp_path / "results.jsonl")
    w({"id": "z", "score": 1.0, "error_kind": ""})
    w.close()
    assert sorted(load_results(tmp_path)) == ["x", "z"]


def test_a_last_line_torn_inside_a_utf8_character_is_dropped_on_resume(tmp_path):
    """A kill mid-write can cut a ``results.jsonl`` line inside a multi-byte character (rows
    are written with ensure_ascii=False): the resume drops that torn line, as it drops a torn
    ASCII one, instead of failing with UnicodeDecodeError; the next row gets its own line."""
    from paravt.eval.runner import _Appender, merge_results
    from paravt.types import Sample

    done = {"id": "x", "question": "durée ≥ 5 s ?", "score": 1.0, "error_kind": ""}
    torn = json.dumps({"id": "y", "question": "été"}, ensure_ascii=False).encode()
    cut = torn[: torn.index("é".encode()) + 1]  # the first byte of a 2-byte character
    with pytest.raises(UnicodeDecodeError):
        cut.decode("utf-8")
    (tmp_path / "results.jsonl").write_bytes(
        (json.dumps(done, ensure_ascii=False) + "\n").encode() + cut
    )
    assert sorted(load_results(tmp_path)) == ["x"]
    w = _Appender(tmp_path / "results.jsonl")
    w({"id": "z", "score": 0.0, "error_kind": ""})
    w.close()
    assert sorted(load_results(tmp_path)) == ["x", "z"]
    samples = [Sample(id=i, video="v.mp4", question=done["question"], answer="A")
               for i in ("x", "z")]  # fmt: skip
    rows = merge_results(tmp_path, samples)
    assert [r["id"] for r in rows] == ["x", "z"] and rows[0]["question"] == done["question"]


class _FailsOn:
    """The real engine, except that any call holding ``bad``'s request raises."""

    def __init__(self, real, bad: str) -> None:
        self.real, self.bad, self.calls = real, bad, 0

    def generate(self, requests):
        self.calls += 1
        if any(f":{self.bad}:" in r.request_id for r in requests):
            raise RuntimeError("context too long")
        return self.real.generate(requests)

    def sync_weights(self, model):
        return None


def test_one_failing_sample_does_not_sink_its_batch(tiny, synth_dir, tmp_path):
    cfg = load_config("tiny_cpu", overrides=FAST)
    samples = load_benchmark("synth", synth_dir)[:3]
    engine = _FailsOn(HFEngine(tiny, seed=0), samples[1].id)
    summary = run_eval(
        samples, AgentRunner(engine, tiny, cfg), tmp_path, _settings(), show_progress=False
    )
    rows = load_results(tmp_path)
    assert summary["n_errors"] == 1 and rows[samples[1].id]["error_kind"] == "engine"
    assert "context too long" in rows[samples[1].id]["error"]
    assert rows[samples[0].id]["error"] is None and rows[samples[2].id]["error"] is None


class _NoModel:
    """``load_model_from_config`` replaced: a run that reaches the model load fails the test
    (refusals must come before anything heavy loads)."""

    def __call__(self, *a, **k):
        raise AssertionError("the model was loaded: the run should have been refused before")


def test_resume_refuses_any_other_resolved_setting(
    assets, synth_dir, tmp_path, capsys, monkeypatch
):
    """run.json fingerprints the whole resolved config, the preset and the weights' files: a
    resume with another prompt text, crop size, dtype, preset or checkpoint is refused before
    the model loads, naming each key (saved -> now) and the fix."""
    model = tmp_path / "model"
    shutil.copytree(assets["model"], model)  # a copy whose files this test may touch
    out = tmp_path / "out"
    assert main(_cli(synth_dir, model, out, "--limit", "1")) == 0
    capsys.readouterr()
    saved = json.loads((out / "run.json").read_text())
    assert saved["preset"] == "tiny_cpu" and saved["weights"]
    assert saved["config"]["agent"]["think_prefix"] == "<think>\n"
    assert saved["config"]["model"]["dtype"] == "float32"
    import paravt.models

    monkeypatch.setattr(paravt.models, "load_model_from_config", _NoModel())
    changed = {
        "agent.force_answer_text=Now.": "agent.force_answer_text: saved '\\nI must answer now.",
        "agent.think_prefix=<think>": "agent.think_prefix: saved '<think>\\n', now '<think>'",
        "agent.sub_agent_include_question=false": (
            "agent.sub_agent_include_question: saved True, now False"
        ),
        "video.crop_min_frames=3": "video.crop_min_frames: saved 2, now 3",
        "agent.allow_unclosed_final_call=true": (
            "agent.allow_unclosed_final_call: saved False, now True"
        ),
        "model.dtype=bfloat16": "model.dtype: saved 'float32', now 'bfloat16'",
    }
    for item, said in changed.items():
        assert main(_cli(synth_dir, model, out, "--limit", "1", item)) == 2, item
        err = capsys.readouterr().err
        assert said in err, err
        assert "another --out" in err and "same settings" in err
    assert main(_cli(synth_dir, model, out, "--limit", "1", "--preset", "tiny_cpu_vanilla")) == 2
    err = capsys.readouterr().err
    assert "preset: saved 'tiny_cpu', now 'tiny_cpu_vanilla'" in err
    # Other weights in the same folder (a checkpoint rewritten in place): refused too.
    st = (model / "model.safetensors").stat()
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert main(_cli(synth_dir, model, out, "--limit", "1")) == 2
    assert "weights: saved " in capsys.readouterr().err
    assert json.loads((out / "run.json").read_text()) == saved  # refusals write nothing


def test_restored_video_is_redone_on_resume(tiny, synth_dir, tmp_path):
    """A missing or unreadable video's error row is retried by a resume: once the file is
    back, the sample is evaluated and the summary counts it once."""
    cfg = load_config("tiny_cpu", overrides=FAST)
    samples = load_benchmark("synth", synth_dir)[:3]
    real = [s.video for s in samples]
    samples[0].video = str(tmp_path / "gone.mp4")  # missing
    samples[1].video = str(tmp_path / "torn.mp4")  # unreadable
    (tmp_path / "torn.mp4").write_bytes(b"\x00not a video" * 64)
    out = tmp_path / "out"
    runner = AgentRunner(HFEngine(tiny, seed=0), tiny, cfg)
    summary = run_eval(samples, runner, out, _settings(), show_progress=False)
    rows = load_results(out)
    assert rows[samples[0].id]["error_kind"] == "missing"
    assert rows[samples[1].id]["error_kind"] == "video"
    assert summary["n"] == 3 and summary["n_errors"] == 2
    shutil.copy(real[0], tmp_path / "gone.mp4")
    shutil.copy(real[1], tmp_path / "torn.mp4")
    kept = rows[samples[2].id]["timings"]
    runner = AgentRunner(HFEngine(tiny, seed=0), tiny, cfg)
    summary = run_eval(samples, runner, out, _settings(), show_progress=False)
    rows = load_results(out)
    assert summary["n"] == 3 and summary["n_errors"] == 0
    assert rows[samples[0].id]["error"] is None and rows[samples[1].id]["error"] is None
    assert rows[samples[2].id]["timings"] == kept  # the finished sample was not redone
    ids = [json.loads(x)["id"] for x in (out / "results.jsonl").read_text().splitlines()]
    assert ids == [s.id for s in samples]  # one row per sample after the merge


def test_greedy_with_top_p_is_refused(assets, synth_dir, tmp_path, capsys, monkeypatch):
    """top_p < 1 with greedy decoding (the eval default) is a contradiction: refused before
    the model loads. A checkpoint trained with top_p < 1 is still evaluated greedy."""
    import paravt.models

    real = paravt.models.load_model_from_config
    monkeypatch.setattr(paravt.models, "load_model_from_config", _NoModel())
    out = tmp_path / "out"
    for engine in ("hf", "vllm"):
        args = ["--limit", "1", "--engine", engine, "rollout.top_p=0.5"]
        assert main(_cli(synth_dir, assets["model"], out, *args)) == 2, engine
        err = capsys.readouterr().err
        assert "rollout.top_p=0.5" in err and "rollout.temperature=0" in err, err
        assert "rollout.top_p=1" in err  # the fix
    # vLLM refuses every greedy row with top_p < 1, the sub-agents' too.
    args = ["--engine", "vllm", "rollout.top_p=0.5", "rollout.temperature=0.7"]
    assert main(_cli(synth_dir, assets["model"], out, *args)) == 2
    assert "rollout.sub_temperature=0" in capsys.readouterr().err
    assert not out.exists()
    monkeypatch.setattr(paravt.models, "load_model_from_config", real)
    trained = tmp_path / "top_p.yaml"
    trained.write_text("rollout:\n  top_p: 0.9\n")
    args = ["--limit", "1", "--config", str(trained)]
    assert main(_cli(synth_dir, assets["model"], out, *args)) == 0
    assert json.loads((out / "run.json").read_text())["top_p"] == 1.0


def test_frames_over_the_context_are_refused_before_any_sample(
    assets, synth_dir, tmp_path, capsys, monkeypatch
):
    import paravt.models

    monkeypatch.setattr(paravt.models, "load_model_from_config", _NoModel())
    out = tmp_path / "out"
    assert main(_cli(synth_dir, assets["model"], out, "--frames", "100000")) == 2
    err = capsys.readouterr().err
    assert "--frames 100000" in err and "K=100000" in err
    assert "max_position_embeddings=8192" in err and "lower --frames" in err
    assert not out.exists()


def test_an_eval_of_only_engine_errors_exits_nonzero(
    assets, synth_dir, tmp_path, capsys, monkeypatch
):
    import paravt.engines

    monkeypatch.setattr(paravt.engines, "make_engine", lambda cfg, bundle: _Boom())
    out = tmp_path / "out"
    assert main(_cli(synth_dir, assets["model"], out, "--limit", "2")) == 1
    err = capsys.readouterr().err
    assert "all 2 samples failed" in err and "engine: 2" in err and "device lost" in err
    assert "rerun the same command" in err
    assert json.loads((out / "summary.json").read_text())["n_errors"] == 2  # still written
