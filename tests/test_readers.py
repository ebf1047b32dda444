"""Dataset readers: synthetic JSONL, ParaVT parquet, missing videos, malformed rows."""

from __future__ import annotations

import json
import os
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from paravt.data import DatasetError, load_samples, read_samples


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
    _, missing = read_samples(f, video_root=str(synth_dir))
    assert [os.path.basename(m) for m in missing] == ["gone_1.mp4", "gone_2.mp4"]


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
    with pytest.warns(UserWarning, match="skipped 1 row"):
        got = load_samples(tmp_path, video_root=str(synth_dir))  # directory: *train*.parquet
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
    samples, missing = read_samples(f, video_root=str(synth_dir))
    assert len(missing) == 1 and missing[0].endswith("missing/x.mp4")


def test_parquet_without_required_columns_is_a_clear_error(tmp_path) -> None:
    f = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["x"], "videos": [["a.mp4"]]}), str(f))
    with pytest.raises(DatasetError, match="no 'extra_info' column"):
        load_samples(f)
