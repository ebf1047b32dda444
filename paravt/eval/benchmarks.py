"""Benchmark adapters: each evaluation set, as distributed, → ``list[Sample]``.

``load_benchmark(name, data_root, limit=None)`` reads the annotation file of one benchmark from
the directory where its dataset was unpacked (``data_root``), checks every field it reads, and
returns one :class:`~paravt.types.Sample` per row in file order. Expected layouts (``<root>`` is
``data_root``; the spec with sources is ``shared/research/benchmarks.md``)::

    videomme, videomme_sub    lmms-lab/Video-MME, config videomme, split test
        <root>/videomme/test-00000-of-00001.parquet
        <root>/data/<videoID>.mp4          (.MP4 and .mkv are tried too; from videos_chunked_*.zip)
        <root>/subtitle/<videoID>.srt      (videomme_sub; from subtitle.zip; none = no subtitles)
    longvideobench            longvideobench/LongVideoBench, split validation
        <root>/validation-00000-of-00001.parquet   (or <root>/lvb_val.json when it is absent)
        <root>/videos/<video_path>         (cat videos.tar.part.* > videos.tar; tar -xf videos.tar)
    lvbench                   lmms-lab/LVBench, split train
        <root>/data/train-00000-of-00001.parquet
        <root>/<video_path>                (or <root>/videos/<video_path>)
    mlvu                      sy1998/MLVU_dev, split test
        <root>/mlvu/test-00000-of-00001.parquet
        <root>/<video_name>                (or <root>/video/<video_name>; video_part_*.zip, flat)
    mmvu                      yale-nlp/MMVU, split validation
        <root>/validation.json
        <root>/videos/<Subject>/<n>.mp4    (the part of each row's ``video`` URL after /main/)
    charades_sta              lmms-lab/charades_sta, split test
        <root>/data/test-00000-of-00001.parquet
        <root>/Charades_v1_480/<video>     (Charades_v1_480_part_*.zip)
    synth                     python -m paravt.data.synth --out <root>
        <root>/val.jsonl, <root>/videos/vid_XXXX.mp4
    jsonl                     your own rows: the folder python -m paravt.train reads at data.path
        <root>/val.jsonl                   (one row a line: id, video, question, answer,
                                           question_type, options; read as synth's)
        <root>/<video>                     (a row's relative video path is under <root>)

Conventions the runner and the scorer rely on:

* ``Sample.id`` is unique within a benchmark and stable across runs (``limit`` never changes
  it): Video-MME ``question_id`` (``"001-1"``); LongVideoBench ``id``; LVBench ``str(uid)``;
  MLVU ``"{task_type}-{question_id}"`` (``question_id`` is ``"Q0"``-like, per task), and if
  that pair repeats anywhere in the file, ParaVT's ``"{task_type}-{row}"`` for every row of the
  file (``row`` = 0-based file row; a warning is logged); MMVU ``id``; Charades-STA
  ``"{video stem}#{row}"`` (the file has no id; the row is unique and fixed for a given file);
  synth and jsonl the row's ``id``. A duplicate id is a :class:`BenchmarkFormatError` naming both rows.
* ``Sample.video`` is an absolute path even when the file is missing; missing videos are kept
  (``extra["video_missing"] = True``) so the runner counts them as error results.
* ``Sample.question`` is the question stem only: options embedded in the text (LVBench, MLVU:
  ``"(A) ..."`` lines at its end) are split off, and it carries no instruction. The synthetic
  task's mcq rows carry the stem and the options apart, so the evaluated prompt is the one the
  model trained on (``tests/test_synth_spot.py``; folders written before that lose their
  embedded options and the instruction after them); its oe and tvg questions keep their
  answer-format sentence, which is part of that task's question.
* ``Sample.options`` are ``"A. text"`` strings, lettered by position, exactly one prefix
  (Video-MME's own ``"A. "`` prefixes are stripped first); ``[]`` for open-ended and tvg rows.
* ``Sample.answer``: mcq — the upper-case ground-truth letter, checked to name an option;
  MMVU open-ended — the free-text answer; Charades-STA — ``"{start!r}-{end!r}"`` with
  ``event_start``/``event_end`` the float16 timestamps exactly as stored (24.3 reads 24.296875).
* ``Sample.question_type``: ``"mcq"``, ``"oe"`` (MMVU open-ended; synth oe) or ``"tvg"``.
* ``Sample.extra``: ``"benchmark"``, ``"categories"`` (breakdown name → value, or a list of
  values for multi-label LVBench ``question_type``: such a question counts in each),
  ``"raw_id"``, ``"row"`` (0-based row in the file; synth: its JSONL line), ``"video_missing"``
  and per benchmark: ``"duration"`` (seconds: LongVideoBench, MLVU), ``"subtitles"``
  (videomme_sub), ``"raw_question"`` (LVBench, MLVU: the text with its embedded options),
  ``"key"`` (Charades-STA: lmms-eval's ``"{video}>>>{caption}>>>{timestamp}"``).

Every field an adapter reads is checked for presence and type; where the spec is unconfirmed
(LVBench ``uid`` int or str and ``question_type`` list or str, MLVU answer letter or text) both
documented forms are accepted and anything else fails. Errors are :class:`BenchmarkFormatError`
naming the file, the row (and id when known), the field, what was found and the fix. The whole
file is validated even with ``limit``, so a bad row fails before any generation.

Scope: LongVideoBench subtitles are not read (ParaVT and lmms-eval's video task do not use them);
Video-MME subtitles are all of the file's cues (ParaVT's ``videomme_wsub``), not lmms-eval's
frame-aligned selection.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paravt.answers import option_text
from paravt.data.readers import DatasetError, describe_value, duration_problem, read_samples
from paravt.files import read_jsonl, unencodable_text
from paravt.types import Sample

log = logging.getLogger("paravt.eval")


class BenchmarkFormatError(ValueError):
    """A benchmark file or row does not match its documented layout. The message names the
    file, the row (index and id when known), the field, the problem and the fix."""


# ------------------------------------------------------------------------- field checking
def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _duration(f: _File, row: dict, i: int, rid: Any) -> float:
    """A row's ``duration`` (seconds), a number that is a video's length (a negative or NaN one
    would reach the results as the video's)."""
    v = f.get(row, i, "duration", "number", rid)
    if why := duration_problem(v):
        raise f.error(i, "duration", why, rid)
    return float(v)


def _is_str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


# kind -> (check, what the message says was expected)
_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "str": (lambda v: isinstance(v, str), "a string"),
    "int": (_is_int, "an integer"),
    "number": (_is_number, "a number"),
    "str_list": (_is_str_list, "a list of strings"),
    "number_list": (
        lambda v: isinstance(v, list) and all(_is_number(x) for x in v),
        "a list of numbers",
    ),
    "dict": (lambda v: isinstance(v, dict), "an object (struct)"),
    "int_or_str": (lambda v: _is_int(v) or isinstance(v, str), "an integer or a string"),
    "str_or_str_list": (
        lambda v: isinstance(v, str) or _is_str_list(v),
        "a string or a list of strings",
    ),
}


