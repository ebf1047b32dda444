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
directory). Rows whose video is missing are skipped with ONE warning giving the count and the
first few paths; a partially synced video tree never stops a run.
"""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any

from paravt.types import Sample

log = logging.getLogger("paravt.data")

QUESTION_TYPES = ("mcq", "oe", "tvg")
_SHOW_MISSING = 5


class DatasetError(ValueError):
    """A dataset file or row is malformed; the message names the file, the row and the key."""


def _resolve_file(path: Path, split: str) -> Path:
    if path.is_file():
        return path
    if not path.exists():
        raise DatasetError(f"dataset path {path} does not exist")
    for name in (f"{split}.jsonl", f"{split}.parquet"):
        if (path / name).is_file():
            return path / name
    cands = sorted(path.glob(f"*{split}*.parquet")) + sorted(path.glob(f"*{split}*.jsonl"))
    if len(cands) == 1:
        return cands[0]
    raise DatasetError(
        f"dataset directory {path} has no {split}.jsonl or {split}.parquet"
        + (f" and several candidates {[c.name for c in cands]}; pass one file" if cands else "")
    )


def _video_path(raw: str, root: Path) -> str:
    p = raw[len("file://") :] if raw.startswith("file://") else raw
    p = os.path.expanduser(p)
    return p if os.path.isabs(p) else str(root / p)


def _float_or_none(v: Any, where: str, key: str) -> float | None:
    if v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        raise DatasetError(f"{where}: '{key}' = {v!r} is not a number") from None


def _answer_text(ans: Any) -> str:
    # tvg answers sometimes come as [start, end].
    if (
        isinstance(ans, (list, tuple))
        and len(ans) == 2
        and all(isinstance(x, (int, float)) for x in ans)
    ):
        return f"{float(ans[0]):.1f}-{float(ans[1]):.1f}"
    return str(ans)


_SPAN = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(?:-|to|,)\s*(-?\d+(?:\.\d+)?)\s*$")


def _jsonl_samples(file: Path, root: Path) -> list[Sample]:
    out = []
    with open(file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{file}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
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
            out.append(
                Sample(
                    id=str(row.get("id", f"{file.stem}-{lineno}")),
                    video=_video_path(str(row["video"]), root),
                    question=str(row["question"]),
                    answer=_answer_text(row["answer"]),
                    question_type=qtype,
                    event_start=_float_or_none(row.get("event_start"), where, "event_start"),
                    event_end=_float_or_none(row.get("event_end"), where, "event_end"),
                    options=[str(o) for o in row.get("options") or []],
                    extra={k: v for k, v in row.items() if k not in known},
                )
            )
    return out


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, {"type": "video"}]
        return "".join(c.get("text", "") for c in content if isinstance(c, dict))
    return "" if content is None else str(content)


def _parquet_samples(file: Path, root: Path) -> list[Sample]:
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
        prompt = row["prompt"]
        if isinstance(prompt, str):
            prompt = json.loads(prompt)
        extra = row["extra_info"]
        if isinstance(extra, str):
            try:
                extra = json.loads(extra)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: extra_info is not valid JSON ({e.msg})") from None
        extra = dict(extra or {})
        if "answer" not in extra:
            raise DatasetError(f"{where}: extra_info has no 'answer'")
        videos = [v["video"] if isinstance(v, dict) else v for v in row["videos"] or []]
        if not videos:
            raise DatasetError(f"{where}: 'videos' is empty")
        system = [_text_of(m.get("content")) for m in prompt if m.get("role") == "system"]
        user = [_text_of(m.get("content")) for m in prompt if m.get("role") == "user"]
        question = "\n".join(u.replace("<video>", "").strip() for u in user).strip()
        raw_type = str(extra.get("question_type", "oe"))
        qtype = raw_type if raw_type in QUESTION_TYPES else "oe"
        answer = _answer_text(extra.pop("answer"))
        start = end = None
        if qtype == "tvg" and (m := _SPAN.match(answer)):
            start, end = float(m.group(1)), float(m.group(2))
        sid = extra.get("id", extra.get("index", row.get("id", f"{file.stem}-{i}")))
        extra.update(
            {"raw_question_type": raw_type, "videos": [_video_path(v, root) for v in videos]}
        )
        if system:
            extra["system_prompt"] = "\n".join(system)
        out.append(
            Sample(
                id=str(sid),
                video=_video_path(str(videos[0]), root),
                question=question,
                answer=answer,
                question_type=qtype,
                event_start=start,
                event_end=end,
                extra=extra,
            )
        )
    return out


def read_samples(
    path: str | Path, *, video_root: str = "", split: str = "train", max_samples: int = 0
) -> tuple[list[Sample], list[str]]:
    """Like ``load_samples`` but silent; returns ``(samples, missing_video_paths)``."""
    file = _resolve_file(Path(path), split)
    root = Path(video_root) if video_root else file.parent
    if file.suffix == ".parquet":
        samples = _parquet_samples(file, root)
    elif file.suffix in (".jsonl", ".json"):
        samples = _jsonl_samples(file, root)
    else:
        raise DatasetError(f"{file}: unknown dataset format (expected .jsonl or .parquet)")
    exists: dict[str, bool] = {}
    kept, missing = [], []
    for s in samples:
        ok = exists.setdefault(s.video, os.path.isfile(s.video))
        (kept if ok else missing).append(s)
    if max_samples > 0:
        kept = kept[:max_samples]
    return kept, [s.video for s in missing]


def load_samples(
    path: str | Path, *, video_root: str = "", split: str = "train", max_samples: int = 0
) -> list[Sample]:
    """Samples of ``path`` (a ``.jsonl``/``.parquet`` file, or a directory holding
    ``{split}.jsonl`` / ``{split}.parquet``), video paths resolved and checked.

    Rows whose video file is missing are skipped with one ``UserWarning`` naming the count and
    the first few paths. ``max_samples > 0`` keeps the first that many usable rows. Raises
    ``DatasetError`` for a malformed file (naming the file, row and key).
    """
    samples, missing = read_samples(
        path, video_root=video_root, split=split, max_samples=max_samples
    )
    if missing:
        uniq = list(dict.fromkeys(missing))
        msg = (
            f"{path}: skipped {len(missing)} row(s) whose video is missing "
            f"({len(uniq)} file(s), e.g. {uniq[:_SHOW_MISSING]}); check video_root"
        )
        log.warning(msg)
        warnings.warn(msg, stacklevel=2)
    return samples
