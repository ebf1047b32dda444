"""Dataset readers: synthetic JSONL, ParaVT parquet, missing videos, malformed rows."""

from __future__ import annotations

import json
import math
import os
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from paravt.data import DatasetError, load_samples, read_samples
from paravt.data.readers import DatasetReport


def test_loads_synthetic_jsonl_from_a_directory(synth_dir) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing missing: no warning
        train = load_samples(synth_dir)
        val = load_samples(synth_dir, split="val")
    assert len(train) == 6 and len(val) == 3
    raw = [json.loads(x) for x in (synth_dir / "train.jsonl").read_text().splitlines()]
    for s, r in zip(train, raw):
        assert s.id == r["id"] and s.answer == r["answer"] and s.question == r["question"]
        assert s.video == str(synth_dir / r["video"]) and os.path.isfile(s.video)
        assert s.question_type == r["question_type"]
        assert (s.event_start, s.event_end) == (r["event_start"], r["event_end"])
        assert s.options == r.get("options", [])
    assert {s.question_type for s in train} == {"mcq", "oe", "tvg"}
    assert [s.id for s in load_samples(synth_dir / "train.jsonl", max_samples=2)] == [
        r["id"] for r in raw[:2]
    ]


def test_missing_videos_warn_once_and_are_skipped(synth_dir, tmp_path) -> None:
    rows = [json.loads(x) for x in (synth_dir / "train.jsonl").read_text().splitlines()]
    rows[1]["video"] = "videos/gone_1.mp4"
    rows[4]["video"] = "videos/gone_2.mp4"
    f = tmp_path / "train.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(UserWarning) as rec:
        got = load_samples(f, video_root=str(synth_dir))
    assert len(rec) == 1
    msg = str(rec[0].message)
    assert "skipped 2 row(s)" in msg and "gone_1.mp4" in msg and "video_root" in msg
    assert [s.id for s in got] == [r["id"] for i, r in enumerate(rows) if i not in (1, 4)]
    _, rep = read_samples(f, video_root=str(synth_dir))
    assert [os.path.basename(m) for m in rep.missing_videos] == ["gone_1.mp4", "gone_2.mp4"]
    assert (rep.n_missing, rep.rows, rep.file) == (2, 6, str(f))


def test_malformed_jsonl_names_file_line_and_key(tmp_path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text('{"video": "a.mp4", "question": "q", "answer": "A"}\n{"video": "b.mp4"}\n')
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: missing required key 'question'"):
        load_samples(f)
    f.write_text('{"video": "a.mp4", "question": "q", "answer": "A", "question_type": "xx"}\n')
    with pytest.raises(DatasetError, match=r"d\.jsonl:1: question_type 'xx'"):
        load_samples(f)
    f.write_text("{not json\n")
    with pytest.raises(DatasetError, match=r"d\.jsonl:1: invalid JSON"):
        load_samples(f)
    with pytest.raises(DatasetError, match="has no val.jsonl"):
        load_samples(tmp_path, split="val")


def _paravt_parquet(path, video_abs: str, video_rel: str) -> None:
    def prompt(q: str) -> list[dict]:
        return [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"<video>\n{q}"},
        ]

    rows = {
        "prompt": [prompt("Which colour? A. red B. blue"), prompt("When?"), prompt("What?")],
        "videos": [
            [{"video": "file://" + video_abs}],
            [{"video": video_rel}],
            [{"video": "missing/x.mp4"}],
        ],
        "extra_info": [
            json.dumps({"answer": "B", "question_type": "mcq", "index": 7}),
            json.dumps({"answer": [12.5, 16.0], "question_type": "tvg"}),
            json.dumps({"answer": "a cat", "question_type": "open_ended"}),
        ],
    }
    pq.write_table(pa.table(rows), str(path))