class _File:
    """One annotation file: where it is, what it should be, and how to name its rows."""

    def __init__(self, bench: str, path: Path, unit: str = "row") -> None:
        self.bench = bench
        self.path = path
        self.source = BENCHMARK_SPECS[bench].source
        self.unit = unit  # how rows are counted in messages: "row" (0-based) or "line"

    def error(self, row: int | None, field: str | None, problem: str, rid: Any = None) -> Exception:
        where = str(self.path)
        if row is not None:
            where += f" {self.unit} {row}" + (f" (id {rid!r})" if rid is not None else "")
        what = f"field '{field}' {problem}" if field else problem
        return BenchmarkFormatError(
            f"{where}: {what}; the file does not match the {self.bench} layout of {self.source} "
            "documented in paravt.eval.benchmarks: re-download it or fix this row"
        )

    def get(self, row: dict, i: int, key: str, kind: str, rid: Any = None) -> Any:
        """``row[key]``, checked to be of ``kind`` (see ``_KINDS``)."""
        if key not in row:
            raise self.error(i, key, "is missing", rid)
        v = row[key]
        if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):  # numpy scalars/arrays
            v = v.tolist()
        check, expected = _KINDS[kind]
        if not check(v):
            raise self.error(i, key, f"is {describe_value(v)}, expected {expected}", rid)
        return v

    def optional(self, row: dict, i: int, key: str, kind: str, rid: Any = None) -> Any:
        """Like ``get`` but None when the column is absent or the value null."""
        if row.get(key) is None:
            return None
        return self.get(row, i, key, kind, rid)


def _annotation(bench: str, root: Path, rel: str, alt: str = "") -> _File:
    path = root / rel
    if not path.is_file():
        raise BenchmarkFormatError(
            f"{path}: no such file; {bench} expects the annotation file <data_root>/{rel}{alt} "
            f"of {BENCHMARK_SPECS[bench].source} (data_root={root}); see the layout in paravt.eval.benchmarks"
        )
    return _File(bench, path)


def _parquet_rows(f: _File, columns: Sequence[str]) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(str(f.path))
    except (OSError, pa.ArrowException) as e:
        raise BenchmarkFormatError(
            f"{f.path}: cannot be read as parquet ({e}); expected the {f.bench} annotation file "
            f"of {f.source}: re-download it"
        ) from None
    names = table.schema.names
    missing = [c for c in columns if c not in names]
    if missing:
        raise BenchmarkFormatError(
            f"{f.path}: no column(s) {missing} (columns: {names}); expected the {f.bench} "
            f"layout of {f.source} documented in paravt.eval.benchmarks: re-download the file"
        )
    return table.to_pylist()


