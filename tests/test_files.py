"""``paravt.files``: what paravt writes into folders it did not create (a run folder, an
evaluation's ``--out``) never goes through a planted symlink, and what it reads is split into
JSONL rows one way. The viewer's pages have their test in ``test_view.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from eval_stubs import NoEngine, eval_settings, missing_samples

from paravt.config import load_config
from paravt.eval.runner import run_eval
from paravt.files import NotRegularFile
from paravt.metrics import MetricsLogger
from paravt.runfolder import record_run


def _victim(tmp_path: Path) -> Path:
    v = tmp_path / "victim"
    v.write_text("precious\n")
    return v


def test_run_records_replace_a_planted_symlink(tmp_path) -> None:
    """run.json of a training run and run.json / summary.json / results.jsonl of an
    evaluation are written through a temporary and a rename: a link planted at one (or at the
    old fixed temporary name) is replaced, the file it points to untouched."""
    victim = _victim(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    for name in ("run.json", ".run.json.tmp"):
        (run / name).symlink_to(victim)
    cfg = load_config("tiny_cpu", overrides=[f"train.out_dir={run}"])
    record_run(cfg)
    assert victim.read_text() == "precious\n" and not (run / "run.json").is_symlink()
    assert json.loads((run / "run.json").read_text())["config"]["train"]["out_dir"] == str(run)

    out = tmp_path / "eval"
    out.mkdir()
    for name in ("run.json", "summary.json", "results.jsonl.tmp"):
        (out / name).symlink_to(victim)
    summary = run_eval(
        missing_samples(tmp_path), NoEngine(), out, eval_settings(), show_progress=False
    )
    assert summary["n"] == 2 and summary["n_errors"] == 2
    assert victim.read_text() == "precious\n"
    assert json.loads((out / "run.json").read_text())["benchmark"] == "synth"
    assert json.loads((out / "summary.json").read_text())["n"] == 2
    assert not any((out / n).is_symlink() for n in ("run.json", "summary.json"))


def test_appended_files_refuse_a_symlink_or_fifo(tmp_path) -> None:
    """metrics.jsonl and an evaluation's results.jsonl are appended a line at a time: a link
    (or a FIFO) in their place is refused with the path, what it is and the fix."""
    import os

    victim = _victim(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(victim)
    logger = MetricsLogger(run, tensorboard=False)
    with pytest.raises(NotRegularFile, match="metrics.jsonl is a symbolic link") as e:
        logger.log(1, {"loss": 0.5})
    assert "remove it" in str(e.value)
    assert victim.read_text() == "precious\n"

    out = tmp_path / "eval"
    out.mkdir()
    os.mkfifo(out / "results.jsonl")
    with pytest.raises(NotRegularFile, match=r"results.jsonl is a FIFO \(named pipe\)"):
        run_eval(missing_samples(tmp_path), NoEngine(), out, eval_settings(), show_progress=False)


# ---------------------------------------------------------------------------- JSONL readers
# Legal inside a JSON string, and line breaks to str.splitlines(): each reader of a JSONL must
# keep a row holding one whole.
SEPARATORS = "\u2028\u2029\u0085"


def _with_separators(rows: list[dict], key: str) -> tuple[str, list[dict]]:
    rows = [dict(r) for r in rows]
    rows[0][key] = f"{rows[0][key]}{SEPARATORS}(continued)"
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), rows


def test_every_jsonl_reader_keeps_a_row_with_unicode_line_separators(synth_dir, tmp_path):
    """load_benchmark("synth"), the dataset reader, read_sft_records, the oracle engine's
    load_oracle and read_metrics split on "\\n" only (paravt.files.jsonl_lines)."""
    from paravt.data import load_samples
    from paravt.engines.oracle import load_oracle
    from paravt.eval.benchmarks import load_benchmark
    from paravt.files import read_jsonl
    from paravt.metrics import read_metrics
    from paravt.sft import read_sft_records

    d = tmp_path / "task"
    d.mkdir()
    (d / "videos").symlink_to(synth_dir / "videos")
    val = [r for _, r in read_jsonl(synth_dir / "val.jsonl")]
    text, val = _with_separators(val, "question")
    (d / "val.jsonl").write_text(text, encoding="utf-8")
    assert SEPARATORS in (d / "val.jsonl").read_text(encoding="utf-8")  # raw, not escaped
    bench = load_benchmark("synth", d)
    assert len(bench) == len(val) and bench[0].question.endswith(f"{SEPARATORS}(continued)")
    assert [s.question for s in load_samples(d, split="val")] == [r["question"] for r in val]

    sft = [r for _, r in read_jsonl(synth_dir / "sft.jsonl")][:3]
    first = sft[0]["turns"][0]
    first["content"] = f"{first['content']}{SEPARATORS}"
    (d / "sft.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in sft))
    got = read_sft_records(d / "sft.jsonl")
    assert len(got) == 3 and got[0].turns[0].content == first["content"]
    assert load_oracle(d)[sft[0]["sample_id"]]["turns"][0]["content"] == first["content"]

    (d / "m.jsonl").write_text(text, encoding="utf-8")
    assert read_metrics(d / "m.jsonl") == val


def test_a_bad_jsonl_data_line_is_named(tmp_path) -> None:
    from paravt.files import JsonlError, read_jsonl

    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"a": 1}\n\n[1, 2]\n')
    with pytest.raises(JsonlError, match=r"d\.jsonl:3: expected a JSON object, got list"):
        read_jsonl(f)
    f.write_bytes(b'{"a": 1}\n{"a": \xff}\n')
    with pytest.raises(JsonlError, match=r"d\.jsonl:2: not UTF-8 text"):
        read_jsonl(f)
    f.write_bytes(b'{"a": 1}\n{"a": \n')
    with pytest.raises(JsonlError, match=r"d\.jsonl:2: invalid JSON \(Expecting value"):
        read_jsonl(f)