def test_paravt_parquet_rows(synth_dir, tmp_path) -> None:
    vid = str(synth_dir / "videos" / "vid_0000.mp4")
    f = tmp_path / "paravt_rl_train.parquet"
    _paravt_parquet(f, vid, "videos/vid_0001.mp4")
    with pytest.warns(UserWarning) as rec:
        got = load_samples(tmp_path, video_root=str(synth_dir))  # directory: *train*.parquet
    msgs = sorted(str(w.message) for w in rec)
    assert len(msgs) == 2 and "2 of 3 row(s) have no id" in msgs[0] and "skipped 1 row" in msgs[1]
    assert len(got) == 2
    mcq, tvg = got
    assert mcq.id == "7" and mcq.video == vid and mcq.answer == "B"
    assert mcq.question_type == "mcq" and mcq.question == "Which colour? A. red B. blue"
    assert mcq.extra["system_prompt"] == "You are a helpful assistant."
    assert tvg.video == str(synth_dir / "videos" / "vid_0001.mp4")
    assert tvg.question_type == "tvg" and tvg.answer == "12.5-16.0"
    assert (tvg.event_start, tvg.event_end) == (12.5, 16.0)
    assert tvg.id == "paravt_rl_train-1"
    # Unknown question types are open-ended, as in the reference reward; raw type kept.
    samples, rep = read_samples(f, video_root=str(synth_dir))
    assert rep.n_missing == 1 and rep.missing_videos[0].endswith("missing/x.mp4")
    assert rep.synthesized_ids == ["paravt_rl_train-1", "paravt_rl_train-2"]


def test_parquet_without_required_columns_is_a_clear_error(tmp_path) -> None:
    f = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["x"], "videos": [["a.mp4"]]}), str(f))
    with pytest.raises(DatasetError, match="no 'extra_info' column"):
        load_samples(f)


# ------------------------------------------------------------------ validation at load time
def _jsonl(path, rows: list[dict]) -> None:
    # json.dumps writes float('nan') as NaN, which json.loads reads back: real files have it.
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _row(i: int, **kw) -> dict:
    return {"id": f"r{i}", "video": "videos/vid_0000.mp4", "question": "q", "answer": "B", **kw}


def _parquet(path, extras: list, **columns) -> None:
    """ParaVT-layout parquet; ``extras`` as dicts make ``extra_info`` a struct column (every
    row then carries every key, absent ones as null), as JSON strings a string column."""
    n = len(extras)
    rows = {
        "prompt": [[{"role": "user", "content": "<video>\nq"}]] * n,
        "videos": [[{"video": "videos/vid_0000.mp4"}]] * n,
        "extra_info": extras,
        **columns,
    }
    pq.write_table(pa.table(rows), str(path))


def test_tvg_answer_that_does_not_parse_fails_at_load_not_in_the_reward(synth_dir, tmp_path):
    root = str(synth_dir)
    f = tmp_path / "d.jsonl"
    _jsonl(f, [_row(0), _row(1, question_type="tvg", answer="around the middle")])
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: tvg 'answer' 'around the middle' is not"):
        load_samples(f, video_root=root)
    p = tmp_path / "d.parquet"
    tvg = {"question_type": "tvg", "index": 1}
    _parquet(p, [json.dumps({"answer": "B", "index": 0}), json.dumps({**tvg, "answer": "soon"})])
    with pytest.raises(DatasetError, match=r"d\.parquet row 1: tvg 'answer' 'soon'"):
        load_samples(p, video_root=root)
    # An empty window is no window either.
    _jsonl(f, [_row(0, question_type="tvg", answer="", event_start=5.0, event_end=5.0)])
    with pytest.raises(DatasetError, match=r"d\.jsonl:1: tvg window .* need start < end"):
        load_samples(f, video_root=root)
    # A window the reward can read fills the events, so the reward never re-parses.
    _jsonl(f, [_row(0, question_type="tvg", answer="from 3 to 7.5 seconds")])
    (s,) = load_samples(f, video_root=root)
    assert (s.event_start, s.event_end) == (3.0, 7.5)
    _parquet(p, [json.dumps({**tvg, "answer": "[12.5, 16.0]"})])
    (s,) = load_samples(p, video_root=root)
    assert (s.event_start, s.event_end) == (12.5, 16.0)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_ground_truth_is_an_error_naming_row_and_field(synth_dir, tmp_path, bad):
    f = tmp_path / "d.jsonl"
    rows = [_row(0), _row(1, question_type="tvg", answer="", event_start=bad, event_end=9.0)]
    _jsonl(f, rows)
    assert "NaN" in f.read_text() or "Infinity" in f.read_text()
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: 'event_start' = .* not a finite"):
        load_samples(f, video_root=str(synth_dir))
    # A [start, end] answer list with a non-finite bound (parquet) is no window.
    p = tmp_path / "d.parquet"
    extra = {"answer": [2.0, bad], "question_type": "tvg", "index": 0}
    pq.write_table(
        pa.table(
            {
                "prompt": [[{"role": "user", "content": "q"}]],
                "videos": [[{"video": "videos/vid_0000.mp4"}]],
                "extra_info": [extra],
            }
        ),
        str(p),
    )
    with pytest.raises(DatasetError, match=r"d\.parquet row 0: tvg 'answer'"):
        load_samples(p, video_root=str(synth_dir))


