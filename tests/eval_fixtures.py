"""Tiny benchmark datasets in each benchmark's exact on-disk format, for the evaluation tests.

Not a test module: tests import it by name (pytest puts ``tests/`` on ``sys.path``).

* ``write_benchmark(name, root, video=True) -> list[dict]`` writes benchmark ``name`` (one of
  ``paravt.eval.benchmarks.BENCHMARKS``) with ``root`` as its data root, in the layout the
  adapter documents: the annotation file with the real field names and Arrow types, real tiny
  H.264 videos (8 s, 4 fps, 128x160, frames carry their index: ``paravt.data.synth``) at the
  documented paths (including each adapter's fallback path, e.g. Video-MME ``.mkv``, LVBench
  ``videos/``, MLVU ``video/``), and one row per benchmark whose video is deliberately absent.
  ``video=False`` writes no video at all. Returns the rows as stored, in file order (Charades
  ``timestamp`` already rounded to float16).
* ``write_longvideobench_json(root, video=True)`` writes LongVideoBench's ``lvb_val.json`` form
  (no parquet) of the same questions.
* ``expected_samples(name, root) -> list[dict]``: what ``load_benchmark(name, root)`` must give,
  hand-written (an oracle, not derived from the adapter): keys ``id, video`` (absolute path),
  ``question, options, answer, question_type, event_start, event_end, categories,
  video_missing`` and ``extra`` (a subset of ``Sample.extra``: ``subtitles``, ``duration``).
* ``write_all(root, video=True) -> dict[str, Path]``: every benchmark under ``root/<dir>``;
  maps each name of ``BENCHMARKS`` to its data root (videomme and videomme_sub share one).

Video-MME's first video has an ``.srt`` with ``<font>`` tags (and an ``<i>`` tag), the second
none. Writing everything takes well under a second: the clip is encoded once per process and
copied.
"""

from __future__ import annotations

import copy
import json
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

CLIP_SECONDS = 8.0
CLIP_FPS = 4.0
CLIP_SIZE = (128, 160)


@cache
def _clip(suffix: str) -> bytes:
    """One real H.264 clip per container (.mp4, .mkv), encoded once per process."""
    from paravt.data.synth import write_index_clip

    with tempfile.TemporaryDirectory(prefix="paravt-eval-clip-") as d:
        path = Path(d) / f"clip{suffix}"
        write_index_clip(path, duration=CLIP_SECONDS, fps=CLIP_FPS, size=CLIP_SIZE)
        return path.read_bytes()


def _put_video(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_clip(".mkv" if path.suffix == ".mkv" else ".mp4"))


def _write_parquet(path: Path, rows: list[dict], schema: pa.Schema) -> list[dict]:
    cols = {}
    for f in schema:
        values = [r[f.name] for r in rows]
        if f.type == pa.list_(pa.float16()):  # Arrow takes half floats from numpy only
            values = [np.asarray(v, dtype=np.float16) for v in values]
        cols[f.name] = pa.array(values, type=f.type)
    table = pa.table(cols, schema=schema)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return table.to_pylist()


# --------------------------------------------------------------------------------- tables
# Each benchmark: (rows as written, expected Sample fields, video files relative to the root).
# Expected fields left out default to: options [], question_type "mcq", events None,
# video_missing False, extra {}.

