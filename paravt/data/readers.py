"""Dataset readers: JSONL rows or ParaVT parquet → ``list[Sample]``.

JSONL (one object per line; the synthetic task writes this)::

    {"id": "...", "video": "videos/vid_0000.mp4", "question": "...", "answer": "B",
     "question_type": "mcq" | "oe" | "tvg", "event_start": 12.5, "event_end": 16.5,
     "options": ["red square", ...]}

ParaVT parquet (``EvolvingLMMs-Lab/ParaVT``, ``paravt/rl/data/dataset.py``): columns
``prompt`` (list of ``{"role", "content"}``; the user text holds a ``<video>`` placeholder),
``videos`` (list of ``{"video": path}``, paths possibly ``file://``-prefixed) and
``extra_info`` (dict or JSON string with ``answer`` and ``question_type``; other keys are kept
in ``Sample.extra``). Question types other than mcq/tvg are open-ended (``oe``), as in the
reference reward.

Relative video paths resolve against ``video_root`` (or, when empty, the dataset file's
directory).

Validated at load, so that a bad row fails before any rollout (errors name the file, the row
and the field; ``DatasetError``):

* types: every field read is checked, and a wrong type names what was found and what is
  expected: JSONL ``video`` / ``question`` non-empty strings, ``options`` a list of texts (a
  bare string is refused: each character would become an option); parquet ``prompt`` a list
  of ``{"role", "content"}`` messages (or its JSON string), ``videos`` a non-empty list of
  ``{"video": path}`` (or path strings), ``extra_info`` an object (or its JSON string).
* ground truths: ``event_start``/``event_end`` must be finite numbers in ``[0, MAX_VIDEO_S]``;
  a tvg row needs a window (both events, ``start < end``, or an answer ``parse_window`` reads,
  e.g. ``"12.5-16.0"`` or ``[12.5, 16.0]``, in the same range), and the events are filled
  from that answer. A numeric ``duration`` field must be a video's length
  (:func:`duration_problem`). The parser is the reward's own,
  so a row that loads is a row ``score_groups`` can score.
* ids: a row's id is its ``id`` (parquet: ``extra_info.id``, ``extra_info.index``, then an
  ``id``/``index`` column); an absent, null, NaN or empty id is synthesised as
  ``"{file stem}-{row}"`` (the JSONL line number, or the 0-based parquet row), which is stable
  across processes but shifts if rows are inserted above, so ``load_samples`` warns once with the
  count. Ids key the frame budget K, the SFT records and the logs, so they must be unique: the
  first row with an id keeps it, every later row with the same id becomes ``"{id}#{row}"``
  (stable), and ``load_samples`` warns once naming the file and the rows
  (``DatasetReport.renamed_ids``). Records that refer to a duplicated id by name (SFT rows)
  match its first row.
* text: a string no UTF-8 can hold (a lone surrogate such as the JSON escape ``"\\ud83d"``,
  in any field, nested ones and keys included) is an error naming the field
  (``paravt.files.unencodable_text``): the tokenizer would raise at whatever step drew it.
* answers: a null, NaN or infinite answer is an error (it would score as the text "None" /
  "nan"); a ``[start, end]`` answer keeps its numbers exactly.
* missing videos: rows whose video file is missing are DROPPED (not fatal; a partially synced
  video tree never stops a run) and counted in ``DatasetReport.missing_videos``;
  ``load_samples`` warns ONCE with the count and the first few paths. Dropping at load, rather
  than letting the agent loop skip the row at each rollout, keeps every sampled group usable.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import stat
import string
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from paravt.answers import normalize_text, option_text, options_from_question, parse_window
from paravt.files import JsonlError, NotRegularFile, read_jsonl, unencodable_text
from paravt.types import Sample

log = logging.getLogger("paravt.data")

QUESTION_TYPES = ("mcq", "oe", "tvg")
_SHOW_MISSING = 5


class DatasetError(ValueError):
    """A dataset file or row is malformed; the message names the file, the row and the key."""


@dataclass
class DatasetReport:
    """What ``read_samples`` did with a dataset file (``load_samples`` warns from it)."""

    file: str  # the file read (a directory argument resolved to its split file)
    rows: int = 0  # valid rows in the file, before dropping missing videos and max_samples
    missing_videos: list[str] = field(default_factory=list)  # one path per dropped row
    synthesized_ids: list[str] = field(default_factory=list)  # ids the reader made up
    # (original id, new id, where) for every later row of a duplicated id
    renamed_ids: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def n_missing(self) -> int:
        return len(self.missing_videos)


class _Row(NamedTuple):
    sample: Sample
    where: str  # "file:line" or "file row i", for errors
    row: int  # the JSONL line number or the 0-based parquet row
    id_synthesized: bool


def _resolve_file(path: Path, split: str) -> Path:
    if path.is_file():
        return path
    if not path.exists():
        raise DatasetError(f"dataset path {path} does not exist")
    cands = _split_candidates(path, split)
    if len(cands) == 1:
        return cands[0]
    raise DatasetError(
        f"dataset directory {path} has no {split}.jsonl or {split}.parquet"
        + (f" and several candidates {[c.name for c in cands]}; pass one file" if cands else "")
    )


def has_split(path: str | Path, split: str) -> bool:
    """Whether ``path`` holds any file for ``split`` (a file always counts: it is every
    split). Lets callers treat an absent split as optional while a malformed or ambiguous one
    (several candidates) still raises from :func:`load_samples`."""
    p = Path(path)
    return p.is_file() or (p.is_dir() and bool(_split_candidates(p, split)))


def _split_candidates(path: Path, split: str) -> list[Path]:
    """Files of directory ``path`` for ``split``: ``{split}.jsonl`` / ``{split}.parquet`` when
    present (the first one), else every ``*{split}*`` parquet / JSONL file."""
    for name in (f"{split}.jsonl", f"{split}.parquet"):
        if (path / name).is_file():
            return [path / name]
    return sorted(path.glob(f"*{split}*.parquet")) + sorted(path.glob(f"*{split}*.jsonl"))


def _video_path(raw: str, root: Path) -> str:
    p = raw[len("file://") :] if raw.startswith("file://") else raw
    p = os.path.expanduser(p)
    return p if os.path.isabs(p) else str(root / p)


def _float_or_none(v: Any, where: str, key: str) -> float | None:
    if v is None:
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise DatasetError(f"{where}: '{key}' = {v!r} is not a number") from None
    if not math.isfinite(x):
        raise DatasetError(f"{where}: '{key}' = {v!r} is not a finite number of seconds")
    return x


def describe_value(v: Any) -> str:
    """What a wrong-typed value was, for messages: ``int 5``, ``str 'RED'``, ``null`` (also
    ``paravt.eval.benchmarks``' messages)."""
    if v is None:
        return "null"
    r = repr(v)
    return f"{type(v).__name__} {r if len(r) <= 80 else r[:77] + '...'}"


def _wrong(where: str, key: str, v: Any, expected: str) -> DatasetError:
    return DatasetError(f"{where}: '{key}' is {describe_value(v)}, expected {expected}")


def _text(row: dict, where: str, key: str, what: str) -> str:
    """``row[key]``, which must be a non-empty string (``what`` says what it holds)."""
    v = row[key]
    if not isinstance(v, str) or not v.strip():
        raise _wrong(where, key, v, f"a non-empty string ({what})")
    return v


def _options(v: Any, where: str) -> list[str]:
    """A JSONL row's ``options``: absent/null, or a list of texts (numbers are written as
    text). A bare string is refused: iterating it would make each character an option."""
    if v is None:
        return []
    expected = 'a list of option texts, e.g. ["red square", "blue circle"] (or no \'options\')'
    if not isinstance(v, list):
        raise _wrong(where, "options", v, expected)
    for j, o in enumerate(v):
        if not isinstance(o, (str, int, float)) or isinstance(o, bool):
            raise _wrong(where, f"options[{j}]", o, "an option text (a string)")
    if len(v) > 26:  # the prompt letters them A..Z: a 27th would be lettered '['
        raise DatasetError(
            f"{where}: 'options' has {len(v)} options, more than the 26 letters A..Z can name; "
            "split the row or drop options"
        )
    return [str(o) for o in v]


def _json_field(v: Any, where: str, key: str, expected: str) -> Any:
    """A parquet cell that may hold its value as a JSON string (``prompt``, ``extra_info``)."""
    if not isinstance(v, str):
        return v
    try:
        return json.loads(v)
    except json.JSONDecodeError as e:
        raise DatasetError(
            f"{where}: '{key}' is not valid JSON ({e.msg}): {describe_value(v)}; "
            f"expected {expected}"
        ) from None


_PROMPT = 'a list of {"role": ..., "content": ...} messages (or its JSON string)'


def _messages(v: Any, where: str) -> list[dict]:
    """A ParaVT row's ``prompt``: a list of ``{"role", "content"}`` messages."""
    v = _json_field(v, where, "prompt", _PROMPT)
    if not isinstance(v, list):
        raise _wrong(where, "prompt", v, _PROMPT)
    for j, m in enumerate(v):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _wrong(where, f"prompt[{j}]", m, 'a {"role": ..., "content": ...} message')
    return v


def _extra_info(v: Any, where: str) -> dict:
    """A ParaVT row's ``extra_info``: an object (or its JSON string) holding ``answer``."""
    expected = "an object (or its JSON string) with 'answer' and 'question_type'"
    v = _json_field(v, where, "extra_info", expected)
    if v is None:
        v = {}
    if not isinstance(v, dict):
        raise _wrong(where, "extra_info", v, expected)
    if "answer" not in v:
        raise DatasetError(f"{where}: 'extra_info' has no 'answer'; add the ground truth there")
    return dict(v)


def _video_list(v: Any, where: str) -> list[str]:
    """A ParaVT row's ``videos``: a non-empty list of ``{"video": path}`` (or path strings)."""
    expected = 'a list of {"video": <path>} entries (or of path strings)'
    if not isinstance(v, list):
        raise _wrong(where, "videos", v, expected)
    if not v:
        raise DatasetError(f"{where}: 'videos' is empty; expected {expected}")
    out = []
    for j, e in enumerate(v):
        path = e.get("video") if isinstance(e, dict) else e
        if not isinstance(path, str) or not path.strip():
            raise _wrong(where, f"videos[{j}]", e, '{"video": <path>} or a path string')
        out.append(path)
    return out


def _id_or_none(*values: Any) -> str | None:
    """The first usable id: not None, not NaN (pandas' missing value), not empty. An integral
    float is written as an int: pandas stores an int column with gaps as float (7 → 7.0)."""
    for v in values:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if (sid := str(v).strip()) != "":
            return sid
    return None


def _checked(sample: Sample, where: str) -> Sample:
    """Validate the ground truth of ``sample`` (see the module docstring); fill a tvg window."""
    start, end = sample.event_start, sample.event_end
    if (start is None) != (end is None):
        missing = "event_end" if end is None else "event_start"
        raise DatasetError(f"{where}: '{missing}' is missing while its pair is set; set both")
    if not sample.answer.strip() and not (sample.question_type == "tvg" and start is not None):
        raise DatasetError(f"{where}: 'answer' is empty; every row needs a ground-truth answer")
    for key, t in (("event_start", start), ("event_end", end)):
        if t is not None and not 0.0 <= t <= MAX_VIDEO_S:
            raise DatasetError(f"{where}: '{key}' = {t} s is {_OUT_OF_RANGE}")
    _check_duration(sample.extra.get("duration"), where)
    if sample.question_type == "mcq":
        _check_mcq_answer(sample, where)
    if sample.question_type != "tvg":
        return sample
    if start is None:
        win = parse_window(sample.answer)
        if win is None:
            raise DatasetError(
                f"{where}: tvg 'answer' {sample.answer!r} is not a finite time window with "
                "start < end (write 'start-end' in seconds, e.g. '12.5-16.0', or set "
                "event_start/event_end)"
            )
        for t in win:  # the window the answer gives: the same range as the events'
            if not 0.0 <= t <= MAX_VIDEO_S:
                raise DatasetError(
                    f"{where}: tvg 'answer' {sample.answer!r} has the time {t:g} s, which is "
                    f"{_OUT_OF_RANGE}"
                )
        sample.event_start, sample.event_end = win
    elif not start < end:  # type: ignore[operator]
        raise DatasetError(
            f"{where}: tvg window event_start={start} event_end={end} is empty; need start < end"
        )
    return sample


#: The longest video a row's times may point into (24 h): a larger time is a unit error
#: (milliseconds written as seconds), not a video.
MAX_VIDEO_S = 24 * 3600.0
_OUT_OF_RANGE = (
    f"outside [0, {MAX_VIDEO_S:.0f}] s (seconds from the video's start; a negative time or one "
    "past a day is a unit or sign error)"
)


def duration_problem(value: Any) -> str:
    """Why a row's numeric ``duration`` (seconds; a benchmark's or a data set's annotation)
    is no video's length ("" when it is one, or when it is no number: a category such as
    Video-MME's ``"short"``). A negative, zero, NaN, infinite or over-a-day duration would
    reach the results and the viewer's time axis as if it were the video's."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return ""
    if math.isfinite(value) and 0.0 < value <= MAX_VIDEO_S:
        return ""
    return (
        f"is {value!r}, not a video's length: expected a finite number of seconds in "
        f"(0, {MAX_VIDEO_S:.0f}]; fix the row or drop the field"
    )


def _check_duration(value: Any, where: str) -> None:
    if why := duration_problem(value):
        raise DatasetError(f"{where}: 'duration' {why}")


def _check_mcq_answer(sample: Sample, where: str) -> None:
    """An mcq answer names an option: the letter of one (``"B"``, any case) or the text of one.
    Checked when the options are known (``options``, or listed in the question one per line as
    the evaluation's readers parse them): an answer naming none would score 0 on every rollout,
    whatever the policy does. Without known options only an empty answer is refused."""
    opts = sample.options or options_from_question(sample.question)
    if not opts:
        return
    a = sample.answer.strip()
    letters = string.ascii_uppercase[: len(opts)]
    if len(a) == 1 and a.upper() in letters:
        return
    texts = {normalize_text(option_text(o)[1]) for o in opts} | {normalize_text(o) for o in opts}
    if normalize_text(a) in texts:
        return
    raise DatasetError(
        f"{where}: mcq 'answer' {sample.answer!r} names none of its {len(opts)} options "
        f"(expected one letter of {list(letters)} or an option's text); fix the answer or the "
        "options"
    )


def _answer_text(ans: Any, where: str) -> str:
    """The ground-truth answer as text; ``None`` and non-finite numbers are errors. A tvg
    ``[start, end]`` keeps its numbers exactly (``repr``), never rounded."""
    if ans is None:
        raise DatasetError(f"{where}: 'answer' is null; every row needs a ground-truth answer")
    if isinstance(ans, float) and not math.isfinite(ans):
        raise DatasetError(f"{where}: 'answer' is {ans!r}, not a usable ground truth")
    if hasattr(ans, "tolist"):  # numpy arrays from parquet
        ans = ans.tolist()
    if (
        isinstance(ans, (list, tuple))
        and len(ans) == 2
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in ans)
    ):
        return f"{float(ans[0])!r}-{float(ans[1])!r}"
    return str(ans)


def _jsonl_samples(file: Path, root: Path) -> list[_Row]:
    out = []
    try:
        lines = read_jsonl(file)
    except (JsonlError, NotRegularFile) as e:  # a bad line; a FIFO in the file's place
        raise DatasetError(str(e)) from None
    for lineno, row in lines:
        where = f"{file}:{lineno}"
        for key in ("video", "question", "answer"):
            if key not in row:
                raise DatasetError(f"{where}: missing required key '{key}'")
        qtype = row.get("question_type", "oe")
        if qtype not in QUESTION_TYPES:
            raise DatasetError(
                f"{where}: question_type '{qtype}' is not one of {list(QUESTION_TYPES)}"
            )
        known = {"id", "video", "question", "answer", "question_type", "options"}
        known |= {"event_start", "event_end"}
        sid = _id_or_none(row.get("id"))
        sample = Sample(
            id=sid if sid is not None else f"{file.stem}-{lineno}",
            video=_video_path(_text(row, where, "video", "the video's path"), root),
            question=_text(row, where, "question", "the question"),
            answer=_answer_text(row["answer"], where),
            question_type=qtype,
            event_start=_float_or_none(row.get("event_start"), where, "event_start"),
            event_end=_float_or_none(row.get("event_end"), where, "event_end"),
            options=_options(row.get("options"), where),
            extra={k: v for k, v in row.items() if k not in known},
        )
        out.append(_Row(_checked(sample, where), where, lineno, sid is None))
    return out


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, {"type": "video"}]
        return "".join(c.get("text", "") for c in content if isinstance(c, dict))
    return "" if content is None else str(content)


def _parquet_samples(file: Path, root: Path) -> list[_Row]:
    import pyarrow.parquet as pq

    table = pq.read_table(str(file))
    cols = set(table.schema.names)
    for key in ("prompt", "videos", "extra_info"):
        if key not in cols:
            raise DatasetError(
                f"{file}: parquet has no '{key}' column (columns: {sorted(cols)}); expected the "
                "ParaVT RL layout prompt/videos/extra_info"
            )
    out = []
    for i, row in enumerate(table.to_pylist()):
        where = f"{file} row {i}"
        prompt = _messages(row["prompt"], where)
        extra = _extra_info(row["extra_info"], where)
        videos = _video_list(row["videos"], where)
        # Arrow strings are UTF-8, but a JSON-string cell's "\ud83d" escape parses to a lone
        # surrogate: refused here, as read_jsonl refuses it in a JSONL row.
        if bad := unencodable_text({**row, "prompt": prompt, "extra_info": extra}):
            raise DatasetError(f"{where}: {bad}")
        system = [_text_of(m.get("content")) for m in prompt if m.get("role") == "system"]
        user = [_text_of(m.get("content")) for m in prompt if m.get("role") == "user"]
        question = "\n".join(u.replace("<video>", "").strip() for u in user).strip()
        raw_type = str(extra.get("question_type", "oe"))
        qtype = raw_type if raw_type in QUESTION_TYPES else "oe"
        answer = _answer_text(extra.pop("answer"), where)
        # A struct extra_info carries every key of every row: absent ones read as None.
        sid = _id_or_none(extra.get("id"), extra.get("index"), row.get("id"), row.get("index"))
        extra.update(
            {"raw_question_type": raw_type, "videos": [_video_path(v, root) for v in videos]}
        )
        if system:
            extra["system_prompt"] = "\n".join(system)
        sample = Sample(
            id=sid if sid is not None else f"{file.stem}-{i}",
            video=_video_path(videos[0], root),
            question=question,
            answer=answer,
            question_type=qtype,
            extra=extra,
        )
        out.append(_Row(_checked(sample, where), where, i, sid is None))
    return out


def _unique_ids(rows: list[_Row]) -> list[tuple[str, str, str]]:
    """Make ids unique in place: the first row keeps an id, later rows get ``"{id}#{row}"``
    (``_Row.row``: the JSONL line or parquet row number). Returns ``(old, new, where)`` per
    renamed row."""
    seen = {r.sample.id for r in rows}
    first: set[str] = set()
    renamed = []
    for r in rows:
        sid = r.sample.id
        if sid not in first:
            first.add(sid)
            continue
        new = f"{sid}#{r.row}"
        while new in seen:
            new += f"#{r.row}"
        seen.add(new)
        r.sample.id = new
        renamed.append((sid, new, r.where))
    return renamed


def read_samples(
    path: str | Path,
    *,
    video_root: str = "",
    split: str = "train",
    max_samples: int = 0,
    keep_missing_videos: bool = False,
) -> tuple[list[Sample], DatasetReport]:
    """Like ``load_samples`` but silent; returns ``(samples, report)``.

    ``keep_missing_videos=True`` keeps rows whose video is missing (still listed in
    ``report.missing_videos``): the evaluation reads the synthetic task this way and counts
    such rows as errors instead of shrinking the benchmark."""
    file = _resolve_file(Path(path), split)
    root = Path(video_root) if video_root else file.parent
    if file.suffix == ".parquet":
        rows = _parquet_samples(file, root)
    elif file.suffix in (".jsonl", ".json"):
        rows = _jsonl_samples(file, root)
    else:
        raise DatasetError(f"{file}: unknown dataset format (expected .jsonl or .parquet)")
    renamed = _unique_ids(rows)
    report = DatasetReport(str(file), rows=len(rows), renamed_ids=renamed)
    report.synthesized_ids = [r.sample.id for r in rows if r.id_synthesized]
    exists: dict[str, bool] = {}
    kept = []
    for r in rows:
        s = r.sample
        if exists.setdefault(s.video, os.path.isfile(s.video)):
            kept.append(s)
        else:
            report.missing_videos.append(s.video)
            if keep_missing_videos:
                kept.append(s)
    if max_samples > 0:
        kept = kept[:max_samples]
    return kept, report


def video_path_problem(path: str) -> str:
    """What keeps ``path`` from being read as a video file ("" for a regular file), without
    opening it (opening a FIFO blocks until a writer appears): ``"not found"``, or what it is
    instead ("is a directory", "is a symlink loop", "is a FIFO (named pipe)", ...). The
    evaluation's error rows quote it (``paravt.eval.runner``)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        try:  # a dangling symlink is "not found" too, but say so
            os.lstat(path)
        except OSError:
            return NOT_FOUND
        return f"is a symlink to a missing file ({os.readlink(path)})"
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symlink loop (it links back to itself); point it at the video file"
        return f"cannot be read ({e.strerror})"
    mode = st.st_mode
    if stat.S_ISREG(mode):
        return "" if os.access(path, os.R_OK) else "cannot be read (permission denied)"
    if stat.S_ISDIR(mode):
        return "is a directory, not a video file; point the row at the file inside it"
    if stat.S_ISFIFO(mode):
        return "is a FIFO (named pipe), not a video file: it cannot be probed or seeked"
    if stat.S_ISSOCK(mode):
        return "is a socket, not a video file"
    return "is a device, not a video file"


#: :func:`video_path_problem` of a path that does not exist.
NOT_FOUND = "not found"


def _warn(msg: str) -> None:
    log.warning(msg)
    warnings.warn(msg, stacklevel=3)


def load_samples(
    path: str | Path, *, video_root: str = "", split: str = "train", max_samples: int = 0
) -> list[Sample]:
    """Samples of ``path`` (a ``.jsonl``/``.parquet`` file, or a directory holding
    ``{split}.jsonl`` / ``{split}.parquet``), video paths resolved and checked.

    Rows whose video file is missing are dropped with one ``UserWarning`` naming the count and
    the first few paths; synthesised ids get one ``UserWarning`` too (``read_samples`` returns
    both in its ``DatasetReport`` instead). ``max_samples > 0`` keeps the first that many usable
    rows. Raises ``DatasetError`` for a malformed file or row (naming the file, row and key):
    see the module docstring for what is validated.
    """
    samples, rep = read_samples(path, video_root=video_root, split=split, max_samples=max_samples)
    if rep.synthesized_ids:
        _warn(
            f"{rep.file}: {len(rep.synthesized_ids)} of {rep.rows} row(s) have no id; "
            f"synthesised as '<file stem>-<row>' (e.g. {rep.synthesized_ids[:_SHOW_MISSING]}), "
            "stable unless rows are inserted above them; add an 'id' to each row"
        )
    if rep.renamed_ids:
        _warn(
            f"{rep.file}: {len(rep.renamed_ids)} row(s) repeat an earlier row's id and were "
            "renamed '<id>#<row>' (e.g. "
            + ", ".join(f"{o!r} -> {n!r} at {w}" for o, n, w in rep.renamed_ids[:_SHOW_MISSING])
            + "); give each row its own 'id'"
        )
    if rep.missing_videos:
        uniq = list(dict.fromkeys(rep.missing_videos))
        # Each named as what it is: a FIFO, a directory or a device is no "missing" file.
        shown = [f"{v} ({video_path_problem(v) or 'unreadable'})" for v in uniq[:_SHOW_MISSING]]
        _warn(
            f"{rep.file}: skipped {rep.n_missing} row(s) whose video is missing or no file (of "
            f"{rep.rows}; {len(uniq)} path(s), e.g. {shown}); check video_root"
        )
    log.info("%s: %d sample(s) loaded", rep.file, len(samples))
    return samples