def test_one_event_bound_without_the_other_is_an_error(synth_dir, tmp_path):
    f = tmp_path / "d.jsonl"
    _jsonl(f, [_row(0, question_type="tvg", answer="1-2", event_start=1.0)])
    with pytest.raises(DatasetError, match=r"d\.jsonl:1: 'event_end' is missing"):
        load_samples(f, video_root=str(synth_dir))


def test_parquet_rows_without_ids_get_unique_stable_ids(synth_dir, tmp_path):
    # A struct extra_info: the rows without an index read it back as null (the old reader
    # made every such id the string 'None', so they shared one frame budget K).
    p = tmp_path / "rl.parquet"
    extras = [
        {"answer": "B", "question_type": "mcq", "index": 7},
        {"answer": "x", "question_type": "oe", "index": None},
        {"answer": "y", "question_type": "oe", "index": None},
    ]
    _parquet(p, extras)
    assert pq.read_table(str(p)).schema.field("extra_info").type.num_fields == 3
    with pytest.warns(UserWarning, match=r"rl\.parquet: 2 of 3 row\(s\) have no id") as rec:
        got = load_samples(p, video_root=str(synth_dir))
    assert len(rec) == 1
    assert [s.id for s in got] == ["7", "rl-1", "rl-2"]
    samples, rep = read_samples(p, video_root=str(synth_dir))
    assert [s.id for s in samples] == ["7", "rl-1", "rl-2"]  # the same on every read
    assert rep == DatasetReport(str(p), rows=3, synthesized_ids=["rl-1", "rl-2"])
    # A top-level id column is used when extra_info has none; NaN counts as absent.
    _parquet(p, [{"answer": "x"}] * 3, id=["a", None, "c"], index=[0.0, math.nan, 2.0])
    assert [s.id for s in read_samples(p, video_root=str(synth_dir))[0]] == ["a", "rl-1", "c"]
    # pandas writes an int index with gaps as float: 3.0 is the id "3", not "3.0".
    _parquet(p, [{"answer": "x"}] * 2, index=[3.0, math.nan])
    assert [s.id for s in read_samples(p, video_root=str(synth_dir))[0]] == ["3", "rl-1"]
    # JSONL: a null or empty id is no id.
    f = tmp_path / "d.jsonl"
    _jsonl(f, [_row(0, id=None), _row(1, id=""), _row(2)])
    samples, rep = read_samples(f, video_root=str(synth_dir))
    assert [s.id for s in samples] == ["d-1", "d-2", "r2"]
    assert rep.synthesized_ids == ["d-1", "d-2"]