_VIDEOMME_ROWS = [
    {
        "video_id": "001",
        "duration": "short",
        "domain": "Knowledge",
        "sub_category": "Humanity & History",
        "url": "https://www.youtube.com/watch?v=fFjv93ACGo8",
        "videoID": "fFjv93ACGo8",
        "question_id": "001-1",
        "task_type": "Counting Problem",
        "question": "When demonstrating the Germany modern Christmas tree is initially decorated "
        "with apples, candles and berries, which kind of the decoration has the largest number?",
        "options": [
            "A. Apples.",
            "B. Candles.",
            "C. Berries.",
            "D. The three kinds are of the same number.",
        ],
        "answer": "C",
    },
    {
        "video_id": "001",
        "duration": "short",
        "domain": "Knowledge",
        "sub_category": "Humanity & History",
        "url": "https://www.youtube.com/watch?v=fFjv93ACGo8",
        "videoID": "fFjv93ACGo8",
        "question_id": "001-2",
        "task_type": "Information Synopsis",
        "question": "What is the video mainly about?",
        "options": [
            "A. Baking bread.",
            "B. The history of the Christmas tree.",
            "C. A football match.",
            "D. Repairing a car.",
        ],
        "answer": "B",
    },
    {
        "video_id": "002",
        "duration": "medium",
        "domain": "Sports Competition",
        "sub_category": "Basketball",
        "url": "https://www.youtube.com/watch?v=Xy7-kPq_2aB",
        "videoID": "Xy7-kPq_2aB",
        "question_id": "002-1",
        "task_type": "Action Recognition",
        "question": "What does the player in red do right after the whistle?",
        "options": ["A. Shoots.", "B. Passes.", "C. Sits down.", "D. Argues with the referee."],
        "answer": "A",
    },
    {
        "video_id": "003",
        "duration": "long",
        "domain": "Film & Television",
        "sub_category": "Movie & TV Show",
        "url": "https://www.youtube.com/watch?v=missingVid03",
        "videoID": "missingVid03",
        "question_id": "003-1",
        "task_type": "Temporal Reasoning",
        "question": "What happens after the door closes?",
        "options": ["A. It rains.", "B. A dog barks.", "C. The lights go out.", "D. Nothing."],
        "answer": "D",
    },
]
# The card's 11 columns in its order (the rows' key order): all strings but options.
_VIDEOMME_SCHEMA = pa.schema(
    [(k, pa.list_(pa.string()) if k == "options" else pa.string()) for k in _VIDEOMME_ROWS[0]]
)
_VIDEOMME_SRT = (
    "1\n00:00:01,240 --> 00:00:06,879\n"
    '<font color="white" size=".72c">when we are about to do something</font>\n\n'
    "2\n00:00:04,160 --> 00:00:10,519\n"
    '<font color="white" size=".72c">new</font>\n\n'
    "3\n00:00:06,000 --> 00:00:07,500\n"
    '<font color="white" size=".72c">the tree</font>\n'
    '<font color="white" size=".72c"><i>is decorated</i></font>\n'
)
_VIDEOMME_SUBTITLES = "when we are about to do something\nnew\nthe tree\nis decorated"


def _videomme_expected(sub: bool) -> list[dict]:
    videos = {
        "fFjv93ACGo8": ("data/fFjv93ACGo8.mp4", False, _VIDEOMME_SUBTITLES),
        "Xy7-kPq_2aB": ("data/Xy7-kPq_2aB.mkv", False, ""),
        "missingVid03": ("data/missingVid03.mp4", True, ""),
    }
    out = []
    for r in _VIDEOMME_ROWS:
        video, missing, subs = videos[r["videoID"]]
        out.append(
            {
                "id": r["question_id"],
                "video": video,
                "question": r["question"],
                "options": list(r["options"]),  # already exactly one "A. " prefix each
                "answer": r["answer"],
                "categories": {
                    k: r[k] for k in ("duration", "domain", "sub_category", "task_type")
                },
                "video_missing": missing,
                "extra": {"subtitles": subs} if sub else {},
            }
        )
    return out


def _write_videomme(root: Path, video: bool) -> list[dict]:
    rows = _write_parquet(
        root / "videomme/test-00000-of-00001.parquet", _VIDEOMME_ROWS, _VIDEOMME_SCHEMA
    )
    if video:
        _put_video(root / "data/fFjv93ACGo8.mp4")
        _put_video(root / "data/Xy7-kPq_2aB.mkv")
    (root / "subtitle").mkdir(parents=True, exist_ok=True)
    (root / "subtitle/fFjv93ACGo8.srt").write_text(_VIDEOMME_SRT, encoding="utf-8")
    return rows


