"""Fuzz: random text in every field of a data row (issue 66 item 6, the row-text surface).

Each file holds good rows and one row with one field replaced by random unicode: lone
surrogates (valid JSON as ``"\\ud83d"``), control characters, U+2028, BOMs, noncharacters, and
huge strings. Whatever the text, the reader either refuses the file with a ``DatasetError``
naming the file, the line (or parquet row) and the field, or loads rows whose every string a
real tokenizer encodes (``tokenizers``' Rust input conversion, which raised ``TypeError`` at
whatever step drew a lone surrogate). On the main of issue 66 the surrogate rows loaded and
the tokenizer check failed.
"""

from __future__ import annotations

import json
import random
from dataclasses import fields
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models

from paravt.data import DatasetError, read_samples
from paravt.data.sft_records import read_sft_records

_TOKENIZER = Tokenizer(models.BPE())  # no vocabulary needed: the input conversion is the test

# Ranges the generator draws code points from: plain text, controls, the line separators JSON
# leaves unescaped, BOM / noncharacters, astral planes, and the surrogates (always lone here:
# json.dumps escapes each on its own and json.loads joins only a high one before a low one).
_RANGES = [
    (0x20, 0x7E),
    (0x00, 0x1F),
    (0x7F, 0x9F),
    (0x2028, 0x2029),
    (0xFEFF, 0xFEFF),
    (0xFFFE, 0xFFFF),
    (0x1F600, 0x1F64F),
    (0x10FFFE, 0x10FFFF),
    (0xD800, 0xDBFF),
    (0xDC00, 0xDFFF),
]


def _text(rng: random.Random) -> str:
    n = rng.choice([1, 3, 20, 200, 1 << 20])  # 1 MB: a huge string in a field
    if n > 1000:
        return "x" * (n - 1) + chr(rng.randint(*rng.choice(_RANGES)))
    return "".join(chr(rng.randint(*rng.choice(_RANGES))) for _ in range(n))


def _lone(s: str) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in s)


def _strings(v) -> list[str]:
    if isinstance(v, str):
        return [v]
    if isinstance(v, dict):
        return [s for k, x in v.items() for s in (_strings(k) + _strings(x))]
    if isinstance(v, (list, tuple)):
        return [s for x in v for s in _strings(x)]
    return []


def _assert_tokenizable(samples) -> None:
    for s in samples:
        for f in fields(s):
            for text in _strings(getattr(s, f.name)):
                _TOKENIZER.encode(text)  # raises TypeError on a lone surrogate


def _good(i: int) -> dict:
    return {"id": f"r{i}", "video": "videos/vid_0000.mp4", "question": "q?", "answer": "a"}


# (field path in the message, how to put the text in a JSONL row)
_JSONL_FIELDS = {
    "id": lambda r, t: r.update(id=t),
    "video": lambda r, t: r.update(video=t),
    "question": lambda r, t: r.update(question=t),
    "answer": lambda r, t: r.update(answer=t),
    "options[1]": lambda r, t: r.update(options=["x", t]),
    "notes": lambda r, t: r.update(notes=t),
    "meta.tags[0]": lambda r, t: r.update(meta={"tags": [t]}),
}


@pytest.mark.parametrize("seed", range(4))
def test_jsonl_rows_with_random_text_in_each_field(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    f = tmp_path / "train.jsonl"
    seen_lone = 0
    for field, put in _JSONL_FIELDS.items():
        for _ in range(5):
            text = _text(rng)
            rows = [_good(i) for i in range(3)]
            put(rows[1], text)
            # ensure_ascii: every non-ASCII character escaped, a lone surrogate as "\udXXX"
            f.write_text("".join(json.dumps(r) + "\n" for r in rows))
            try:
                samples, _ = read_samples(f, keep_missing_videos=True)
            except DatasetError as e:
                msg = str(e)
                assert msg.startswith(f"{f}:2: "), msg[:300]
                if _lone(text):
                    seen_lone += 1
                    assert f"field '{field}' holds a lone surrogate U+" in msg, msg[:300]
                else:
                    assert "surrogate" not in msg, msg[:300]
                msg.encode("utf-8")  # the message itself is printable
                continue
            assert not _lone(text), f"a lone surrogate in '{field}' loaded"
            _assert_tokenizable(samples)
    assert seen_lone > 0  # the generator did reach the surrogates


@pytest.mark.parametrize("seed", range(3))
def test_parquet_rows_with_random_text_in_json_cells(tmp_path: Path, seed: int) -> None:
    """Arrow strings are UTF-8, but the ``prompt`` and ``extra_info`` cells may be JSON strings
    whose escapes parse to a lone surrogate."""
    rng = random.Random(100 + seed)
    f = tmp_path / "train.parquet"
    cells = {
        "prompt[0].content": lambda t: (
            json.dumps([{"role": "user", "content": "<video>" + t}]),
            json.dumps({"answer": "a"}),
        ),
        "extra_info.answer": lambda t: (
            json.dumps([{"role": "user", "content": "<video>q"}]),
            json.dumps({"answer": "a" + t}),
        ),
        "extra_info.note": lambda t: (
            json.dumps([{"role": "user", "content": "<video>q"}]),
            json.dumps({"answer": "a", "note": t}),
        ),
    }
    for field, make in cells.items():
        for _ in range(5):
            text = _text(rng)
            good = make("q")
            bad = make(text)
            prompts, extras = zip(good, bad, good)
            table = {
                "prompt": list(prompts),
                "videos": [[{"video": "videos/vid_0000.mp4"}]] * 3,
                "extra_info": list(extras),
            }
            pq.write_table(pa.table(table), str(f))
            try:
                samples, _ = read_samples(f, keep_missing_videos=True)
            except DatasetError as e:
                msg = str(e)
                assert msg.startswith(f"{f} row 1: "), msg[:300]
                assert (f"field '{field}' holds a lone surrogate" in msg) == _lone(text), msg[:300]
                continue
            assert not _lone(text), f"a lone surrogate in '{field}' loaded"
            _assert_tokenizable(samples)


def test_sft_records_with_a_lone_surrogate_name_line_and_field(tmp_path: Path) -> None:
    f = tmp_path / "sft.jsonl"
    turn = {"role": "assistant", "content": "<answer>A</answer>"}
    bad = {"role": "tool", "content": ["fine", "half \ud83d of a pair"]}
    rows = [{"sample_id": "a", "turns": [turn]}, {"sample_id": "b", "turns": [turn, bad]}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError) as e:
        read_sft_records(f)
    assert str(e.value).startswith(
        f"{f}:2: field 'turns[1].content[1]' holds a lone surrogate U+D83D at character 5"
    )
    # A whole astral character, escaped as its pair, is one code point and loads.
    rows[1]["turns"][1]["content"][1] = "a whole \U0001f600"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_sft_records(f)[1].turns[1].content[1] == "a whole \U0001f600"