def test_duplicate_ids_are_renamed_stably_with_a_warning(synth_dir, tmp_path):
    root = str(synth_dir)
    f = tmp_path / "d.jsonl"
    _jsonl(f, [_row(0, id="x"), _row(1), _row(2, id="x")])
    with pytest.warns(UserWarning, match=r"1 row\(s\) repeat .*'x' -> 'x#3' at .*d\.jsonl:3"):
        got = load_samples(f, video_root=root)
    assert [s.id for s in got] == ["x", "r1", "x#3"]
    assert [s.id for s in load_samples(f, video_root=root)] == ["x", "r1", "x#3"]  # stable
    # An explicit id that equals a synthesised one: the later row is renamed.
    _jsonl(f, [_row(0, id="d-2"), _row(1, id=None)])
    with pytest.warns(UserWarning, match="repeat"):
        assert [s.id for s in load_samples(f, video_root=root)] == ["d-2", "d-2#2"]
    p = tmp_path / "d.parquet"
    _parquet(p, [json.dumps({"answer": "a", "index": i % 2}) for i in range(3)])
    samples, rep = read_samples(p, video_root=root)
    assert [s.id for s in samples] == ["0", "1", "0#2"]
    assert rep.renamed_ids == [("0", "0#2", f"{p} row 2")]
    # A renamed id never collides with an existing one.
    _jsonl(f, [_row(0, id="x"), _row(1, id="x#2"), _row(2, id="x")])
    samples, _ = read_samples(f, video_root=root)
    assert [s.id for s in samples] == ["x", "x#2", "x#3"]
    _jsonl(f, [_row(0, id="x"), _row(1, id="x"), _row(2, id="x#2")])
    ids = [s.id for s in read_samples(f, video_root=root)[0]]
    assert len(set(ids)) == 3


@pytest.mark.parametrize("answer", [None, float("nan"), float("inf")])
def test_null_or_non_finite_answer_is_an_error(synth_dir, tmp_path, answer):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps(_row(0, answer=answer)) + "\n")
    with pytest.raises(DatasetError, match=r"d\.jsonl:1: 'answer'"):
        load_samples(f, video_root=str(synth_dir))


def test_tvg_list_answer_keeps_its_precision(synth_dir, tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps(_row(0, question_type="tvg", answer=[12.51, 12.54])) + "\n")
    (s,) = load_samples(f, video_root=str(synth_dir))
    assert (s.event_start, s.event_end) == (12.51, 12.54)


def test_has_split_tells_an_absent_split_from_a_bad_one(tmp_path) -> None:
    from paravt.data.readers import DatasetError, has_split, load_samples

    (tmp_path / "train.jsonl").write_text("")
    assert has_split(tmp_path, "train") and not has_split(tmp_path, "val")
    assert has_split(tmp_path / "train.jsonl", "val")  # a file is every split
    (tmp_path / "val.jsonl").write_text("{not json\n")
    assert has_split(tmp_path, "val")
    with pytest.raises(DatasetError, match="val.jsonl:1"):  # so the trainer does not hide it
        load_samples(tmp_path, split="val")
    (tmp_path / "val.jsonl").unlink()
    for name in ("a_val.jsonl", "b_val.jsonl"):
        (tmp_path / name).write_text("")
    assert has_split(tmp_path, "val")  # ambiguous: load_samples must say so, not be skipped
    with pytest.raises(DatasetError, match="several candidates"):
        load_samples(tmp_path, split="val")


# ------------------------------------------------------------------ wrong-typed fields
_PROMPT = [{"role": "user", "content": "<video>\nq"}]
_EXTRA = {"answer": "B", "question_type": "mcq"}


def _pq_row(**kw) -> dict:
    return {
        "prompt": _PROMPT,
        "videos": [{"video": "videos/vid_0000.mp4"}],
        "extra_info": _EXTRA,
        **kw,
    }