_LVB_ROWS = [
    {
        "video_id": "86CxyhFV9MI",
        "id": "86CxyhFV9MI_0",
        "video_path": "86CxyhFV9MI.mp4",
        "subtitle_path": "86CxyhFV9MI_en.json",
        "correct_choice": 1,
        "question": "In the video, which subtitles appear at the same time as the man with black "
        "hair, dressed in grey clothes with black sleeves, on stage?",
        "option0": "promisc has come to an end, in and run away countless times, i was just "
        "scared, i still",
        "option1": "run away countless times, i was just scared, i still and front of our crown, "
        "like a world of souls,",
        "option2": "promisc has come to an end, in and front of our crown, like a world of souls,",
        "option3": "promisc has come to an end, in and captain of the godson, three three three "
        "three three three",
        "option4": "N/A",
        "duration": 190.16,
        "duration_group": 600,
        "question_category": "TOS",
        "topic_category": "NP-News-Programs",
        "starting_timestamp_for_subtitles": 0.0,
    },
    {
        "video_id": "Zq3vTf0aBcD",
        "id": "Zq3vTf0aBcD_1",
        "video_path": "Zq3vTf0aBcD.mp4",
        "subtitle_path": "Zq3vTf0aBcD_en.json",
        "correct_choice": 4,
        "question": "What does the woman in the green coat pick up after the speech?",
        "option0": "A cup",
        "option1": "A book",
        "option2": "A phone",
        "option3": "A pen",
        "option4": "A hat",
        "duration": 3001.5,
        "duration_group": 3600,
        "question_category": "E2O",
        "topic_category": "KH-Knowledge-History",
        "starting_timestamp_for_subtitles": 12.0,
    },
    {
        "video_id": "aaaaBBBB123",
        "id": "aaaaBBBB123_0",
        "video_path": "aaaaBBBB123.mp4",
        "subtitle_path": "aaaaBBBB123_en.json",
        "correct_choice": 0,
        "question": "Which object is on the table when the subtitle 'hello' appears?",
        "option0": "A lamp",
        "option1": "A plate",
        "option2": "A laptop",
        "option3": "Nothing",
        "option4": "N/A",
        "duration": 12.0,
        "duration_group": 15,
        "question_category": "S2A",
        "topic_category": "LR-Life-Record",
        "starting_timestamp_for_subtitles": 0.0,
    },
]
_LVB_SCHEMA = pa.schema(
    [
        ("video_id", pa.string()),
        ("id", pa.string()),
        ("video_path", pa.string()),
        ("subtitle_path", pa.string()),
        ("correct_choice", pa.int64()),
        ("question", pa.string()),
        *[(f"option{k}", pa.string()) for k in range(5)],
        ("duration", pa.float64()),
        ("duration_group", pa.int64()),
        ("question_category", pa.string()),
        ("topic_category", pa.string()),
        ("starting_timestamp_for_subtitles", pa.float64()),
    ]
)


def _lvb_expected() -> list[dict]:
    out = []
    for r, letter, missing in zip(_LVB_ROWS, "BEA", (False, False, True)):
        texts = [r[f"option{k}"] for k in range(5) if r[f"option{k}"] != "N/A"]
        out.append(
            {
                "id": r["id"],
                "video": f"videos/{r['video_path']}",
                "question": r["question"],
                "options": [f"{'ABCDE'[j]}. {t}" for j, t in enumerate(texts)],
                "answer": letter,
                "categories": {
                    "duration_group": str(r["duration_group"]),
                    "question_category": r["question_category"],
                },
                "video_missing": missing,
                "extra": {"duration": r["duration"]},
            }
        )
    return out


def _write_lvb(root: Path, video: bool) -> list[dict]:
    rows = _write_parquet(root / "validation-00000-of-00001.parquet", _LVB_ROWS, _LVB_SCHEMA)
    if video:
        for r in _LVB_ROWS[:2]:
            _put_video(root / "videos" / r["video_path"])
    return rows


