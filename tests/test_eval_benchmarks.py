"""Benchmark adapters (``paravt.eval.benchmarks``) on fixtures in each benchmark's on-disk format.

The fixtures (``tests/eval_fixtures.py``) hold hand-written expected samples; these tests check
the adapters against them, then break one field at a time and check the error names it.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from eval_fixtures import expected_samples, write_all, write_benchmark, write_longvideobench_json

from paravt.eval.benchmarks import BENCHMARKS, BenchmarkFormatError, load_benchmark, parse_srt
from paravt.types import Sample

_FIELDS = ("id", "video", "question", "options", "answer", "question_type")


def _check(samples: list[Sample], expected: list[dict], name: str) -> None:
    assert [s.id for s in samples] == [e["id"] for e in expected]
    for s, e in zip(samples, expected):
        for k in (*_FIELDS, "event_start", "event_end"):
            assert getattr(s, k) == e[k], (s.id, k)
        assert s.extra["benchmark"] == name
        assert s.extra["categories"] == e["categories"], s.id
        assert s.extra["video_missing"] is e["video_missing"], s.id
        assert os.path.isabs(s.video) and os.path.isfile(s.video) is not e["video_missing"]
        for k, v in e["extra"].items():
            assert s.extra[k] == v, (s.id, k)
        # Exactly one letter prefix per option, lettered in order.
        for j, opt in enumerate(s.options):
            assert re.match(rf"{'ABCDEFGH'[j]}\. (?!\(?[A-Z][.:)] )\S", opt), opt
        if s.question_type == "mcq":
            assert s.answer in "ABCDEFGH"[: len(s.options)] and len(s.answer) == 1


@pytest.mark.parametrize("name", BENCHMARKS)
def test_adapter_matches_fixture(name: str, tmp_path: Path) -> None:
    rows = write_benchmark(name, tmp_path)
    samples = load_benchmark(name, tmp_path)
    assert len(samples) == len(rows)
    _check(samples, expected_samples(name, tmp_path), name)
    assert sum(s.extra["video_missing"] for s in samples) == 1  # the deliberately absent one


def test_fixture_specifics(tmp_path: Path) -> None:
    """The quirks the conventions exist for, spelled out on the fixture rows."""
    dirs = write_all(tmp_path)
    vm = load_benchmark("videomme_sub", dirs["videomme_sub"])
    assert vm[0].options[0] == "A. Apples."  # the file's own "A. " prefix is not doubled
    assert (
        vm[0].extra["subtitles"] == "when we are about to do something\nnew\nthe tree\nis decorated"
    )
    assert vm[2].extra["subtitles"] == "" and vm[2].video.endswith("data/Xy7-kPq_2aB.mkv")
    assert "subtitles" not in load_benchmark("videomme", dirs["videomme"])[0].extra
    lvb = load_benchmark("longvideobench", dirs["longvideobench"])
    assert [len(s.options) for s in lvb] == [4, 5, 4]  # option4 "N/A" dropped
    assert [s.answer for s in lvb] == ["B", "E", "A"]  # chr(65 + correct_choice)
    assert lvb[0].extra["categories"]["duration_group"] == "600"
    lvbench = load_benchmark("lvbench", dirs["lvbench"])
    assert lvbench[1].extra["categories"]["question_type"] == [
        "key information retrieval",
        "reasoning",
    ]
    assert lvbench[0].extra["raw_question"].endswith("\n(D) Black")
    mlvu = load_benchmark("mlvu", dirs["mlvu"])
    assert [(s.extra["raw_answer"], s.answer) for s in mlvu] == [
        ("A", "A"),
        ("3", "C"),
        ("D", "D"),
        ("2-1-3", "B"),
    ]
    assert [s.id for s in mlvu] == ["needle-Q0", "count-Q0", "plotQA-Q1", "order-Q0"]
    mmvu = load_benchmark("mmvu", dirs["mmvu"])
    assert (mmvu[0].question_type, mmvu[0].options, mmvu[0].answer) == ("oe", [], "Dolly Zoom")
    assert mmvu[2].extra["categories"]["subject"] == "Computer Science"  # from metadata
    cha = load_benchmark("charades_sta", dirs["charades_sta"])
    assert (cha[0].event_start, cha[0].event_end) == (1.2998046875, 4.69921875)  # float16
    assert cha[0].answer == "1.2998046875-4.69921875"
    assert cha[0].extra["key"] == "3MSZA.mp4>>>person turn a light on.>>>[1.2998046875, 4.69921875]"


def test_limit_keeps_the_first_rows(tmp_path: Path) -> None:
    dirs = write_all(tmp_path, video=False)
    for name in BENCHMARKS:
        full = [s.id for s in load_benchmark(name, dirs[name])]
        assert [s.id for s in load_benchmark(name, dirs[name], limit=2)] == full[:2], name
        assert load_benchmark(name, dirs[name], limit=0) == []
        assert len(load_benchmark(name, dirs[name], limit=100)) == len(full)
    with pytest.raises(ValueError, match="limit=-1"):
        load_benchmark("mmvu", dirs["mmvu"], limit=-1)


def test_missing_videos_are_kept_with_absolute_paths(tmp_path: Path, monkeypatch) -> None:
    write_benchmark("lvbench", tmp_path / "lvb", video=False)
    monkeypatch.chdir(tmp_path)
    samples = load_benchmark("lvbench", "lvb")  # a relative data root
    assert len(samples) == 4 and all(s.extra["video_missing"] for s in samples)
    assert samples[2].video == str(tmp_path / "lvb" / "ZyXwVuTsRqP.mp4")  # first candidate


def test_longvideobench_json_form(tmp_path: Path) -> None:
    write_longvideobench_json(tmp_path)
    assert not (tmp_path / "validation-00000-of-00001.parquet").exists()
    samples = load_benchmark("longvideobench", tmp_path)
    _check(samples, expected_samples("longvideobench", tmp_path), "longvideobench")


def test_unknown_benchmark_lists_the_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown benchmark 'videomme_w_subtitle'") as e:
        load_benchmark("videomme_w_subtitle", tmp_path)
    assert all(n in str(e.value) for n in BENCHMARKS)
    assert not isinstance(e.value, BenchmarkFormatError)


def test_missing_annotation_file_names_the_expected_path(tmp_path: Path) -> None:
    with pytest.raises(BenchmarkFormatError, match=r"data/test-00000-of-00001\.parquet: no such"):
        load_benchmark("charades_sta", tmp_path)


# ----------------------------------------------------------------------- accepted variants
def _rewrite(path: Path, edit: Callable[[list[dict]], None], schema: pa.Schema | None = None):
    rows = pq.read_table(path).to_pylist()
    edit(rows)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def test_lvbench_accepts_str_uid_and_str_question_type(tmp_path: Path) -> None:
    write_benchmark("lvbench", tmp_path, video=False)

    def edit(rows: list[dict]) -> None:
        for r in rows:
            r["uid"] = f"u{r['uid']}"
            r["question_type"] = r["question_type"][0]
        del rows[0]["key"]  # a row's optional column can be absent: keys are per-row here

    _rewrite(tmp_path / "data/train-00000-of-00001.parquet", edit)
    samples = load_benchmark("lvbench", tmp_path)
    assert [s.id for s in samples] == ["u1", "u2", "u3", "u4"]
    assert samples[1].extra["categories"]["question_type"] == ["key information retrieval"]
    assert samples[0].extra["raw_id"] == "u1"


def test_mlvu_falls_back_to_row_ids_when_question_ids_repeat(tmp_path: Path) -> None:
    write_benchmark("mlvu", tmp_path, video=False)

    def edit(rows: list[dict]) -> None:
        rows[2]["task_type"], rows[2]["question_id"] = "count", "Q0"  # repeats row 1's pair

    _rewrite(tmp_path / "mlvu/test-00000-of-00001.parquet", edit)
    ids = [s.id for s in load_benchmark("mlvu", tmp_path)]
    assert ids == ["needle-0", "count-1", "count-2", "order-3"]


# ---------------------------------------------------------------------------- format errors
def _parquet(tmp_path: Path, name: str) -> Path:
    write_benchmark(name, tmp_path, video=False)
    rel = {
        "videomme": "videomme/test-00000-of-00001.parquet",
        "longvideobench": "validation-00000-of-00001.parquet",
        "lvbench": "data/train-00000-of-00001.parquet",
        "mlvu": "mlvu/test-00000-of-00001.parquet",
        "charades_sta": "data/test-00000-of-00001.parquet",
    }[name]
    return tmp_path / rel


def _raises(name: str, root: Path, *patterns: str) -> str:
    with pytest.raises(BenchmarkFormatError) as e:
        load_benchmark(name, root)
    msg = str(e.value)
    for p in patterns:
        assert re.search(p, msg), (p, msg)
    return msg


def test_missing_column(tmp_path: Path) -> None:
    p = _parquet(tmp_path, "videomme")
    pq.write_table(pq.read_table(p).drop_columns(["answer"]), p)
    _raises("videomme", tmp_path, r"test-00000-of-00001\.parquet", r"no column\(s\) \['answer'\]")


def test_wrong_type_names_row_field_found_and_expected(tmp_path: Path) -> None:
    p = _parquet(tmp_path, "longvideobench")
    _rewrite(p, lambda rows: [r.update(correct_choice=str(r["correct_choice"])) for r in rows])
    _raises(
        "longvideobench",
        tmp_path,
        r"validation-00000-of-00001\.parquet row 0 \(id '86CxyhFV9MI_0'\)",
        r"field 'correct_choice' is str '1', expected an integer",
    )
    p = _parquet(tmp_path, "videomme")
    _rewrite(p, lambda rows: [r.update(options="\n".join(r["options"])) for r in rows])
    _raises("videomme", tmp_path, r"row 0 \(id '001-1'\): field 'options' is str", "list of str")


def test_lvbench_question_type_of_another_type(tmp_path: Path) -> None:
    p = _parquet(tmp_path, "lvbench")
    _rewrite(p, lambda rows: [r.update(question_type=7) for r in rows])
    _raises("lvbench", tmp_path, r"field 'question_type' is int 7, expected a string or a list")


def test_mmvu_url_without_main(tmp_path: Path) -> None:
    write_benchmark("mmvu", tmp_path, video=False)
    f = tmp_path / "validation.json"
    rows = json.loads(f.read_text())
    rows[1]["video"] = "https://example.org/mmvu/videos/Chemistry/0.mp4"
    f.write_text(json.dumps(rows))
    _raises(
        "mmvu", tmp_path, r"validation\.json row 1 \(id 'validation_1'\)", "field 'video'", "/main/"
    )


def test_mmvu_subject_must_be_in_metadata(tmp_path: Path) -> None:
    write_benchmark("mmvu", tmp_path, video=False)
    f = tmp_path / "validation.json"
    rows = json.loads(f.read_text())
    rows[0]["subject"] = rows[0]["metadata"].pop("subject")  # ParaVT's reading of the row
    f.write_text(json.dumps(rows))
    _raises("mmvu", tmp_path, r"row 0 .*field 'metadata.subject' is null")


def test_lvbench_question_without_embedded_options(tmp_path: Path) -> None:
    p = _parquet(tmp_path, "lvbench")

    def edit(rows: list[dict]) -> None:
        rows[2]["question"] = "What is the video mainly about? (A) Cooking (B) Wild birds"

    _rewrite(p, edit, pq.read_table(p).schema)
    _raises("lvbench", tmp_path, r"row 2 \(id '3'\): field 'question' has no options embedded")


def test_mlvu_answer_that_matches_nothing(tmp_path: Path) -> None:
    p = _parquet(tmp_path, "mlvu")
    _rewrite(p, lambda rows: rows[1].update(answer="five"), pq.read_table(p).schema)
    _raises("mlvu", tmp_path, r"row 1 \(id 'count-Q0'\): field 'answer' is 'five', neither")


def test_lvb_correct_choice_out_of_range_and_option_gap(tmp_path: Path) -> None:
    p = _parquet(tmp_path, "longvideobench")
    schema = pq.read_table(p).schema
    _rewrite(p, lambda rows: rows[0].update(correct_choice=4), schema)  # option4 is "N/A"
    _raises("longvideobench", tmp_path, r"row 0 .*field 'correct_choice' is 4, outside the 4")
    p = _parquet(tmp_path, "longvideobench")
    _rewrite(p, lambda rows: rows[1].update(option2="N/A"), schema)
    _raises("longvideobench", tmp_path, r"row 1 .*field 'option3' is an option after .*option2")


def test_charades_reversed_window(tmp_path: Path) -> None:
    p = _parquet(tmp_path, "charades_sta")
    t = pq.read_table(p)
    ts = pa.array([[2.0, 1.0], [0.0, 2.5], [3.0, 4.0]], type=pa.list_(pa.float32()))
    pq.write_table(t.set_column(2, "timestamp", ts), p)
    _raises("charades_sta", tmp_path, r"row 0 \(id '3MSZA#0'\): field 'timestamp' is \[2.0, 1.0\]")


@pytest.mark.parametrize(
    ("name", "field"),
    [("videomme", "question_id"), ("lvbench", "uid"), ("longvideobench", "id")],
)
def test_duplicate_ids_name_both_rows(tmp_path: Path, name: str, field: str) -> None:
    p = _parquet(tmp_path, name)
    _rewrite(p, lambda rows: rows[2].update({field: rows[0][field]}), pq.read_table(p).schema)
    _raises(name, tmp_path, rf"row 2 .*field '{field}' repeats id .* of row 0")


def test_mmvu_and_synth_duplicate_ids(tmp_path: Path) -> None:
    write_benchmark("mmvu", tmp_path / "m", video=False)
    f = tmp_path / "m/validation.json"
    rows = json.loads(f.read_text())
    rows[2]["id"] = "validation_0"
    f.write_text(json.dumps(rows))
    _raises("mmvu", tmp_path / "m", r"row 2 \(id 'validation_0'\): field 'id' repeats .* row 0")
    rows = write_benchmark("synth", tmp_path / "s", video=False)
    rows[3]["id"] = rows[1]["id"]
    (tmp_path / "s/val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _raises("synth", tmp_path / "s", r"val\.jsonl:4: field 'id' repeats id .*-oe' of line 2")


@pytest.mark.parametrize(
    "video",
    [
        "/etc/passwd",
        "../outside.mp4",
        "videos/../../outside.mp4",
        "file:///etc/passwd",
        "file://../outside.mp4",
        "~/outside.mp4",
    ],
)
def test_synth_video_paths_stay_under_the_data_root(tmp_path: Path, video: str) -> None:
    """The synthetic adapter follows the other adapters' path rule: a row's video is a file
    name relative to the data root; an absolute path, a '..' part, '~' or a 'file://' URL
    (which the dataset reader would expand) is a format error, and the file is never opened."""
    (tmp_path / "outside.mp4").write_bytes(b"not for the benchmark")
    rows = write_benchmark("synth", tmp_path / "s", video=False)
    rows[1]["video"] = video
    (tmp_path / "s/val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _raises(
        "synth",
        tmp_path / "s",
        r"val\.jsonl line 2 \(id 'synth-s0-vid_0000-oe'\): field 'video' is "
        + re.escape(repr(video))
        + ", expected a file name relative to the data root",
    )


# ------------------------------------------------------------------------------------- SRT
@pytest.mark.parametrize(
    ("text", "cues"),
    [
        pytest.param(
            '1\n00:00:01,240 --> 00:00:06,879\n<font color="white">when we</font>\n\n'
            "2\n00:00:04,160 --> 00:00:10,519\nnew\n",
            [(1.24, 6.879, "when we"), (4.16, 10.519, "new")],
            id="font-tags",
        ),
        pytest.param(
            "\ufeff1\r\n00:01:02,500 --> 01:00:00,000\r\nline one\r\n<i>line</i> two\r\n\r\n",
            [(62.5, 3600.0, "line one\nline two")],
            id="bom-crlf-multiline",
        ),
        pytest.param(
            "1\n00:00:00,000 --> 00:00:01,000\nno trailing newline",
            [(0.0, 1.0, "no trailing newline")],
            id="no-trailing-blank",
        ),
        pytest.param(
            "1\n00:00:00,000 --> 00:00:01,000\n<font></font>\n  \n\n\n"
            "2\n00:00:02.5 --> 00:00:03.25 X1:10\n  spaced  \n\n3\n",
            [(2.5, 3.25, "spaced")],
            id="empty-cue-dot-ms-stray-index",
        ),
        pytest.param("", [], id="empty"),
    ],
)
def test_parse_srt(text: str, cues: list[tuple[float, float, str]]) -> None:
    assert parse_srt(text) == cues


def test_parse_srt_bad_time_and_subtitle_file_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"block 1: timing line '1 --> 2'"):
        parse_srt("1\n1 --> 2\ntext\n")
    write_benchmark("videomme", tmp_path, video=False)
    (tmp_path / "subtitle/Xy7-kPq_2aB.srt").write_text("1\nsoon --> later\nhi\n")
    _raises("videomme_sub", tmp_path, r"subtitle/Xy7-kPq_2aB\.srt: SRT block 1")
    assert load_benchmark("videomme", tmp_path)[2].id == "002-1"  # no subtitles read


@pytest.mark.parametrize("name", ["longvideobench", "mlvu"])
@pytest.mark.parametrize("bad", [-60.0, math.nan, math.inf, 0.0])
def test_a_row_duration_that_is_no_length_is_refused(tmp_path: Path, name: str, bad: float) -> None:
    # Issue 66 item 5c: on main a duration of -60 or NaN went into the sample as it was.
    p = _parquet(tmp_path, name)
    _rewrite(p, lambda rows: rows[1].update(duration=bad))
    _raises(name, tmp_path, r"row 1 \(id '[^']+'\): field 'duration' is .*not a video's length")