@pytest.mark.parametrize(
    ("fmt", "rows", "where", "needles"),
    [
        # JSONL: the second line is the bad one.
        ("jsonl", [_row(0), _row(1, options=5)], ":2", ["'options'", "int 5", "list of option"]),
        ("jsonl", [_row(0), _row(1, options="RED")], ":2", ["'options'", "str 'RED'", "list of"]),
        ("jsonl", [_row(0), _row(1, options=["a", {"b": 1}])], ":2", ["'options[1]'", "dict"]),
        ("jsonl", [_row(0), _row(1, video=["a.mp4"])], ":2", ["'video'", "list", "path"]),
        ("jsonl", [_row(0), _row(1, question={"t": "q"})], ":2", ["'question'", "dict", "string"]),
        # Parquet: a column has one type, so where a good row cannot share the bad row's
        # type, the bad row is alone (row 0).
        (
            "parquet",
            [_pq_row(prompt=json.dumps(_PROMPT)), _pq_row(prompt="not json")],
            " row 1",
            ["'prompt'", "not valid JSON", "role"],
        ),
        ("parquet", [_pq_row(prompt=["hello"])], " row 0", ["'prompt[0]'", "str 'hello'", "role"]),
        ("parquet", [_pq_row(prompt=None)], " row 0", ["'prompt'", "null", "list of"]),
        (
            "parquet",
            [_pq_row(), _pq_row(videos=[{"path": "a.mp4"}])],
            " row 1",
            ["'videos[0]'", "'video'", "path"],
        ),
        (
            "parquet",
            [_pq_row(videos="videos/vid_0000.mp4"), _pq_row(videos="a.mp4")],
            " row 0",
            ["'videos'", "str 'videos/vid_0000.mp4'", "list"],
        ),
        (
            "parquet",
            [_pq_row(extra_info=["B", "mcq"])],
            " row 0",
            ["'extra_info'", "list", "answer"],
        ),
        (
            "parquet",
            [_pq_row(extra_info=json.dumps(_EXTRA)), _pq_row(extra_info="[1, 2]")],
            " row 1",
            ["'extra_info'", "list", "answer"],
        ),
    ],
    ids=[
        "options-int",
        "options-str",
        "options-item-dict",
        "video-list",
        "question-dict",
        "prompt-not-json",
        "prompt-list-of-str",
        "prompt-null",
        "videos-entry-without-video",
        "videos-str",
        "extra_info-list",
        "extra_info-json-list",
    ],
)
def test_wrong_typed_fields_are_format_errors_naming_file_row_and_field(
    tmp_path, fmt: str, rows: list[dict], where: str, needles: list[str]
) -> None:
    """Every wrong-typed field is a ``DatasetError`` naming the file, the row and the field,
    what was found and what is expected (before: raw TypeError / KeyError / AttributeError /
    JSONDecodeError naming nothing, or ``options: "RED"`` read as the options R, E, D)."""
    f = tmp_path / f"d.{fmt}"
    if fmt == "jsonl":
        _jsonl(f, rows)
    else:
        pq.write_table(pa.Table.from_pylist(rows), str(f))
    with pytest.raises(DatasetError) as e:
        read_samples(f)
    msg = str(e.value)
    assert msg.startswith(f"{f}{where}:"), msg
    for n in needles:
        assert n in msg, (n, msg)