def write_longvideobench_json(root: Path, *, video: bool = True) -> list[dict]:
    """LongVideoBench as ``lvb_val.json`` only (the official loader's form: ``candidates``
    instead of ``option0..4``, plus ``position``, ``level``...); same questions as the parquet."""
    rows = []
    for r in _LVB_ROWS:
        j = {k: v for k, v in r.items() if not k.startswith("option")}
        j["candidates"] = [r[f"option{k}"] for k in range(5) if r[f"option{k}"] != "N/A"]
        j.update(
            question_wo_referring_query=r["question"],
            position=[10, 20],
            level="L2-Relation",
            view_count=1234,
            starting_timestamp_for_subtitles=int(r["starting_timestamp_for_subtitles"]),
        )
        rows.append(j)
    root.mkdir(parents=True, exist_ok=True)
    (root / "lvb_val.json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    if video:
        for r in _LVB_ROWS[:2]:
            _put_video(root / "videos" / r["video_path"])
    return rows


_LVBENCH_ROWS = [
    {
        "uid": 1,
        "key": "AbCdEfGhIjK",
        "type": "cartoon",
        "video_path": "AbCdEfGhIjK.mp4",
        "question": "What color is the car that appears at the beginning of the video?\n"
        "(A) Red\n(B) Blue\n(C) White\n(D) Black",
        "answer": "A",
        "question_type": ["entity recognition"],
        "time_reference": "00:15-00:19",
    },
    {
        "uid": 2,
        "key": "AbCdEfGhIjK",
        "type": "cartoon",
        "video_path": "AbCdEfGhIjK.mp4",
        "question": "The man stops walking.\nWhy does he stop?\n"
        "(A) He is tired\n(B) He hears a noise\n(C) He sees a friend\n(D) The road ends",
        "answer": "C",
        "question_type": ["key information retrieval", "reasoning"],
        "time_reference": "01:02-01:10",
    },
    {
        "uid": 3,
        "key": "ZyXwVuTsRqP",
        "type": "documentary",
        "video_path": "ZyXwVuTsRqP.mp4",
        "question": "What is the video mainly about?\n"
        "(A) Cooking\n(B) Wild birds\n(C) A car race\n(D) A concert",
        "answer": "B",
        "question_type": ["summarization"],
        "time_reference": "00:00-12:00",
    },
    {
        "uid": 4,
        "key": "NoSuchVid00",
        "type": "sport",
        "video_path": "NoSuchVid00.mp4",
        "question": "When does the first goal happen?\n(A) 00:10\n(B) 01:20\n(C) 05:00\n(D) 10:40",
        "answer": "D",
        "question_type": ["temporal grounding"],
        "time_reference": "10:35-10:45",
    },
]
_LVBENCH_SCHEMA = pa.schema(
    [
        ("uid", pa.int64()),
        ("key", pa.string()),
        ("type", pa.string()),
        ("video_path", pa.string()),
        ("question", pa.string()),
        ("answer", pa.string()),
        ("question_type", pa.list_(pa.string())),
        ("time_reference", pa.string()),
    ]
)
_LVBENCH_EXPECTED = [
    {
        "id": "1",
        "video": "AbCdEfGhIjK.mp4",
        "question": "What color is the car that appears at the beginning of the video?",
        "options": ["A. Red", "B. Blue", "C. White", "D. Black"],
        "answer": "A",
        "categories": {"question_type": ["entity recognition"]},
    },
    {
        "id": "2",
        "video": "AbCdEfGhIjK.mp4",
        "question": "The man stops walking.\nWhy does he stop?",
        "options": [
            "A. He is tired",
            "B. He hears a noise",
            "C. He sees a friend",
            "D. The road ends",
        ],
        "answer": "C",
        "categories": {"question_type": ["key information retrieval", "reasoning"]},
    },
    {
        "id": "3",
        "video": "videos/ZyXwVuTsRqP.mp4",
        "question": "What is the video mainly about?",
        "options": ["A. Cooking", "B. Wild birds", "C. A car race", "D. A concert"],
        "answer": "B",
        "categories": {"question_type": ["summarization"]},
    },
    {
        "id": "4",
        "video": "NoSuchVid00.mp4",
        "question": "When does the first goal happen?",
        "options": ["A. 00:10", "B. 01:20", "C. 05:00", "D. 10:40"],
        "answer": "D",
        "categories": {"question_type": ["temporal grounding"]},
        "video_missing": True,
    },
]


def _write_lvbench(root: Path, video: bool) -> list[dict]:
    rows = _write_parquet(
        root / "data/train-00000-of-00001.parquet", _LVBENCH_ROWS, _LVBENCH_SCHEMA
    )
    if video:
        _put_video(root / "AbCdEfGhIjK.mp4")
        _put_video(root / "videos/ZyXwVuTsRqP.mp4")  # the adapter's fallback folder
    return rows


_MLVU_ROWS = [
    {
        "video_name": "needle_32.mp4",
        "duration": 467.98,
        "question": "What does the person in the red jacket do at the counter?\n"
        "(A) Delivers a product\n(B) Shakes the woman's hand\n"
        "(C) Takes the woman's credit card\n(D) Points at something on the screen\n",
        "candidates": [
            "Delivers a product",
            "Shakes the woman's hand",
            "Takes the woman's credit card",
            "Points at something on the screen",
        ],
        "answer": "A",  # a letter (lmms-eval's reading)
        "task_type": "needle",
        "question_id": "Q0",
    },
    {
        "video_name": "count_7.mp4",
        "duration": 120.5,
        "question": "How many times does the dog jump?\n(A) 1\n(B) 2\n(C) 3\n(D) 4\n",
        "candidates": ["1", "2", "3", "4"],
        "answer": "3",  # option text (ParaVT's reading) -> C
        "task_type": "count",
        "question_id": "Q0",  # same question_id as row 0, another task
    },
    {
        "video_name": "plotQA_5.mp4",
        "duration": 300.0,
        "question": "What does the boy do after he opens the door?\n"
        "(A) He sits down\n(B) He runs outside\n(C) He calls his mother\n(D) He turns on the TV\n",
        "candidates": [
            "He sits down",
            "He runs outside",
            "He calls his mother",
            "He turns on the TV",
        ],
        "answer": "D",
        "task_type": "plotQA",
        "question_id": "Q1",
    },
    {
        "video_name": "order_9.mp4",
        "duration": 200.25,
        "question": "In which order do the events happen?\n"
        "(A) 1-2-3\n(B) 2-1-3\n(C) 3-2-1\n(D) 1-3-2\n",
        "candidates": ["1-2-3", "2-1-3", "3-2-1", "1-3-2"],
        "answer": "2-1-3",  # text -> B
        "task_type": "order",
        "question_id": "Q0",
    },
]
_MLVU_SCHEMA = pa.schema(
    [
        ("video_name", pa.string()),
        ("duration", pa.float64()),
        ("question", pa.string()),
        ("candidates", pa.list_(pa.string())),
        ("answer", pa.string()),
        ("task_type", pa.string()),
        ("question_id", pa.string()),
    ]
)


def _mlvu_expected() -> list[dict]:
    out = []
    for r, letter, video, missing in zip(
        _MLVU_ROWS,
        "ACDB",
        ("needle_32.mp4", "count_7.mp4", "video/plotQA_5.mp4", "order_9.mp4"),
        (False, False, False, True),
    ):
        out.append(
            {
                "id": f"{r['task_type']}-{r['question_id']}",
                "video": video,
                "question": r["question"].split("\n")[0],
                "options": [f"{'ABCD'[j]}. {c}" for j, c in enumerate(r["candidates"])],
                "answer": letter,
                "categories": {"task_type": r["task_type"]},
                "video_missing": missing,
                "extra": {"duration": r["duration"]},
            }
        )
    return out


def _write_mlvu(root: Path, video: bool) -> list[dict]:
    rows = _write_parquet(root / "mlvu/test-00000-of-00001.parquet", _MLVU_ROWS, _MLVU_SCHEMA)
    if video:
        _put_video(root / "needle_32.mp4")
        _put_video(root / "count_7.mp4")
        _put_video(root / "video/plotQA_5.mp4")  # the adapter's fallback folder
    return rows


_MMVU_URL = "https://huggingface.co/datasets/yale-nlp/MMVU/resolve/main/videos/"
_MMVU_ROWS = [
    {
        "id": "validation_0",
        "video": _MMVU_URL + "Art/0.mp4",
        "youtube_url": "https://www.youtube.com/watch?v=VkqytRr85ao",
        "question_type": "open-ended",
        "metadata": {
            "subject": "Art",
            "textbook": "Film Art: An Introduction",
            "knowledge": ["https://en.wikipedia.org/wiki/Dolly_zoom"],
            "rationale": "The background changes size while the subject stays fixed.",
        },
        "question": "Which cinematic shooting technique is shown in the video?",
        "choices": {"A": "", "B": "", "C": "", "D": "", "E": ""},
        "answer": "Dolly Zoom",
    },
    {
        "id": "validation_1",
        "video": _MMVU_URL + "Chemistry/0.mp4",
        "youtube_url": " https://youtu.be/6HuyUxJBY3E",
        "question_type": "multiple-choice",
        "metadata": {
            "subject": "Chemistry",
            "textbook": "Chemistry, 2nd Edition",
            "knowledge": ["https://en.wikipedia.org/wiki/Ideal_gas_law"],
            "rationale": "0.1 mol of CO2 gives 0.1 mol of CaCO3.",
        },
        "question": "Assume that 2.24 liters of gas fully participates in the reaction shown in "
        "the video under the standard temperature and pressure condition, how many grams of "
        "precipitate are produced approximately?",
        "choices": {"A": "10.0", "B": "5.0", "C": "12.0", "D": "15.0", "E": "20.0"},
        "answer": "A",
    },
    {
        "id": "validation_2",
        "video": _MMVU_URL + "Computer_Science/3.mp4",
        "youtube_url": "https://www.youtube.com/watch?v=0000000000a",
        "question_type": "multiple-choice",
        "metadata": {
            "subject": "Computer Science",
            "textbook": "Introduction to Algorithms",
            "knowledge": ["https://en.wikipedia.org/wiki/Quicksort"],
            "rationale": "The pivot is the last element.",
        },
        "question": "Which sorting algorithm is animated in the video?",
        "choices": {
            "A": "Merge sort",
            "B": "Heap sort",
            "C": "Quicksort",
            "D": "Bubble sort",
            "E": "Insertion sort",
        },
        "answer": "C",
    },
]
_MMVU_EXPECTED = [
    {
        "id": "validation_0",
        "video": "videos/Art/0.mp4",
        "question": "Which cinematic shooting technique is shown in the video?",
        "answer": "Dolly Zoom",
        "question_type": "oe",
        "categories": {"subject": "Art", "question_format": "open-ended"},
    },
    {
        "id": "validation_1",
        "video": "videos/Chemistry/0.mp4",
        "question": _MMVU_ROWS[1]["question"],
        "options": ["A. 10.0", "B. 5.0", "C. 12.0", "D. 15.0", "E. 20.0"],
        "answer": "A",
        "categories": {"subject": "Chemistry", "question_format": "multiple-choice"},
    },
    {
        "id": "validation_2",
        "video": "videos/Computer_Science/3.mp4",
        "question": "Which sorting algorithm is animated in the video?",
        "options": [
            "A. Merge sort",
            "B. Heap sort",
            "C. Quicksort",
            "D. Bubble sort",
            "E. Insertion sort",
        ],
        "answer": "C",
        "categories": {"subject": "Computer Science", "question_format": "multiple-choice"},
        "video_missing": True,
    },
]


def _write_mmvu(root: Path, video: bool) -> list[dict]:
    root.mkdir(parents=True, exist_ok=True)
    (root / "validation.json").write_text(json.dumps(_MMVU_ROWS, indent=4), encoding="utf-8")
    if video:
        _put_video(root / "videos/Art/0.mp4")
        _put_video(root / "videos/Chemistry/0.mp4")
    return copy.deepcopy(_MMVU_ROWS)


_CHARADES_ROWS = [
    {"video": "3MSZA.mp4", "caption": "person turn a light on.", "timestamp": [1.3, 4.7]},
    {"video": "3MSZA.mp4", "caption": "person opens the door", "timestamp": [0.0, 2.5]},
    {"video": "ZZZ99.mp4", "caption": "a person sits down on a chair", "timestamp": [10.2, 15.6]},
]
_CHARADES_SCHEMA = pa.schema(
    [("video", pa.string()), ("caption", pa.string()), ("timestamp", pa.list_(pa.float16()))]
)
# float16 as stored: 1.3 -> 1.2998046875, 4.7 -> 4.69921875, 10.2 -> 10.203125, ...
_CHARADES_EXPECTED = [
    {
        "id": "3MSZA#0",
        "video": "Charades_v1_480/3MSZA.mp4",
        "question": "person turn a light on.",
        "answer": "1.2998046875-4.69921875",
        "question_type": "tvg",
        "event_start": 1.2998046875,
        "event_end": 4.69921875,
        "categories": {},
    },
    {
        "id": "3MSZA#1",
        "video": "Charades_v1_480/3MSZA.mp4",
        "question": "person opens the door",
        "answer": "0.0-2.5",
        "question_type": "tvg",
        "event_start": 0.0,
        "event_end": 2.5,
        "categories": {},
    },
    {
        "id": "ZZZ99#2",
        "video": "Charades_v1_480/ZZZ99.mp4",
        "question": "a person sits down on a chair",
        "answer": "10.203125-15.6015625",
        "question_type": "tvg",
        "event_start": 10.203125,
        "event_end": 15.6015625,
        "categories": {},
        "video_missing": True,
    },
]


def _write_charades(root: Path, video: bool) -> list[dict]:
    rows = _write_parquet(
        root / "data/test-00000-of-00001.parquet", _CHARADES_ROWS, _CHARADES_SCHEMA
    )
    if video:
        _put_video(root / "Charades_v1_480/3MSZA.mp4")
    return rows


_SYNTH_Q_MCQ = (
    "While the background is blue, a coloured shape briefly appears. Which one is it?\n"
    "A. yellow circle\nB. red square\nC. white triangle\nD. cyan square\n"
    "Answer with the option's letter."
)
_SYNTH_Q_OE = (
    "What coloured shape briefly appears while the background is blue? Answer with its colour "
    "and shape, e.g. 'blue circle'."
)
_SYNTH_Q_TVG = (
    "During which seconds of the video is the red square visible? Answer as start-end in "
    "seconds, e.g. '12.0-15.5'."
)
_SYNTH_ROWS = [  # the JSONL rows paravt.data.synth writes (same keys and order)
    {
        "id": "synth-s0-vid_0000-mcq",
        "video": "videos/vid_0000.mp4",
        "event_start": 3.0,
        "event_end": 5.0,
        "question": _SYNTH_Q_MCQ,
        "answer": "B",
        "question_type": "mcq",
        "options": ["yellow circle", "red square", "white triangle", "cyan square"],
    },
    {
        "id": "synth-s0-vid_0000-oe",
        "video": "videos/vid_0000.mp4",
        "event_start": 3.0,
        "event_end": 5.0,
        "question": _SYNTH_Q_OE,
        "answer": "red square",
        "question_type": "oe",
    },
    {
        "id": "synth-s0-vid_0000-tvg",
        "video": "videos/vid_0000.mp4",
        "event_start": 3.0,
        "event_end": 5.0,
        "question": _SYNTH_Q_TVG,
        "answer": "3.0-5.0",
        "question_type": "tvg",
    },
    {
        "id": "synth-s0-vid_0001-oe",
        "video": "videos/vid_0001.mp4",
        "event_start": 1.5,
        "event_end": 4.0,
        "question": _SYNTH_Q_OE.replace("blue", "green"),
        "answer": "cyan circle",
        "question_type": "oe",
    },
]
_SYNTH_EXPECTED = [
    {
        "id": "synth-s0-vid_0000-mcq",
        "video": "videos/vid_0000.mp4",
        "question": "While the background is blue, a coloured shape briefly appears. "
        "Which one is it?",
        "options": ["A. yellow circle", "B. red square", "C. white triangle", "D. cyan square"],
        "answer": "B",
        "event_start": 3.0,
        "event_end": 5.0,
        "categories": {"question_type": "mcq"},
    },
    {
        "id": "synth-s0-vid_0000-oe",
        "video": "videos/vid_0000.mp4",
        "question": _SYNTH_Q_OE,
        "answer": "red square",
        "question_type": "oe",
        "event_start": 3.0,
        "event_end": 5.0,
        "categories": {"question_type": "oe"},
    },
    {
        "id": "synth-s0-vid_0000-tvg",
        "video": "videos/vid_0000.mp4",
        "question": _SYNTH_Q_TVG,
        "answer": "3.0-5.0",
        "question_type": "tvg",
        "event_start": 3.0,
        "event_end": 5.0,
        "categories": {"question_type": "tvg"},
    },
    {
        "id": "synth-s0-vid_0001-oe",
        "video": "videos/vid_0001.mp4",
        "question": _SYNTH_Q_OE.replace("blue", "green"),
        "answer": "cyan circle",
        "question_type": "oe",
        "event_start": 1.5,
        "event_end": 4.0,
        "categories": {"question_type": "oe"},
        "video_missing": True,
    },
]


def _write_synth(root: Path, video: bool) -> list[dict]:
    root.mkdir(parents=True, exist_ok=True)
    (root / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _SYNTH_ROWS))
    if video:
        _put_video(root / "videos/vid_0000.mp4")
    return copy.deepcopy(_SYNTH_ROWS)