def _json_rows(f: _File) -> list[dict]:
    try:
        with open(f.path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BenchmarkFormatError(f"{f.path}: not valid JSON ({e}); re-download it") from None
    if not isinstance(data, list):
        raise BenchmarkFormatError(
            f"{f.path}: top level is {type(data).__name__}, expected a JSON list of row "
            f"objects (the {f.bench} layout of {f.source}): re-download it"
        )
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise f.error(i, None, f"is {describe_value(row)}, expected a JSON object")
        if bad := unencodable_text(row):  # a lone "\ud83d": no tokenizer encodes it
            raise BenchmarkFormatError(f"{f.path} row {i}: {bad}")
    return data


# ------------------------------------------------------------------------------- videos
class _Videos:
    """Resolves video paths to absolute ones, trying fallbacks; caches existence checks."""

    def __init__(self) -> None:
        self._exists: dict[str, bool] = {}

    def exists(self, path: Path) -> bool:
        key = str(path)
        if key not in self._exists:
            self._exists[key] = os.path.isfile(key)
        return self._exists[key]

    def find(self, candidates: Sequence[Path]) -> tuple[str, bool]:
        """The first existing candidate, else the first one; and whether it is missing."""
        for c in candidates:
            if self.exists(c):
                return str(c), False
        return str(candidates[0]), True


def _relative(f: _File, i: int, key: str, rel: str, rid: Any) -> str:
    """A dataset-relative path, refused when it would leave the data root: absolute, with a
    '..' part, or starting with '~' or a URL scheme ('file://'), which readers expand."""
    leaves = os.path.isabs(rel) or ".." in Path(rel).parts or rel.startswith("~")
    if not rel or leaves or "://" in rel:
        raise f.error(i, key, f"is {rel!r}, expected a file name relative to the data root", rid)
    return rel


# ------------------------------------------------------------------------------- options
def _lettered(texts: Sequence[str], f: _File, i: int, rid: Any, key: str = "options") -> list[str]:
    """``["A. text", ...]``; row ``i`` of ``f`` with more than 26 options is refused (the
    letters are A..Z: a 27th has none, and the answer could not name it)."""
    _at_most_26(f, i, len(texts), rid, key)
    return [f"{string.ascii_uppercase[j]}. {t}" for j, t in enumerate(texts)]


def _at_most_26(f: _File, i: int, n: int, rid: Any, key: str = "options") -> None:
    if n > 26:
        raise f.error(
            i, key, f"has {n} options, more than the 26 letters A..Z can name; split the row "
            "or drop options", rid,
        )  # fmt: skip


def _letter_answer(f: _File, i: int, value: str, n: int, rid: Any, key: str = "answer") -> str:
    a = value.strip().upper()
    letters = string.ascii_uppercase[:n]
    if len(a) != 1 or a not in letters:
        raise f.error(i, key, f"is {value!r}, expected one option letter of {list(letters)}", rid)
    return a


def _split_embedded(question: str) -> tuple[str, list[str], str] | None:
    """Split a question that lists its options one per line (``(A) red``, ``A. red``) into
    ``(stem, option texts, text after the options)``. The options are the last run of lines
    lettered A, B, C... in order (at least two); None when there is no such run."""
    lines = question.split("\n")
    letters = [option_text(line)[0] for line in lines]
    best: tuple[int, int] | None = None
    k = 0
    while k < len(lines):
        end = k
        while end < len(lines) and end - k < 26 and letters[end] == string.ascii_uppercase[end - k]:
            end += 1
        if end - k >= 2:
            best = (k, end)
        k = max(end, k + 1)
    if best is None:
        return None
    k, end = best
    texts = [option_text(line)[1] for line in lines[k:end]]
    return "\n".join(lines[:k]).strip(), texts, "\n".join(lines[end:]).strip()


def _stem_and_options(f: _File, i: int, question: str, rid: Any) -> tuple[str, list[str]]:
    """Stem and option texts of a question whose options are its last lines (LVBench, MLVU)."""
    split = _split_embedded(question)
    if split is None or not split[0] or split[2]:
        why = (
            "has no options embedded as lettered lines ('(A) ...', '(B) ...', at least two)"
            if split is None
            else "has no question text before its options"
            if not split[0]
            else "has text after its lettered options"
        )
        raise f.error(
            i, "question", f"{why}: {question[:120]!r}; expected '<stem>\\n(A) ...\\n(B) ...'", rid
        )
    return split[0], split[1]


def _check_unique_ids(f: _File, samples: Sequence[Sample], field: str) -> None:
    """Raise naming both rows when two samples share an id (``field``: the id's source)."""
    first: dict[str, int] = {}
    for r, s in enumerate(samples):
        if s.id in first:
            raise f.error(
                r,
                field,
                f"repeats id {s.id!r} of row {first[s.id]}; ids must be unique (the runner keys "
                "results by them)",
                s.id,
            )
        first[s.id] = r


def _extra(bench: str, categories: dict[str, Any], raw_id: Any, row: int, missing: bool) -> dict:
    return {
        "benchmark": bench,
        "categories": categories,
        "raw_id": raw_id,
        "row": row,
        "video_missing": missing,
    }


# ----------------------------------------------------------------------------- subtitles
_TIME = r"(?:(\d+):)?(\d{1,2}):(\d{1,2})(?:[,.](\d{1,3}))?"
_TIME_LINE = re.compile(rf"^\s*{_TIME}\s*-->\s*{_TIME}")
_TAG = re.compile(r"<[^>]*>")


def _seconds(h: str | None, m: str, s: str, frac: str | None) -> float:
    return int(h or 0) * 3600 + int(m) * 60 + float(f"{s}.{frac or 0}")


def parse_srt(text: str) -> list[tuple[float, float, str]]:
    """Cues of an SRT file as ``(start s, end s, text)``.

    Blocks are split on blank lines (``\\r\\n`` / ``\\r`` line ends and a leading BOM are
    accepted; the last block needs no trailing blank line). In each block the lines up to and
    including the ``HH:MM:SS,mmm --> HH:MM:SS,mmm`` line (index, timing) are dropped; the rest
    are the text, with every ``<...>`` tag (Video-MME's ``<font ...>``) removed, lines stripped,
    empty ones dropped, and joined with ``\\n``. Blocks without a timing line and cues left with
    no text are skipped. Raises ``ValueError`` for a ``-->`` line whose times do not parse.
    """
    text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    cues = []
    for b, block in enumerate(re.split(r"\n[ \t]*\n", text)):
        lines = block.split("\n")
        at = next((j for j, line in enumerate(lines) if "-->" in line), None)
        if at is None:
            continue
        m = _TIME_LINE.match(lines[at])
        if m is None:
            raise ValueError(f"SRT block {b + 1}: timing line {lines[at]!r} does not parse")
        start, end = _seconds(*m.groups()[:4]), _seconds(*m.groups()[4:])
        body = [_TAG.sub("", line).strip() for line in lines[at + 1 :]]
        body = [line for line in body if line]
        if body:
            cues.append((start, end, "\n".join(body)))
    return cues


def _subtitles(path: Path) -> str:
    if not path.is_file():
        return ""
    try:
        cues = parse_srt(path.read_bytes().decode("utf-8", errors="replace"))
    except ValueError as e:
        raise BenchmarkFormatError(
            f"{path}: {e}; expected SRT cues 'HH:MM:SS,mmm --> HH:MM:SS,mmm': re-extract "
            "subtitle.zip of lmms-lab/Video-MME or delete this file (no subtitles)"
        ) from None
    return "\n".join(t for _, _, t in cues)


# ------------------------------------------------------------------------------- adapters
def _unprefixed(f: _File, i: int, j: int, option: str, rid: Any) -> str:
    """Text of Video-MME option ``j`` without its own ``"A. "`` prefix (which must be the
    letter of its position: the answer letter refers to it)."""
    expected = string.ascii_uppercase[j]
    letter, text = option_text(option)
    if letter is None and re.fullmatch(r"\(?[A-Z][.:)]?", text):
        letter, text = text.strip("(.:)"), ""
    if letter is not None and letter != expected:
        raise f.error(
            i,
            "options",
            f"item {j} is {option!r}, expected option {expected} ('{expected}. ...')",
            rid,
        )
    if not text:
        raise f.error(i, "options", f"item {j} is {option!r}: an empty option", rid)
    return text


def _videomme(root: Path, bench: str) -> list[Sample]:
    f = _annotation(bench, root, "videomme/test-00000-of-00001.parquet")
    keys = ("question_id", "videoID", "question", "options", "answer")
    cats = ("duration", "domain", "sub_category", "task_type")
    rows = _parquet_rows(f, keys + cats)
    videos = _Videos()
    out = []
    for i, row in enumerate(rows):
        qid = f.get(row, i, "question_id", "str")
        vid = _relative(f, i, "videoID", f.get(row, i, "videoID", "str", qid), qid)
        question = f.get(row, i, "question", "str", qid).strip()
        raw_opts = f.get(row, i, "options", "str_list", qid)
        _at_most_26(f, i, len(raw_opts), qid)
        texts = [_unprefixed(f, i, j, opt, qid) for j, opt in enumerate(raw_opts)]
        if len(texts) < 2:
            raise f.error(i, "options", f"has {len(texts)} option(s), expected at least 2", qid)
        answer = _letter_answer(f, i, f.get(row, i, "answer", "str", qid), len(texts), qid)
        categories = {c: f.get(row, i, c, "str", qid) for c in cats}
        stem = root / "data" / vid
        video, missing = videos.find([Path(f"{stem}{ext}") for ext in (".mp4", ".MP4", ".mkv")])
        extra = _extra(bench, categories, qid, i, missing)
        extra["youtube_id"] = vid
        if BENCHMARK_SPECS[bench].subtitles:
            extra["subtitles"] = _subtitles(root / "subtitle" / f"{vid}.srt")
        out.append(
            Sample(
                qid,
                video,
                question,
                answer,
                "mcq",
                options=_lettered(texts, f, i, qid),
                extra=extra,
            )
        )
    _check_unique_ids(f, out, "question_id")
    return out


def _lvb_options(f: _File, i: int, raw: list[tuple[str, Any]], rid: Any) -> list[str]:
    """Option texts of a LongVideoBench row: unused slots ("N/A" or empty) may only trail."""
    texts: list[str] = []
    gap = None
    for key, v in raw:
        if not isinstance(v, str):
            raise f.error(i, key, f"is {describe_value(v)}, expected a string", rid)
        used = v.strip() not in ("", "N/A")
        if used and gap is not None:
            raise f.error(
                i, key, f"is an option after the unused slot {gap}: letters would shift", rid
            )
        if used:
            texts.append(v.strip())
        elif gap is None:
            gap = key
    if len(texts) < 2:
        raise f.error(i, raw[0][0], f"gives {len(texts)} option(s), expected at least 2", rid)
    return texts


def _longvideobench(root: Path, bench: str) -> list[Sample]:
    as_json = (
        not (root / "validation-00000-of-00001.parquet").is_file()
        and (root / "lvb_val.json").is_file()
    )
    if as_json:
        f = _annotation(bench, root, "lvb_val.json")
        rows = _json_rows(f)
    else:
        f = _annotation(bench, root, "validation-00000-of-00001.parquet", " (or lvb_val.json)")
        opt_cols = tuple(f"option{k}" for k in range(5))
        base = ("id", "video_path", "question", "correct_choice", "duration", "duration_group")
        rows = _parquet_rows(f, base + ("question_category",) + opt_cols)
    videos = _Videos()
    out = []
    for i, row in enumerate(rows):
        rid = f.get(row, i, "id", "str")
        rel = _relative(f, i, "video_path", f.get(row, i, "video_path", "str", rid), rid)
        question = f.get(row, i, "question", "str", rid).strip()
        if as_json:
            cands = f.get(row, i, "candidates", "str_list", rid)
            raw = [(f"candidates[{j}]", c) for j, c in enumerate(cands)]
        else:
            raw = [(f"option{k}", row[f"option{k}"]) for k in range(5)]
        texts = _lvb_options(f, i, raw, rid)
        choice = f.get(row, i, "correct_choice", "int", rid)
        if not 0 <= choice < len(texts):
            raise f.error(
                i,
                "correct_choice",
                f"is {choice}, outside the {len(texts)} option(s) "
                f"(0..{len(texts) - 1}); test-split rows have no ground truth",
                rid,
            )
        categories = {
            "duration_group": str(f.get(row, i, "duration_group", "int", rid)),
            "question_category": f.get(row, i, "question_category", "str", rid),
        }
        video, missing = videos.find([root / "videos" / rel])
        extra = _extra(bench, categories, rid, i, missing)
        extra["duration"] = _duration(f, row, i, rid)
        answer = string.ascii_uppercase[choice]
        out.append(
            Sample(
                rid,
                video,
                question,
                answer,
                "mcq",
                options=_lettered(texts, f, i, rid),
                extra=extra,
            )  # fmt: skip
        )
    _check_unique_ids(f, out, "id")
    return out


def _lvbench(root: Path, bench: str) -> list[Sample]:
    f = _annotation(bench, root, "data/train-00000-of-00001.parquet")
    rows = _parquet_rows(f, ("uid", "question", "answer", "video_path", "question_type"))
    videos = _Videos()
    out = []
    for i, row in enumerate(rows):
        uid = f.get(row, i, "uid", "int_or_str")
        sid = str(uid)
        rel = _relative(f, i, "video_path", f.get(row, i, "video_path", "str", sid), sid)
        raw_q = f.get(row, i, "question", "str", sid)
        stem, texts = _stem_and_options(f, i, raw_q, sid)
        answer = _letter_answer(f, i, f.get(row, i, "answer", "str", sid), len(texts), sid)
        qtype = f.get(row, i, "question_type", "str_or_str_list", sid)
        labels = [qtype] if isinstance(qtype, str) else list(qtype)
        if not labels or not all(x.strip() for x in labels):
            raise f.error(i, "question_type", f"is {qtype!r}, expected category names", sid)
        video, missing = videos.find([root / rel, root / "videos" / rel])
        extra = _extra(bench, {"question_type": labels}, uid, i, missing)
        extra["raw_question"] = raw_q
        for key in ("key", "type", "time_reference"):  # [T] columns: kept when present
            v = f.optional(row, i, key, "str", sid)
            if v is not None:
                extra[key] = v
        options = _lettered(texts, f, i, sid, "question")
        out.append(Sample(sid, video, stem, answer, "mcq", options=options, extra=extra))
    _check_unique_ids(f, out, "uid")
    return out


def _mlvu_answer(f: _File, i: int, value: str, cands: list[str], rid: Any) -> str:
    """§4.6: a single letter in range is the answer; else the candidate whose text it is."""
    a = value.strip()
    by_text = [j for j, c in enumerate(cands) if c.strip() == a]
    if len(a) == 1 and a.upper() in string.ascii_uppercase[: len(cands)]:
        if by_text and string.ascii_uppercase[by_text[0]] != a.upper():
            raise f.error(
                i,
                "answer",
                f"is {value!r}: both the letter {a.upper()} and the text of "
                f"candidate {string.ascii_uppercase[by_text[0]]}; cannot tell which is meant",
                rid,
            )
        return a.upper()
    if len(by_text) == 1:
        return string.ascii_uppercase[by_text[0]]
    problem = (
        "which matches the text of several candidates"
        if by_text
        else f"neither an option letter (A..{string.ascii_uppercase[len(cands) - 1]}) nor the "
        "text of one candidate"
    )
    raise f.error(i, "answer", f"is {value!r}, {problem} (candidates: {cands})", rid)


def _mlvu(root: Path, bench: str) -> list[Sample]:
    f = _annotation(bench, root, "mlvu/test-00000-of-00001.parquet")
    keys = ("question_id", "task_type", "video_name", "question", "candidates", "answer")
    rows = _parquet_rows(f, keys)
    pairs = []
    for i, row in enumerate(rows):
        qid = f.get(row, i, "question_id", "str")
        pairs.append(f"{f.get(row, i, 'task_type', 'str', qid)}-{qid}")
    by_row = len(set(pairs)) < len(pairs)
    if by_row:
        log.warning(
            "%s: (task_type, question_id) repeats, so MLVU ids are '<task_type>-<row>' "
            "(0-based file row, as ParaVT) for every row",
            f.path,
        )
    videos = _Videos()
    out = []
    for i, row in enumerate(rows):
        task = row["task_type"]
        sid = f"{task}-{i}" if by_row else pairs[i]
        rel = _relative(f, i, "video_name", f.get(row, i, "video_name", "str", sid), sid)
        raw_q = f.get(row, i, "question", "str", sid)
        stem, embedded = _stem_and_options(f, i, raw_q, sid)
        cands = [c.strip() for c in f.get(row, i, "candidates", "str_list", sid)]
        if len(cands) < 2 or not all(cands):
            raise f.error(i, "candidates", f"is {cands!r}, expected >= 2 non-empty texts", sid)
        if len(embedded) != len(cands):
            raise f.error(
                i,
                "question",
                f"embeds {len(embedded)} options but 'candidates' has {len(cands)}",
                sid,
            )
        raw_answer = f.get(row, i, "answer", "str", sid)
        answer = _mlvu_answer(f, i, raw_answer, cands, sid)
        video, missing = videos.find([root / rel, root / "video" / rel])
        extra = _extra(bench, {"task_type": task}, row["question_id"], i, missing)
        extra.update(raw_question=raw_q, raw_answer=raw_answer)
        if row.get("duration") is not None:
            extra["duration"] = _duration(f, row, i, sid)
        options = _lettered(cands, f, i, sid, "candidates")
        out.append(Sample(sid, video, stem, answer, "mcq", options=options, extra=extra))
    _check_unique_ids(f, out, "question_id")
    return out


_MMVU_FORMATS = {"multiple-choice": "mcq", "open-ended": "oe"}


def _mmvu(root: Path, bench: str) -> list[Sample]:
    f = _annotation(bench, root, "validation.json")
    rows = _json_rows(f)
    videos = _Videos()
    out = []
    for i, row in enumerate(rows):
        rid = f.get(row, i, "id", "str")
        url = f.get(row, i, "video", "str", rid)
        if "/main/" not in url:
            raise f.error(
                i,
                "video",
                f"is {url!r}, expected a URL '.../resolve/main/videos/<Subject>/<n>"
                ".mp4' (the path after /main/ locates the file under the data root)",
                rid,
            )
        rel = _relative(f, i, "video", url.split("/main/", 1)[1], rid)
        fmt = f.get(row, i, "question_type", "str", rid)
        if fmt not in _MMVU_FORMATS:
            raise f.error(
                i, "question_type", f"is {fmt!r}, expected one of {list(_MMVU_FORMATS)}", rid
            )
        meta = f.get(row, i, "metadata", "dict", rid)
        subject = meta.get("subject")
        if not isinstance(subject, str) or not subject.strip():
            raise f.error(
                i,
                "metadata.subject",
                f"is {describe_value(subject)}, expected a subject name such as 'Chemistry'",
                rid,
            )
        question = f.get(row, i, "question", "str", rid).strip()
        answer = f.get(row, i, "answer", "str", rid).strip()
        options: list[str] = []
        if fmt == "multiple-choice":
            choices = f.get(row, i, "choices", "dict", rid)
            texts = []
            for j, key in enumerate(sorted(choices)):
                v = choices[key]
                if key != string.ascii_uppercase[j] or not isinstance(v, str):
                    raise f.error(
                        i,
                        f"choices.{key}",
                        f"is {describe_value(v)}; expected string choices keyed A, B, C, ...",
                        rid,
                    )
                if v.strip() and len(texts) < j:
                    raise f.error(i, f"choices.{key}", "follows an empty choice", rid)
                if v.strip():
                    texts.append(v.strip())
            if len(texts) < 2:
                raise f.error(
                    i,
                    "choices",
                    f"has {len(texts)} non-empty choice(s), "
                    "expected at least 2 for a multiple-choice row",
                    rid,
                )
            options = _lettered(texts, f, i, rid, "choices")
            answer = _letter_answer(f, i, answer, len(texts), rid)
        elif not answer:
            raise f.error(i, "answer", "is empty; an open-ended row needs its answer text", rid)
        video, missing = videos.find([root / rel])
        categories = {"subject": subject.strip(), "question_format": fmt}
        extra = _extra(bench, categories, rid, i, missing)
        qtype = _MMVU_FORMATS[fmt]
        out.append(Sample(rid, video, question, answer, qtype, options=options, extra=extra))
    _check_unique_ids(f, out, "id")
    return out


def _charades(root: Path, bench: str) -> list[Sample]:
    f = _annotation(bench, root, "data/test-00000-of-00001.parquet")
    rows = _parquet_rows(f, ("video", "caption", "timestamp"))
    videos = _Videos()
    out = []
    for i, row in enumerate(rows):
        name = _relative(f, i, "video", f.get(row, i, "video", "str"), None)
        sid = f"{Path(name).stem}#{i}"
        caption = f.get(row, i, "caption", "str", sid).strip()
        ts = [float(x) for x in f.get(row, i, "timestamp", "number_list", sid)]
        if len(ts) != 2 or not all(math.isfinite(x) and x >= 0 for x in ts) or ts[1] <= ts[0]:
            raise f.error(
                i,
                "timestamp",
                f"is {ts}, expected [start, end] seconds with 0 <= start < end",
                sid,
            )
        start, end = ts
        video, missing = videos.find([root / "Charades_v1_480" / name])
        extra = _extra(bench, {}, None, i, missing)
        extra["key"] = f"{name}>>>{caption}>>>{[start, end]}"
        out.append(
            Sample(sid, video, caption, f"{start!r}-{end!r}", "tvg", start, end, extra=extra)
        )
    return out


def _synth(root: Path, bench: str) -> list[Sample]:
    f = _annotation(bench, root, "val.jsonl")
    f.unit = "line"
    try:
        samples, report = read_samples(f.path, video_root=str(root), keep_missing_videos=True)
    except DatasetError as e:
        raise BenchmarkFormatError(
            f"{e}; {BENCHMARK_SPECS[bench].source} writes this file"
        ) from None
    # The rows with their line numbers (read_samples has validated every line already, and
    # kept one sample per non-blank line, in order).
    rows = read_jsonl(f.path)
    line_of: dict[str, int] = {}
    for n, r in rows:
        line_of.setdefault(str(r.get("id")), n)
    if report.renamed_ids:
        old, _, where = report.renamed_ids[0]
        raise BenchmarkFormatError(
            f"{where}: field 'id' repeats id {old!r} of line {line_of.get(old)}; ids must be "
            f"unique (the runner keys results by them): fix {f.path}"
        )
    videos = _Videos()
    for s, (line, row) in zip(samples, rows, strict=True):
        # The reader resolved '~', 'file://' and absolute paths: check the row's own text.
        s.video = str(root / _relative(f, line, "video", row["video"], s.id))
        if s.question_type == "mcq":
            split = _split_embedded(s.question)
            texts = [option_text(o)[1] for o in s.options] or (split[1] if split else [])
            if len(texts) < 2:
                raise f.error(line, "options", f"is {s.options!r}, expected >= 2 options", s.id)
            _at_most_26(f, line, len(texts), s.id)
            s.answer = _letter_answer(f, line, s.answer, len(texts), s.id)
            s.options = _lettered(texts, f, line, s.id)
            if split is not None and split[0]:
                s.question = split[0]
        _, missing = videos.find([Path(s.video)])
        extra = _extra(bench, {"question_type": s.question_type}, s.id, line, missing)
        s.extra = {**s.extra, **extra}
    return samples


@dataclass(frozen=True)
class Benchmark:
    """One evaluation set: its adapter, and what the runner and the scorer need to know of it.
    A benchmark is its adapter plus one entry in :data:`BENCHMARK_SPECS`."""

    # The ``--benchmark`` name.
    name: str
    # ``load(root, name) -> list[Sample]``: the adapter (see the module docstring).
    load: Callable[[Path, str], list[Sample]]
    # Where the dataset comes from, for the "fix" part of error messages.
    source: str
    # The summary's headline metric (``paravt.eval.scoring.summarize``): 'm_avg' (mean over
    # ``task_type`` of their accuracy, MLVU's M-Avg), 'mIoU' (a tvg benchmark: also the headline
    # of an empty summary and the progress bar's label), '' = from the rows' question types.
    headline: str = ""
    # Each sample carries its video's subtitles (``extra["subtitles"]``).
    subtitles: bool = False
    # Without ``--data-root``: the embedded synthetic task's validation split (``synth``).
    embedded: bool = False


def _register(*benchmarks: Benchmark) -> dict[str, Benchmark]:
    return {b.name: b for b in benchmarks}


_VIDEOMME = "lmms-lab/Video-MME (config videomme, split test)"
BENCHMARK_SPECS: dict[str, Benchmark] = _register(
    Benchmark("videomme", _videomme, _VIDEOMME),
    Benchmark("videomme_sub", _videomme, _VIDEOMME, subtitles=True),
    Benchmark(
        "longvideobench", _longvideobench, "longvideobench/LongVideoBench (split validation)"
    ),
    Benchmark("lvbench", _lvbench, "lmms-lab/LVBench (split train)"),
    Benchmark("mlvu", _mlvu, "sy1998/MLVU_dev (split test)", headline="m_avg"),
    Benchmark("mmvu", _mmvu, "yale-nlp/MMVU (validation.json)"),
    Benchmark("charades_sta", _charades, "lmms-lab/charades_sta (split test)", headline="mIoU"),
    Benchmark(
        "synth",
        _synth,
        "the synthetic task (python -m paravt.data.synth --out <data_root>)",
        embedded=True,
    ),
    # One's own rows, in the layout training reads (data.path): synth's reader under its own
    # name, with no embedded default (--data-root is required).
    Benchmark(
        "jsonl",
        _synth,
        "your dataset folder (the val.jsonl rows python -m paravt.train reads at data.path)",
    ),
)
BENCHMARKS = tuple(BENCHMARK_SPECS)


def _family(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


def benchmark_headline(name: str) -> str:
    """The headline metric registered for benchmark ``name`` (:attr:`Benchmark.headline`);
    another spelling of a registered benchmark ("MLVU", "mlvu-dev": case, '-' and '_'
    ignored, the name starting with the part of a registered name before its first '_') gets
    that benchmark's; '' when none matches."""
    if name in BENCHMARK_SPECS:
        return BENCHMARK_SPECS[name].headline
    for b in BENCHMARK_SPECS.values():
        if b.headline and _family(name).startswith(_family(b.name.split("_")[0])):
            return b.headline
    return ""


def load_benchmark(name: str, data_root: str | Path, *, limit: int | None = None) -> list[Sample]:
    """The samples of benchmark ``name`` (one of :data:`BENCHMARKS`) unpacked at ``data_root``,
    in file order; ``limit`` keeps the first that many. The whole file is validated first.

    Raises ``ValueError`` for an unknown name or a negative limit, and
    :class:`BenchmarkFormatError` when the annotation file is absent or a row does not match its
    layout (see the module docstring). Missing videos are not errors: those samples carry
    ``extra["video_missing"] = True``.
    """
    if name not in BENCHMARK_SPECS:
        raise ValueError(f"unknown benchmark {name!r}; expected one of {list(BENCHMARK_SPECS)}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit={limit} must be >= 0 (or None for every row)")
    root = Path(data_root).expanduser().absolute()
    samples = BENCHMARK_SPECS[name].load(root, name)
    return samples if limit is None else samples[:limit]