def test_training_rows_get_the_evaluations_answer_checks(synth_dir, tmp_path, caplog):
    """Issue 50 item 10: an mcq answer that names no option ("Z" of four, or ""), an empty
    answer, a negative or day-long window are refused at load with the row named; an answer
    that is an option's letter (any case) or its text loads; a FIFO or a directory where a video
    belongs is named as such in the skipped-rows warning, not as "missing"."""
    import os

    root = str(synth_dir)
    f = tmp_path / "d.jsonl"
    opts = {"options": ["red", "green", "blue", "cyan"], "question_type": "mcq"}
    listed = "What colour?\nA. red\nB. green\nC. blue"
    bad = [
        (_row(0, answer="Z", **opts), r"d\.jsonl:1: mcq 'answer' 'Z' names none of its 4 options"),
        (
            _row(0, answer="D", question=listed, question_type="mcq"),
            r"'D' names none of its 3 options",
        ),
        (_row(0, answer="  "), r"d\.jsonl:1: 'answer' is empty"),
        (_row(0, event_start=-2.0, event_end=3.0), r"'event_start' = -2.0 s is outside"),
        (_row(0, event_start=1.0, event_end=1e6), r"'event_end' = 1000000.0 s is outside"),
    ]
    for row, pattern in bad:
        _jsonl(f, [row])
        with pytest.raises(DatasetError, match=pattern):
            load_samples(f, video_root=root)
    good = [
        _row(0, answer="b", **opts),
        _row(1, answer="Blue", **opts),
        _row(2, answer="Z", question_type="mcq"),
    ]
    _jsonl(f, good)  # the last: no options known, so only its emptiness is checked
    assert [s.answer for s in load_samples(f, video_root=root)] == ["b", "Blue", "Z"]
    os.mkfifo(tmp_path / "fifo.mp4")
    (tmp_path / "dir.mp4").mkdir()
    rows = [
        _row(0),
        _row(1, video=str(tmp_path / "fifo.mp4")),
        _row(2, video=str(tmp_path / "dir.mp4")),
    ]
    _jsonl(f, rows)
    with pytest.warns(UserWarning) as got:
        assert len(load_samples(f, video_root=root)) == 1
    text = " ".join(str(w.message) for w in got)
    assert "fifo.mp4 (is a FIFO (named pipe)" in text and "dir.mp4 (is a directory" in text, text


# ------------------------------------------- times out of range (issue 66 item 5c, fuzz-ish)
@pytest.mark.parametrize(
    "answer, time",
    [("[-10, -5]", "-10"), ([-10, -5], "-10"), ([1e9, 2e9], "1e\\+09"), ("90000-90010", "90000")],
)
def test_a_tvg_answer_window_out_of_range_is_refused(synth_dir, tmp_path, answer, time):
    # On main the range check covered event_start/event_end only: these windows loaded.
    f = tmp_path / "d.jsonl"
    _jsonl(f, [_row(0), _row(1, question_type="tvg", answer=answer)])
    with pytest.raises(DatasetError, match=rf"d\.jsonl:2: tvg 'answer' .* the time {time} s"):
        load_samples(f, video_root=str(synth_dir))
    p = tmp_path / "d.parquet"
    _parquet(p, [json.dumps({"answer": answer, "question_type": "tvg", "index": 0})])
    with pytest.raises(DatasetError, match=r"d\.parquet row 0: tvg 'answer' .* outside \[0,"):
        load_samples(p, video_root=str(synth_dir))


@pytest.mark.parametrize("bad", [-60, -60.0, 0, math.nan, math.inf, -math.inf, 1e9])
def test_a_row_duration_that_is_no_length_is_refused(synth_dir, tmp_path, bad):
    # On main a 'duration' of -60 or NaN went into Sample.extra as it was.
    f = tmp_path / "d.jsonl"
    _jsonl(f, [_row(0, duration=12.5), _row(1, duration=bad)])
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: 'duration' is .*not a video's length"):
        load_samples(f, video_root=str(synth_dir))
    p = tmp_path / "d.parquet"  # a struct extra_info: absent keys are null, and pass
    _parquet(
        p,
        [
            {"answer": "B", "index": 0, "duration": None},
            {"answer": "B", "index": 1, "duration": float(bad)},
        ],
    )
    with pytest.raises(DatasetError, match=r"d\.parquet row 1: 'duration' is"):
        load_samples(p, video_root=str(synth_dir))


def test_a_good_or_categorical_duration_loads(synth_dir, tmp_path):
    f = tmp_path / "d.jsonl"
    _jsonl(f, [_row(0, duration=12.5), _row(1, duration="short"), _row(2)])
    got = load_samples(f, video_root=str(synth_dir))
    assert [s.extra.get("duration") for s in got] == [12.5, "short", None]