# ------------------------------------------------------------------------------ public API
_WRITERS = {
    "videomme": _write_videomme,
    "videomme_sub": _write_videomme,
    "longvideobench": _write_lvb,
    "lvbench": _write_lvbench,
    "mlvu": _write_mlvu,
    "mmvu": _write_mmvu,
    "charades_sta": _write_charades,
    "synth": _write_synth,
    "jsonl": _write_synth,  # one's own rows: synth's layout under its own name
}
_EXPECTED = {
    "videomme": lambda: _videomme_expected(sub=False),
    "videomme_sub": lambda: _videomme_expected(sub=True),
    "longvideobench": _lvb_expected,
    "lvbench": lambda: _LVBENCH_EXPECTED,
    "mlvu": _mlvu_expected,
    "mmvu": lambda: _MMVU_EXPECTED,
    "charades_sta": lambda: _CHARADES_EXPECTED,
    "synth": lambda: _SYNTH_EXPECTED,
    "jsonl": lambda: _SYNTH_EXPECTED,
}
# Directory of each benchmark under write_all's root (the two Video-MME tasks share one).
FIXTURE_DIRS = {name: "videomme" if name.startswith("videomme") else name for name in _WRITERS}


def write_benchmark(name: str, root: Path, *, video: bool = True) -> list[dict]:
    """Write benchmark ``name``'s fixture with data root ``root``; return its rows as stored."""
    if name not in _WRITERS:
        raise ValueError(f"no fixture for {name!r}; expected one of {sorted(_WRITERS)}")
    return _WRITERS[name](Path(root), video)


def expected_samples(name: str, root: Path) -> list[dict]:
    """The Sample fields ``load_benchmark(name, root)`` must return for the fixture (file
    order), video paths made absolute under ``root``."""
    base = Path(root).absolute()
    out = []
    for e in copy.deepcopy(_EXPECTED[name]()):
        full: dict[str, Any] = {
            "options": [],
            "question_type": "mcq",
            "event_start": None,
            "event_end": None,
            "video_missing": False,
            "extra": {},
            **e,
        }
        full["video"] = str(base / e["video"])
        out.append(full)
    return out


def write_all(root: Path, *, video: bool = True) -> dict[str, Path]:
    """Every benchmark's fixture under ``root/<FIXTURE_DIRS[name]>``; returns name -> data root."""
    out = {}
    for name in _WRITERS:
        d = Path(root) / FIXTURE_DIRS[name]
        if name != "videomme_sub":  # shares videomme's files
            write_benchmark(name, d, video=video)
        out[name] = d
    return out
