"""The synthetic long-video task: real encoded videos where cropping pays.

``python -m paravt.data.synth --out DIR --num-videos N --seed S [--codec h264|vp9]
[--task cue|spot]`` writes::

    DIR/videos/vid_0000.mp4 ...   real H.264 (libx264) or VP9 (libvpx) files
    DIR/train.jsonl DIR/val.jsonl  one question per row (mcq | oe | tvg), paths relative to DIR
    DIR/sft.jsonl                  oracle tool-use trajectories for the train rows
    DIR/manifest.json              the parameters; a rerun with the same ones is a no-op,
                                   one with another seed (or other task settings) is refused

Each video (``min_duration``–``max_duration`` s, ``fps`` frames/s, low resolution) shows a
dark background with a small moving dot. Once, for 20–30 s, the background changes to a cue
colour (blue, green, purple or brown); inside that cue window a coloured shape (the *target*)
appears for 2–4 s. Distractor shapes (other colour/shape pairs) appear outside the cue window.
A 4-frame overview usually misses the 2–4 s target, a 64-frame overview (spacing <= 2.9 s at
180 s) catches it, and even a sparse overview usually sees the 20–30 s cue, so an agent can
localise the cue and crop it.

The "spot" task (``--task spot``; the embedded default's, preset ``tiny_cpu``) is the smallest
version of the same idea: one large coloured square for 4-6 s on a dark background, one
fixed-option question (its colour), and an oracle whose crop calls are the same for every video
of one duration, because a 2-layer model does not learn to copy digits from an arbitrary place
in its context within minutes (see :func:`generate`).

Every frame carries its display index as a strip of 16 black/white blocks across the top
(``read_frame_index``), large enough to survive the encoder at the quality used here, so
tests can check decoded frames exactly.

Everything derives from ``seed``: the same seed gives byte-identical JSONL files (and
byte-identical videos: the encoders run single-threaded).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from functools import partial
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch

from paravt.config import ConfigError
from paravt.data.sft_records import SFTRecord, SFTTurn, write_sft_records
from paravt.data.synth_tasks import SYNTH_TASK_MIN_SECONDS, synth_task_error
from paravt.files import write_atomic
from paravt.log import get_logger
from paravt.types import Sample, VideoMeta
from paravt.video import crop_timestamps, overview_timestamps
from paravt.vision.preprocess import patch_timestamps

log = get_logger(__name__)

# Frame layout: the index strip is the top ``STRIP_FRAC`` of the frame, split into INDEX_BITS
# equal blocks (MSB first). At 160x128 a block is 10x16 px: at crf 15 H.264 keeps its mean
# within a few levels of 0/255.
INDEX_BITS = 16
STRIP_FRAC = 1 / 8
DEFAULT_SIZE = (128, 160)  # (height, width): macroblock-aligned, Qwen-VL factor-friendly
DEFAULT_FPS = 4.0
DEFAULT_GOP = 16

BACKGROUND = (40, 40, 40)
CUE_COLOURS = {
    "blue": (30, 60, 170),
    "green": (30, 120, 50),
    "purple": (110, 40, 140),
    "brown": (120, 75, 30),
}
SHAPE_COLOURS = {
    "red": (230, 30, 30),
    "yellow": (240, 230, 40),
    "white": (250, 250, 250),
    "cyan": (40, 230, 230),
    "magenta": (230, 40, 230),
    "orange": (250, 140, 20),
}
# Every colour a synthetic video draws, by name: the cue task's shape colours and the spot
# task's (``SPOT_COLOURS``: its scarlet and lemon are the shapes' red and yellow).
COLOUR_RGB = {**SHAPE_COLOURS, "scarlet": SHAPE_COLOURS["red"], "lemon": SHAPE_COLOURS["yellow"]}
SHAPES = ("square", "circle", "triangle")
# The "spot" task (:func:`_plan_spot`): one square per video, its colour asked about with these
# options in this order (the RGB corners most apart at a tiny pixel budget). One shape only: at
# the tiny default's 32x32 px per frame (one visual token per 2 frames) the frozen random tower
# does not tell squares, circles and triangles apart (measured: 0.20-0.35 teacher-forced on 3
# shapes), while colours are read without error.
#
# Their names are words the tiny tokenizer splits into several tokens with distinct first
# tokens (" sc"/" l"/" c"/" m"). With "red" and "yellow" (one token each) the 2-layer main agent
# carried a summary's colour into its answer for cyan and magenta but mixed up red and yellow
# (teacher-forced on held-out rows: log-p -0.56 vs -0.88 for either, whichever the summary
# said; docs/copy_probe.md); the pixels are the same red and yellow. The names alone did not
# make the copy reliable (another seed then mixed up lemon/cyan and scarlet/magenta): the SFT's
# learning rate did, in 5 of 6 cold starts (preset tiny_cpu, sft.lr). Protocols 1-3 of the
# collapse experiment (docs/collapse/) ran with the old names.
SPOT_COLOURS = ("scarlet", "lemon", "cyan", "magenta")
SPOT_SHAPE = "square"
# The oracle's thought before it crops the whole video (the spot tasks' tool round).
SPOT_LOOK_TEXT = "I will look at the whole video."
SPOT_PLAN_TEXT = f"The overview shows no shape; {SPOT_LOOK_TEXT}"
# A guessing record's thought (``data.synth_call_share_missed`` < 1): the overview shows no
# square and the oracle answers without a crop. It differs from SPOT_PLAN_TEXT from the word
# after "I will" on: where the cold start decides to call.
SPOT_GUESS_TEXT = "The overview shows no shape; I will guess."
TASKS = tuple(SYNTH_TASK_MIN_SECONDS)  # ("cue", "spot", "spot_late", "spot_decoy")
# The "spot_late" task (:func:`_plan_spot_late`): a spot square in the first half of the video
# and, in a share SPOT_LATE_SHARE of the videos, a brief square of another colour after it; the
# question asks for the last square's colour. At 60 s and K = 32 (one overview frame per 1.9 s)
# a 1 s square is missed about half the time, and the overview then looks like a one-square
# video: the need for a crop is hidden from the overview (the collapse experiment's task).
SPOT_LATE_EVENT = 1.0
SPOT_LATE_SHARE = 0.5
# The "spot_decoy" task (:func:`_plan_spot_decoy`): the "spot" task, but in a share
# SPOT_DECOY_SHARE (q; the default of ``data.synth_decoy_share``) of the videos the square
# shows another colour in exactly the frames the K = DECOY_K overview samples; every other
# frame (the crops') shows the truth. The K = 32 overview then shows one square of a wrong
# colour, like any one-square video: the need for a crop is hidden from it.
SPOT_DECOY_SHARE = 0.25
DECOY_K = 32
# Each row records, per overview budget K here, whether the K-frame overview misses the square
# the question asks about (``need_K{K}``: the overview cannot answer it; a crop can).
NEED_BUDGETS = (2, 4, 8, 16, 32, 64)
# How long the square shows, in seconds: 2-3 s squares fall in one of a crop's 2 s temporal
# patches, and the tiny model learnt to find that one visual token among six in some SFT runs
# and not in others (teacher-forced colour accuracy 0.23-1.0); at 4-6 s they fill 2-3 of them.
SPOT_EVENT = (4.0, 6.0)
SPOT_SIDE = 0.75  # the shape's side, as a fraction of the frame's shorter side
ENCODERS = {"h264": ("libx264", ".mp4"), "vp9": ("libvpx-vp9", ".webm")}


# ------------------------------------------------------------------------ frame index strip
def _strip_geometry(h: int, w: int) -> tuple[int, list[tuple[int, int]]]:
    strip_h = max(1, round(h * STRIP_FRAC))
    edges = [round(b * w / INDEX_BITS) for b in range(INDEX_BITS + 1)]
    return strip_h, [(edges[b], edges[b + 1]) for b in range(INDEX_BITS)]


def draw_frame_index(frame: np.ndarray, index: int) -> None:
    """Write ``index`` (0 <= index < 2**16) into the top strip of ``frame`` (H, W, 3) in place."""
    if not 0 <= index < 2**INDEX_BITS:
        raise ValueError(f"frame index {index} does not fit in {INDEX_BITS} bits")
    h, w = frame.shape[:2]
    strip_h, blocks = _strip_geometry(h, w)
    for b, (x0, x1) in enumerate(blocks):
        bit = (index >> (INDEX_BITS - 1 - b)) & 1
        frame[:strip_h, x0:x1] = 255 if bit else 0


def read_frame_index(frame: torch.Tensor | np.ndarray) -> int:
    """Decode the index embedded by ``draw_frame_index`` from an (H, W, 3) uint8 RGB frame.

    Reads the mean of the central half of each block (away from block edges, where the codec
    and resizing blur); a block must be clearly dark (< 64) or bright (> 191), else the frame
    carries no readable index and ``ValueError`` says which block failed. Works on resized
    frames down to ~4 px per block.
    """
    a = frame.numpy() if isinstance(frame, torch.Tensor) else np.asarray(frame)
    if a.ndim != 3 or a.shape[-1] != 3:
        raise ValueError(f"read_frame_index: expected an (H, W, 3) frame, got {a.shape}")
    h, w = a.shape[:2]
    strip_h, blocks = _strip_geometry(h, w)
    y0, y1 = strip_h // 4, max(strip_h // 4 + 1, (3 * strip_h) // 4)
    value = 0
    for b, (x0, x1) in enumerate(blocks):
        q = (x1 - x0) // 4
        m = float(a[y0:y1, x0 + q : max(x0 + q + 1, x1 - q)].astype(np.float32).mean())
        if 64 <= m <= 191:
            raise ValueError(
                f"read_frame_index: block {b} has mean {m:.0f} (neither black nor white); "
                "the frame has no embedded index or was resized below ~4 px per block"
            )
        value = (value << 1) | int(m > 127.5)
    return value


# ---------------------------------------------------------------------------- video writing
def write_video(
    path: str | Path,
    frames: Iterable[np.ndarray],
    *,
    fps: float = DEFAULT_FPS,
    gop: int = DEFAULT_GOP,
    codec: str = "h264",
    crf: int = 15,
) -> Path:
    """Encode RGB uint8 frames (H, W, 3) to ``path`` with a fixed GOP (keyframe every ``gop``
    frames, scene-cut keyframes off) and constant frame rate ``fps``. Single-threaded and
    (H.264) without libx264's macroblock tree, so the output is byte-deterministic.
    ``codec``: 'h264' (libx264, .mp4) or 'vp9' (libvpx, .webm).
    """
    if codec not in ENCODERS:
        raise ValueError(f"write_video: codec '{codec}' is not one of {sorted(ENCODERS)}")
    if gop < 1:
        raise ValueError(f"write_video: gop={gop} must be >= 1")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rate = Fraction(fps).limit_denominator(1001)
    container = av.open(str(path), "w")
    try:
        stream = container.add_stream(ENCODERS[codec][0], rate=rate)
        stream.pix_fmt = "yuv420p"
        stream.gop_size = gop
        stream.thread_count = 1
        if codec == "h264":
            # keyint_min=gop + scenecut=0: keyframes exactly every `gop` frames. mbtree=0: with
            # the macroblock tree on, libx264 (single-threaded too) reads uninitialised memory:
            # the same frames gave other bytes from run to run (spot_late seed 0's vid_0118,
            # decoded pixels off by up to 3 in frames 6-7; MALLOC_PERTURB_ changes the output),
            # and so two "identical" data folders trained differently.
            stream.options = {
                "crf": str(crf),
                "preset": "veryfast",
                "threads": "1",
                "x264-params": f"scenecut=0:keyint={gop}:min-keyint={gop}:mbtree=0",
            }
        else:
            stream.options = {
                "crf": str(crf),
                "b": "0",
                "deadline": "realtime",
                "cpu-used": "8",
                "threads": "1",
                "lag-in-frames": "0",
                "auto-alt-ref": "0",
                "keyint_min": str(gop),
            }
        first = True
        for i, rgb in enumerate(frames):
            if first:
                stream.height, stream.width = rgb.shape[:2]
                first = False
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        if first:
            raise ValueError(f"write_video: no frames given for {path}")
        container.mux(stream.encode(None))
    finally:
        container.close()
    return path


def write_index_clip(
    path: str | Path,
    *,
    duration: float = 10.0,
    fps: float = DEFAULT_FPS,
    gop: int = DEFAULT_GOP,
    codec: str = "h264",
    size: tuple[int, int] = DEFAULT_SIZE,
) -> Path:
    """A plain test clip: ``round(duration * fps)`` frames, each with its index strip and a
    moving dot (so P/B frames carry real motion). Returns ``path``."""
    h, w = size
    n = round(duration * fps)

    def gen() -> Iterable[np.ndarray]:
        for i in range(n):
            f = np.empty((h, w, 3), np.uint8)
            f[:] = BACKGROUND
            x = (i * 3) % max(1, w - 8)
            f[h // 2 : h // 2 + 8, x : x + 8] = 200
            draw_frame_index(f, i)
            yield f

    return write_video(path, gen(), fps=fps, gop=gop, codec=codec)


# ------------------------------------------------------------------------------ the task
@dataclass
class Event:
    colour: str
    shape: str
    start: float
    end: float
    x: int
    y: int

    @property
    def name(self) -> str:
        return f"{self.colour} {self.shape}"


@dataclass
class VideoPlan:
    name: str
    duration: float
    cue: str | None  # None: no cue window (the "spot" task)
    cue_start: float
    cue_end: float
    target: Event
    distractors: list[Event]
    side: int = 0  # shape side in px (0: a third of the frame's shorter side)
    # "spot_decoy": the colour the square shows in the frames the K = DECOY_K overview samples
    # (None: no decoy)
    decoy: str | None = None


def _half(x: float) -> float:
    return round(x * 2) / 2


def _plan_video(
    rng: random.Random, name: str, min_d: float, max_d: float, size: tuple[int, int]
) -> VideoPlan:
    h, w = size
    duration = _half(rng.uniform(min_d, max_d))
    cue_len = min(_half(rng.uniform(20, 30)), duration - 10)
    cue_start = _half(rng.uniform(5, duration - cue_len - 5))
    cue_end = cue_start + cue_len
    ev_len = _half(rng.uniform(2, 4))
    ev_start = _half(rng.uniform(cue_start + 2, max(cue_start + 2, cue_end - ev_len - 2)))
    shape_side = max(8, min(h, w) // 3)

    def pos() -> tuple[int, int]:
        top = round(h * STRIP_FRAC) + 4
        return rng.randrange(4, w - shape_side - 4), rng.randrange(top, h - shape_side - 4)

    pairs = [(c, s) for c in SHAPE_COLOURS for s in SHAPES]
    rng.shuffle(pairs)
    target = Event(*pairs[0], ev_start, ev_start + ev_len, *pos())
    distractors: list[Event] = []
    busy = [(cue_start - 1, cue_end + 1)]
    for c, s in pairs[1 : 1 + rng.randint(2, 3)]:
        for _ in range(20):  # rejection-sample a free slot outside the cue window
            d_len = _half(rng.uniform(2, 4))
            d_start = _half(rng.uniform(1, duration - d_len - 1))
            if all(d_start + d_len + 1 <= a or d_start >= b + 1 for a, b in busy):
                distractors.append(Event(c, s, d_start, d_start + d_len, *pos()))
                busy.append((d_start, d_start + d_len))
                break
    distractors.sort(key=lambda e: e.start)
    cue = rng.choice(sorted(CUE_COLOURS))
    return VideoPlan(name, duration, cue, cue_start, cue_end, target, distractors)


def _plan_spot(
    rng: random.Random, name: str, min_d: float, max_d: float, size: tuple[int, int]
) -> VideoPlan:
    """A "spot" video: a dark background and ONE large square (``SPOT_SIDE``) of a
    ``SPOT_COLOURS`` colour for ``SPOT_EVENT`` seconds at a random time; no cue window, no
    distractors."""
    h, w = size
    duration = _half(rng.uniform(min_d, max_d))
    ev_len = _half(rng.uniform(*SPOT_EVENT))
    ev_start = _half(rng.uniform(1, duration - ev_len - 1))
    side = max(8, round(min(h, w) * SPOT_SIDE))
    top = round(h * STRIP_FRAC) + 2
    x, y = rng.randrange(2, w - side - 1), rng.randrange(top, h - side - 1)
    target = Event(rng.choice(SPOT_COLOURS), SPOT_SHAPE, ev_start, ev_start + ev_len, x, y)
    return VideoPlan(name, duration, None, 0.0, 0.0, target, [], side)


def _plan_spot_late(
    rng: random.Random, name: str, min_d: float, max_d: float, size: tuple[int, int]
) -> VideoPlan:
    """A "spot_late" video: a ``SPOT_EVENT`` square in the first half, and with probability
    ``SPOT_LATE_SHARE`` a brief (``SPOT_LATE_EVENT``) square of another colour at least 2 s
    after it. ``target`` is the last square (the one asked about), ``distractors`` the earlier
    one when there are two."""
    h, w = size
    duration = _half(rng.uniform(min_d, max_d))
    ev_len = _half(rng.uniform(*SPOT_EVENT))
    start = _half(rng.uniform(1, max(1.0, duration / 2 - ev_len)))
    side = max(8, round(min(h, w) * SPOT_SIDE))
    top = round(h * STRIP_FRAC) + 2

    def pos() -> tuple[int, int]:
        return rng.randrange(2, w - side - 1), rng.randrange(top, h - side - 1)

    colours = list(SPOT_COLOURS)
    rng.shuffle(colours)
    first = Event(colours[0], SPOT_SHAPE, start, start + ev_len, *pos())
    if rng.random() >= SPOT_LATE_SHARE:
        return VideoPlan(name, duration, None, 0.0, 0.0, first, [], side)
    lo, hi = first.end + 2.0, duration - SPOT_LATE_EVENT - 1.0
    late_start = _half(rng.uniform(lo, max(lo, hi)))
    late = Event(colours[1], SPOT_SHAPE, late_start, late_start + SPOT_LATE_EVENT, *pos())
    return VideoPlan(name, duration, None, 0.0, 0.0, late, [first], side)


def _plan_spot_decoy(
    rng: random.Random,
    name: str,
    min_d: float,
    max_d: float,
    size: tuple[int, int],
    decoy_share: float = SPOT_DECOY_SHARE,
) -> VideoPlan:
    """A "spot_decoy" video: a "spot" video (:func:`_plan_spot`) whose square, with
    probability ``decoy_share`` (q), shows another ``SPOT_COLOURS`` colour (``decoy``) in the
    frames the K = ``DECOY_K`` overview samples (:func:`decoy_frames`)."""
    plan = _plan_spot(rng, name, min_d, max_d, size)
    # One draw per video whatever q: the videos decoyed at q are decoyed at every q' > q.
    if rng.random() < decoy_share:
        plan.decoy = rng.choice([c for c in SPOT_COLOURS if c != plan.target.colour])
    return plan


def decoy_frames(plan: VideoPlan, fps: float) -> frozenset[int]:
    """The frame indices of ``plan``'s video that show its ``decoy`` colour: the frames the
    K = ``DECOY_K`` overview decodes (the last frame with pts <= each of its times); empty
    without a decoy."""

    if plan.decoy is None:
        return frozenset()
    times = overview_timestamps(plan_meta(plan, fps), DECOY_K)
    return frozenset(math.floor(t * fps + 1e-6) for t in times)


def _shape_mask(shape: str, side: int) -> np.ndarray:
    yy, xx = np.mgrid[0:side, 0:side]
    if shape == "square":
        return np.ones((side, side), bool)
    if shape == "circle":
        r = (side - 1) / 2
        return (yy - r) ** 2 + (xx - r) ** 2 <= r * r
    # triangle, apex up
    return np.abs(xx - (side - 1) / 2) <= yy / 2


def _render(plan: VideoPlan, fps: float, size: tuple[int, int]) -> Iterable[np.ndarray]:
    h, w = size
    side = plan.side or max(8, min(h, w) // 3)
    masks = {s: _shape_mask(s, side) for s in SHAPES}
    events = [plan.target, *plan.distractors]
    decoys = decoy_frames(plan, fps)
    for i in range(round(plan.duration * fps)):
        t = i / fps
        f = np.empty((h, w, 3), np.uint8)
        in_cue = plan.cue is not None and plan.cue_start <= t < plan.cue_end
        f[:] = CUE_COLOURS[plan.cue] if in_cue else BACKGROUND
        x = (i * 2) % max(1, w - 6)
        f[h - 10 : h - 4, x : x + 6] = 160
        for e in events:
            if e.start <= t < e.end:
                region = f[e.y : e.y + side, e.x : e.x + side]
                colour = plan.decoy if (e is plan.target and i in decoys) else e.colour
                region[masks[e.shape]] = COLOUR_RGB[colour]
        draw_frame_index(f, i)
        yield f


def _fmt(t: float) -> str:
    return f"{t:.1f}"


def _mcq(plan: VideoPlan, base: dict, vid: str, rng: random.Random, suffix: str) -> dict:
    """One multiple-choice row: the target, the video's distractors and random other shapes as
    four options in a random order."""
    others = sorted({e.name for e in plan.distractors} - {plan.target.name})
    pool = [f"{c} {s}" for c in SHAPE_COLOURS for s in SHAPES]
    fill = [p for p in pool if p != plan.target.name and p not in others]
    rng.shuffle(fill)
    options = [plan.target.name, *others[:3], *fill][:4]
    rng.shuffle(options)
    letter = "ABCD"[options.index(plan.target.name)]
    return {
        "id": f"{vid}-mcq{suffix}",
        **base,
        # The stem only: the prompt lists ``options`` (paravt.agent.prompts.question_text), in
        # training and in ``python -m paravt.eval --benchmark synth`` alike.
        "question": (
            f"While the background is {plan.cue}, a coloured shape briefly appears. "
            "Which one is it?"
        ),
        "answer": letter,
        "question_type": "mcq",
        "options": options,
    }


def _rows(
    plan: VideoPlan, rel_video: str, rng: random.Random, seed: int, mcq_variants: int = 1
) -> list[dict]:
    """The video's questions: an mcq, an oe and a tvg row, then ``mcq_variants - 1`` more mcq
    rows with the options drawn and ordered anew (ids ``-mcq2``, ``-mcq3``, ...): the same
    video, other letters, so the answer letter cannot be learnt per video, only by reading
    the options."""
    base = {
        "video": rel_video,
        "event_start": plan.target.start,
        "event_end": plan.target.end,
        "target": plan.target.name,  # Sample.extra["target"]: scores sub-agent summaries
    }
    vid = f"synth-s{seed}-{plan.name}"
    rows = [
        _mcq(plan, base, vid, rng, ""),
        {
            "id": f"{vid}-oe",
            **base,
            "question": (
                f"What coloured shape briefly appears while the background is {plan.cue}? "
                "Answer with its colour and shape, e.g. 'blue circle'."
            ),
            "answer": plan.target.name,
            "question_type": "oe",
        },
        {
            "id": f"{vid}-tvg",
            **base,
            "question": (
                f"During which seconds of the video is the {plan.target.name} visible? "
                "Answer as start-end in seconds, e.g. '12.0-15.5'."
            ),
            "answer": f"{_fmt(plan.target.start)}-{_fmt(plan.target.end)}",
            "question_type": "tvg",
        },
    ]
    rows += [_mcq(plan, base, vid, rng, str(j)) for j in range(2, mcq_variants + 1)]
    return rows


def _tool_call(start: float, end: float) -> str:
    call = {"name": "crop_video", "arguments": {"start_time": start, "end_time": end}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


@dataclass(frozen=True)
class OracleSettings:
    """What the SFT oracle must know about the run to write only what the model can see: the
    overview budgets it writes rows for, the crop sampling (``video.crop_*``), the parallel-call
    cap and the vision tower's temporal patch (timestamps are printed once per patch)."""

    budgets: tuple[int, ...] = (4, 16)
    crop_fps: float = 1.0
    crop_max_frames: int = 16
    crop_min_frames: int = 2
    max_parallel: int = 5
    temporal_patch: int = 2
    # ``data.synth_colour_swaps``: colour-swapped main-agent copies of each spot/spot_decoy
    # tool record.
    colour_swaps: int = 0
    # ``data.synth_call_share_missed`` / ``_seen``: the share of spot records that crop when
    # the overview misses the square (the rest guess) and when it shows it (the rest answer).
    call_share_missed: float = 1.0
    call_share_seen: float = 0.0


def oracle_settings(cfg: Any) -> OracleSettings:
    """The oracle settings of a run config (``paravt.config.Config``). The budgets are every
    ``video.frame_budgets`` entry and ``video.fixed_frames`` whether gating is on or not: the
    SFT cold start (and the data folder) is then the same for a gated run and its vanilla
    comparison, which differ only in RL (``tiny_cpu`` and ``tiny_cpu_vanilla``)."""
    v = cfg.video
    return OracleSettings(
        budgets=tuple(sorted({*v.frame_budgets, v.fixed_frames})),
        crop_fps=float(v.crop_fps),
        crop_max_frames=int(v.crop_max_frames),
        crop_min_frames=int(v.crop_min_frames),
        max_parallel=int(cfg.agent.max_parallel),
        colour_swaps=int(cfg.data.synth_colour_swaps),
        call_share_missed=float(cfg.data.synth_call_share_missed),
        call_share_seen=float(cfg.data.synth_call_share_seen),
    )


class Seen:
    """What a model sees of a video at given sample times: one entry per temporal patch, with
    its printed timestamp (``<t seconds>``, one decimal) and what any of its frames shows."""

    def __init__(self, plan: VideoPlan, fps: float, times: Sequence[float], tp: int) -> None:

        ts = [float(t) for t in times]
        ts += [ts[-1]] * (-len(ts) % tp)
        # The decoder returns the last frame with pts <= t; frame i shows the scene at i / fps.
        frames = [math.floor(t * fps + 1e-6) for t in ts]
        shown = [i / fps for i in frames]
        self.stamps = [round(x, 1) for x in patch_timestamps(ts, tp)]
        self.patches = [shown[i : i + tp] for i in range(0, len(shown), tp)]
        self.frames = [frames[i : i + tp] for i in range(0, len(frames), tp)]
        self.plan = plan
        self.decoys = decoy_frames(plan, fps)

    def cue(self) -> list[float]:
        p = self.plan
        return [
            s
            for s, f in zip(self.stamps, self.patches)
            if any(p.cue_start <= t < p.cue_end for t in f)
        ]

    def event(self, e: Event) -> list[float]:
        """The patches where a frame shows ``e`` in its own colour (for a "spot_decoy" target:
        a frame that is not a decoy frame)."""
        skip = self.decoys if e is self.plan.target else frozenset()
        return [
            s
            for s, ts, ix in zip(self.stamps, self.patches, self.frames)
            if any(e.start <= t < e.end and i not in skip for t, i in zip(ts, ix))
        ]

    def decoyed(self) -> list[float]:
        """The patches where a frame shows the target in its decoy colour ("spot_decoy")."""
        e = self.plan.target
        return [
            s
            for s, ts, ix in zip(self.stamps, self.patches, self.frames)
            if any(e.start <= t < e.end and i in self.decoys for t, i in zip(ts, ix))
        ]


def _visible(seen: Seen, e: Event, end: float) -> tuple[float, float] | None:
    """When ``e`` is seen during the cue colour (:func:`_span` of those timestamps); ``None``
    when not seen so."""
    cue = seen.cue()
    return _span(seen, [t for t in seen.event(e) if t in cue], end)


def _span(seen: Seen, stamps: list[float], end: float) -> tuple[float, float] | None:
    """From the first of ``stamps`` (printed timestamps of ``seen``) to the printed one after
    the last (or the crop's end, printed in the sub-agent's instruction): a window of times the
    sub-agent can read. ``None`` for no stamps."""
    if not stamps:
        return None
    i = seen.stamps.index(stamps[-1])
    stop = seen.stamps[i + 1] if i + 1 < len(seen.stamps) else round(end, 1)
    return stamps[0], stop


def _summary(plan: VideoPlan, seen: Seen, end: float) -> str:
    """The sub-agent's oracle summary of one crop ending at ``end``: only what its frames show.
    Numbers only for the shape seen during the cue colour (:func:`_visible`), because copying
    digits is the hardest thing for a small model; other shapes are named without times.

    The cue-time sentence opens with its marker, ``While it is <cue>, a <shape> appears at
    <a>-<b> s.``, and the main agent's final thought repeats that opening (:func:`_sft`): a
    model then finds the shape by matching the same words earlier in its context and copying
    what followed them (an induction copy), instead of choosing among the shapes the
    summaries name by a marker written after them."""
    parts = []
    cue = seen.cue()
    if cue:
        parts.append(f"The background turns {plan.cue}.")
    for e in sorted([plan.target, *plan.distractors], key=lambda e: e.start):
        span = _visible(seen, e, end)
        if span:
            parts.append(f"{_while(plan)} a {e.name} appears at {span[0]:.1f}-{span[1]:.1f} s.")
        elif seen.event(e):
            parts.append(f"A {e.name} appears.")
    return " ".join(parts) or "Nothing notable happens."


def _while(plan: VideoPlan) -> str:
    return f"While it is {plan.cue},"


def _windows(bounds: list[float], max_parallel: int) -> list[tuple[float, float]]:
    """Consecutive windows between ``bounds``; merged pairwise down to ``max_parallel``."""
    edges = sorted(set(bounds))
    while len(edges) - 1 > max_parallel:
        edges = edges[::2] + ([edges[-1]] if (len(edges) - 1) % 2 else [])
    return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def plan_meta(plan: VideoPlan, fps: float) -> VideoMeta:
    """What the decoder would report for ``plan``'s video (the oracle samples frame times the
    way the run does, from this)."""
    return VideoMeta(
        path="", duration=plan.duration, fps=fps, num_frames=round(plan.duration * fps),
        width=0, height=0, codec="",
    )  # fmt: skip


def _crop_seen(plan: VideoPlan, meta: VideoMeta, a: float, b: float, st: OracleSettings) -> Seen:
    """What a crop ``[a, b]`` shows, sampled as ``video.crop_*`` samples it."""

    times = crop_timestamps(
        meta, a, b, fps=st.crop_fps, max_frames=st.crop_max_frames, min_frames=st.crop_min_frames
    )
    return Seen(plan, meta.fps, times, st.temporal_patch)


def _record(row: dict, num_frames: int, *turns: SFTTurn) -> SFTRecord:
    """One SFT record (``sft.jsonl`` line; ``paravt.agent.encoder.encode_oracle_trajectory``)."""
    return SFTRecord(row["id"], num_frames, list(turns))


def tool_record(
    row: dict,
    num_frames: int,
    plan_text: str,
    windows: list[tuple[float, float]],
    summaries: list[str],
    found: str,
    answer: str,
) -> SFTRecord:
    """A record of one tool round: a thought (``plan_text``) and a ``crop_video`` call per
    window, the sub-agents' summaries, then a thought (``found``) and the answer. Used by the
    oracles here, the collapse cold start (``paravt.data.cold_start``) and
    ``paravt.eval.copy_probe``."""
    calls = "\n".join(_tool_call(a, b) for a, b in windows)
    return _record(
        row,
        num_frames,
        SFTTurn("assistant", f"<think>\n{plan_text}\n</think>\n{calls}"),
        SFTTurn("tool", summaries),
        SFTTurn("assistant", f"<think>\n{found}\n</think>\n<answer>{answer}</answer>"),
    )


def _sft(row: dict, plan: VideoPlan, fps: float, num_frames: int, st: OracleSettings) -> SFTRecord:
    """An oracle trajectory that writes only what the model can see.

    Every number it writes is printed in the model's own input, and every choice it makes is
    one a small model can learn to copy:

    * the overview already shows the target during the cue (large K): answer directly (not
      for temporal-grounding questions, which need the crop's times);
    * the overview's printed timestamps give at most ``max_parallel - 1`` cut points (K <= 8
      at the defaults): crop the whole video, cut at every printed timestamp — ``0``, each
      stamp in order, then the duration the prompt prints; the calls depend on no visual
      judgement, only on copying the numbers in order;
    * more timestamps (K >= 16): crop around the overview patches that show the cue colour (or
      the whole video, merged down to ``max_parallel`` windows, when none does).

    Sub-agent summaries give the crop's printed timestamps of what its frames show
    (:func:`_summary`); the final thought repeats the opening of the cue-time sentence of the
    summary that saw the target (``While it is <cue>, a <shape> appears``), so SFT never
    teaches the model to write a number or a shape it could not have read.
    """

    meta = plan_meta(plan, fps)
    tgt = plan.target
    over = Seen(plan, fps, overview_timestamps(meta, num_frames), st.temporal_patch)
    seen_tgt = [s for s in over.event(tgt) if s in over.cue()]
    if seen_tgt and row["question_type"] != "tvg":
        answer = (
            f"<think>\n{_while(plan)} a {tgt.name} is visible in the overview.\n</think>\n"
            f"<answer>{row['answer']}</answer>"
        )
        return _record(row, num_frames, SFTTurn("assistant", answer))
    cue = over.cue()
    stamps = over.stamps
    if len(stamps) + 1 <= st.max_parallel:
        bounds = [0.0, *stamps, plan.duration]
        plan_text = "I will look at the whole video, cut at the overview's timestamps."
    elif cue:
        i0, i1 = stamps.index(cue[0]), stamps.index(cue[-1])
        lo = stamps[i0 - 1] if i0 > 0 else 0.0
        hi = stamps[i1 + 1] if i1 + 1 < len(stamps) else plan.duration
        bounds = [lo, *stamps[i0 : i1 + 1], hi]
        plan_text = f"The background is {plan.cue} in the overview; I will look around it."
    else:
        bounds = [0.0, *stamps, plan.duration]
        plan_text = f"No overview frame shows the {plan.cue} background; I will look everywhere."
    windows = _windows(bounds, st.max_parallel)
    summaries, hits = [], []
    for j, (a, b) in enumerate(windows):
        crop = _crop_seen(plan, meta, a, b, st)
        summaries.append(_summary(plan, crop, b))
        at = _visible(crop, tgt, b)
        if at:
            hits.append((j, at))
    if hits:
        at = hits[0][1]
        span = f" at {at[0]:.1f}-{at[-1]:.1f} s" if row["question_type"] == "tvg" else ""
        found = f"{_while(plan)} a {tgt.name} appears{span}."
        ans = f"{at[0]:.1f}-{at[-1]:.1f}" if row["question_type"] == "tvg" else row["answer"]
    else:  # the crops' frames missed the target: the oracle still answers (rare)
        found = f"No crop shows the shape clearly; the likeliest is the {tgt.name}."
        ans = row["answer"]
    return tool_record(row, num_frames, plan_text, windows, summaries, found, ans)


def need_flags(plan: VideoPlan, fps: float, temporal_patch: int = 2) -> dict[str, bool]:
    """``need_K{K}`` for every K of ``NEED_BUDGETS``: whether the K-frame overview misses the
    square the question asks about (no overview patch shows it), so that only a crop can
    answer. Recorded in every "spot"/"spot_late" row (``Sample.extra``, and so in the
    held-out evaluation's ``heldout.jsonl`` rows): the collapse experiment splits its same-K
    metrics by it, prompt by prompt."""

    meta = plan_meta(plan, fps)
    return {
        f"need_K{k}": not Seen(plan, fps, overview_timestamps(meta, k), temporal_patch).event(
            plan.target
        )
        for k in NEED_BUDGETS
    }


SPOT_QUESTIONS = {
    "spot": "A coloured square briefly appears in the video. What colour is it?",
    "spot_decoy": "A coloured square briefly appears in the video. What colour is it?",
    "spot_late": "Coloured squares briefly appear in the video. What colour is the last one?",
}


def _spot_rows(
    plan: VideoPlan, rel_video: str, seed: int, fps: float, task: str = "spot"
) -> list[dict]:
    """A "spot" video's multiple-choice row: the square's colour, with the fixed options
    ``SPOT_COLOURS`` in that order. The letter is a fixed function of the colour, so what must
    be learnt is to see the square (the overview's frames or a crop's) and to carry the
    sub-agents' colour word to the answer. ``task='spot_late'``: the last square's colour, and
    how many squares the video shows (``squares``). Both record :func:`need_flags`."""
    tgt = plan.target
    late = {"squares": 1 + len(plan.distractors)} if task == "spot_late" else {}
    if task == "spot_decoy":
        late = {"decoy": plan.decoy is not None}
    return [
        {
            "id": f"synth-s{seed}-{plan.name}-colour",
            "video": rel_video,
            "event_start": tgt.start,
            "event_end": tgt.end,
            "target": tgt.name,
            # The stem only: the prompt lists the options (see _mcq).
            "question": SPOT_QUESTIONS[task],
            "answer": spot_letter(tgt.colour),
            "question_type": "mcq",
            # In capitals: then the lower-case colour word of a sub-agent's summary appears
            # nowhere else in the main agent's context, and carrying it to the final thought
            # is a match on the word alone, not on where it stands.
            "options": [o.upper() for o in SPOT_COLOURS],
            **late,
            **need_flags(plan, fps),
        }
    ]


def square_summary(plan: VideoPlan, crop: Seen, end: float) -> str:
    """The sub-agent's oracle summary of a "spot"/"spot_late" crop ending at ``end``: each
    square its frames show, in order of time, as ``A <colour> square appears at <a>-<b> s.``;
    ``Nothing notable happens.`` when none."""
    parts = []
    for e in sorted([plan.target, *plan.distractors], key=lambda e: e.start):
        span = _span(crop, crop.event(e), end)
        if span:
            parts.append(f"A {e.name} appears at {span[0]:.1f}-{span[1]:.1f} s.")
    return " ".join(parts) or "Nothing notable happens."


def square_found(plan: VideoPlan, seen: bool) -> str:
    """The main agent's thought after the crops of a "spot"/"spot_late" video: it repeats the
    words of the summary sentence that names the square asked about (``A <colour> square
    appears``, ``... appears last.`` when the video has two squares), or says the crops missed
    it (``seen`` False)."""
    tgt = plan.target
    if not seen:
        return f"No crop shows the shape clearly; the likeliest is the {tgt.name}."
    return f"A {tgt.name} appears last." if plan.distractors else f"A {tgt.name} appears."


def whole_video_crops(
    plan: VideoPlan, meta: VideoMeta, n: int, st: OracleSettings
) -> tuple[list[tuple[float, float]], list[str], str]:
    """The "spot" oracles' tool round: ``n`` equal windows of the whole video (the same calls
    for every video of one duration), each crop's :func:`square_summary`, and the final
    thought (:func:`square_found`). Used by :func:`_spot_sft` (``n`` = ``max_parallel``) and
    the collapse cold start (``paravt.data.cold_start.all_tool_records``)."""
    edges = [round(plan.duration * j / n, 1) for j in range(n + 1)]
    windows = [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]
    crops = [_crop_seen(plan, meta, a, b, st) for a, b in windows]
    summaries = [square_summary(plan, c, b) for c, (_, b) in zip(crops, windows)]
    return windows, summaries, square_found(plan, any(c.event(plan.target) for c in crops))


def _spot_sft(
    row: dict, plan: VideoPlan, fps: float, num_frames: int, st: OracleSettings
) -> list[SFTRecord]:
    """The "spot" oracle's records for one row and overview budget. When an overview patch
    shows the shape: answer from it, and a second record answers the same in a forced answer
    turn (``"forced": true``: the prefix ``agent.force_answer_text`` ends in ``<answer>``, as
    after the last tool turn and in ``K:notools`` evaluation), so that a forced answer also
    reads the overview instead of guessing a letter. Otherwise
    crop the whole video in ``max_parallel`` equal windows — the same calls for every video of
    one duration, so the calls need no copying — and answer from the summary that names the
    shape (``A <colour> <shape> appears at <a>-<b> s.``, or ``Nothing notable happens.``),
    repeating its ``A <colour> <shape> appears`` in the final thought.

    ``data.synth_call_share_missed`` / ``_seen`` below 1 / above 0 (the embedded default's RL
    world): beside the tool round, guesses where the overview misses the square and direct
    answers beside a crop-anyway round where it shows it, in the ratio :func:`call_mix` gives.

    "spot_late" (two squares in some videos, the question asks for the last): the same, with
    the last square as the shape; an overview that shows only the earlier square writes no
    record (what the overview shows cannot tell that video from a one-square video, and the
    oracle neither guesses nor calls on knowledge the model lacks), and summaries name every
    square of their crop in order (:func:`square_summary`)."""

    meta = plan_meta(plan, fps)
    tgt = plan.target
    over = Seen(plan, fps, overview_timestamps(meta, num_frames), st.temporal_patch)
    if over.decoyed():
        return []  # the overview shows a wrong colour (all of it, or some): no record
    key = f"{row['id']}:{num_frames}"
    if over.event(tgt):
        last = " last" if plan.distractors else ""
        seen_text = f"The overview shows a {tgt.name}{last}"
        answer = f"<think>\n{seen_text}.\n</think>\n<answer>{row['answer']}</answer>"
        forced_turn = SFTTurn("assistant", f"{row['answer']}</answer>", forced=True)
        n_answer, n_check = call_mix(st.call_share_seen, 1)
        out = [_record(row, num_frames, SFTTurn("assistant", answer))] * n_answer
        if n_check:  # crop anyway: the calls cost and pay nothing
            windows, summaries, found = whole_video_crops(plan, meta, max(1, st.max_parallel), st)
            plan_text = f"{seen_text}; {SPOT_LOOK_TEXT}"
            rec = tool_record(row, num_frames, plan_text, windows, summaries, found, row["answer"])
            # Main agent only: the sub-agents learn the same crops from the missed records.
            out.append(replace(rec, main_only=True))
        return [*out, _record(row, num_frames, forced_turn)]
    if any(over.event(e) for e in plan.distractors):
        return []  # the need is hidden from the overview: no record
    n_guess, n_call = call_mix(st.call_share_missed, 1 + st.colour_swaps)
    # Guesses: the colours without regard to the truth, cycling through a shuffled order (every
    # colour equally often when there are 4k of them: a uniform guess).
    colours = list(SPOT_COLOURS)
    random.Random(f"paravt-guess:{key}").shuffle(colours)
    out = [
        _record(row, num_frames, SFTTurn("assistant", guess_answer(spot_letter(colours[i % 4]))))
        for i in range(n_guess)
    ]
    if not n_call:
        return out
    windows, summaries, found = whole_video_crops(plan, meta, max(1, st.max_parallel), st)
    out.append(
        tool_record(row, num_frames, SPOT_PLAN_TEXT, windows, summaries, found, row["answer"])
    )
    for other in colour_swaps(tgt.colour, st.colour_swaps, key):
        rec = swapped_tool_record(row, num_frames, windows, summaries, found, tgt.colour, other)
        out.append(replace(rec, main_only=True))
    return out


def call_mix(share: float, n_call: int) -> tuple[int, int]:
    """``(records that do not call, first turns that call)`` for one (row, K) of the spot
    oracle at call share ``share`` (``data.synth_call_share_*``), when a call comes with
    ``n_call`` records of one first turn (a tool record and its colour-swapped copies).

    Both kinds are written for every (row, K) with 0 < share < 1, in the ratio ``share``
    (as near as whole records allow), so that every context teaches that probability, not a
    choice drawn once per video: measured on seed 0, one record per (row, K) drawn with
    probability 0.25 gave a cold start that called in 0 of 152 held-out K = 4 rollouts that
    needed a crop; both kinds at 0.25, 0.10 teacher-forced (docs/rl_learns.md). share 1:
    calls only; share 0: no call (``n_call`` records that do not call, as many as a call
    would have had)."""
    if share >= 1.0:
        return 0, n_call
    if share <= 0.0:
        return n_call, 0
    return max(1, round(n_call * (1.0 - share) / share)), n_call


def guess_answer(letter: str) -> str:
    """The text of a guessing record's answer turn (``data.synth_call_share_missed`` < 1): the
    overview shows no square and the oracle answers ``letter`` without a crop."""
    return f"<think>\n{SPOT_GUESS_TEXT}\n</think>\n<answer>{letter}</answer>"


def spot_letter(colour: str) -> str:
    """The option letter of a ``SPOT_COLOURS`` colour (the options' fixed order)."""
    return "ABCD"[SPOT_COLOURS.index(colour)]


def swapped_tool_record(
    row: dict,
    num_frames: int,
    windows: list[tuple[float, float]],
    summaries: list[str],
    found: str,
    colour: str,
    other: str,
) -> SFTRecord:
    """A spot tool record (:func:`tool_record`, the thought ``SPOT_PLAN_TEXT``) whose
    summaries, final thought ``found`` and answer name ``other`` where they named ``colour``
    (``other == colour``: the record as the oracle wrote it): the colour-swapped copies of
    ``data.synth_colour_swaps``."""
    return tool_record(
        row, num_frames, SPOT_PLAN_TEXT, windows,
        [swap_colour(x, colour, other) for x in summaries], swap_colour(found, colour, other),
        spot_letter(other),
    )  # fmt: skip


def swap_colour(text: str, colour: str, other: str) -> str:
    """``text`` with the colour word ``colour`` (as a whole word) replaced by ``other``."""
    return re.sub(rf"\b{colour}\b", other, text)


def colour_swaps(colour: str, n: int, key: str) -> list[str]:
    """The ``n`` (at most 3) other ``SPOT_COLOURS`` a tool record of a ``colour`` square is
    copied with (``data.synth_colour_swaps``), drawn by a stable hash of ``key``."""
    others = [c for c in SPOT_COLOURS if c != colour]
    random.Random(f"paravt-swap:{key}").shuffle(others)
    return others[: max(0, min(n, len(others)))]


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def summary_correct(summary: str, start: float, end: float, sample: Sample) -> bool | None:
    """Whether a sub-agent's summary of the crop ``[start, end]`` is right about the target:
    when the window overlaps the target's interval it must name the target (colour and shape)
    and a time within 2 s of that interval; otherwise it must not name the target. ``None``
    for samples that do not record a target (not from this generator)."""
    target = str(sample.extra.get("target") or "")
    a, b = sample.event_start, sample.event_end
    if not target or a is None or b is None:
        return None
    named = target in summary.lower()
    if not (start < b and end > a):
        return not named
    times = [float(x) for x in _NUMBER.findall(summary)]
    return named and any(a - 2 <= t <= b + 2 for t in times)


def write_jsonl(path: Path, rows: Sequence[dict]) -> None:
    """Write ``rows`` as JSONL (atomically): the task's ``train.jsonl`` / ``val.jsonl``."""
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def generate(
    out_dir: str | Path,
    num_videos: int,
    seed: int = 0,
    *,
    codec: str = "h264",
    min_duration: float = 60,
    max_duration: float = 180,
    fps: float = DEFAULT_FPS,
    gop: int = DEFAULT_GOP,
    size: tuple[int, int] = DEFAULT_SIZE,
    val_fraction: float = 0.2,
    oracle: OracleSettings | None = None,
    mcq_variants: int = 1,
    task: str = "cue",
    decoy_share: float = SPOT_DECOY_SHARE,
) -> Path:
    """Write the synthetic task into ``out_dir`` and return it (see the module docstring).

    Videos ``v >= num_videos - round(val_fraction * num_videos)`` (at least one when
    ``num_videos >= 2``) form the validation split; each video yields one mcq, one oe and one
    tvg row (a training video ``mcq_variants`` mcq rows, see :func:`_rows`), and each train row
    one SFT trajectory per overview budget of ``oracle`` (see :func:`_sft`; pass
    :func:`oracle_settings` of the run's config so that the oracle's crops are sampled as the
    run samples them). If ``out_dir/manifest.json`` records the same parameters and every file
    exists, nothing is rewritten; if it records another task (another seed, count, durations,
    task or generator version) the folder is refused (:func:`refuse_other_task`), never
    regenerated under a run that reads it; other oracle settings rewrite ``sft.jsonl``.

    ``task='spot'`` writes the "spot" task instead (:func:`_plan_spot`, :func:`_spot_rows`,
    :func:`_spot_sft`): one square per video, one fixed-option mcq row per video (its colour;
    ``mcq_variants`` does not apply), an oracle that crops the whole video in equal windows
    whenever the overview misses the square, and a forced-answer twin of every direct answer.
    ``task='spot_late'`` / ``'spot_decoy'``: the collapse experiment's tasks whose need for the
    tool the K = 32 overview hides (:func:`_plan_spot_late`, :func:`_plan_spot_decoy`, whose
    share of decoyed videos is ``decoy_share``); every
    spot row records :func:`need_flags`. It is the embedded default's task (preset
    ``tiny_cpu``): every step of it is seeing or a content match, none a copy of digits from an
    arbitrary place, which a 2-layer model does not learn within minutes (measured, see
    ``paravt/models/tiny.py``).
    """
    err = synth_task_error(task, min_duration, max_duration)
    if err:
        raise ValueError(f"generate: {err}")
    if num_videos < 1:
        raise ValueError(f"generate: num_videos={num_videos} must be >= 1")
    if mcq_variants < 1:
        raise ValueError(f"generate: mcq_variants={mcq_variants} must be >= 1")
    if codec not in ENCODERS:
        raise ValueError(f"generate: codec '{codec}' is not one of {sorted(ENCODERS)}")
    if not 0.0 <= decoy_share <= 1.0:
        raise ValueError(f"generate: decoy_share={decoy_share} must be in [0, 1]")
    oracle = oracle or OracleSettings()
    # spot_late keeps its oracle's own records only (its summaries name two squares, and a
    # swap of one colour word could name the other); spot_decoy's crops show the truth, as
    # spot's do, so its tool records are swapped as spot's are (collapse protocol 4).
    if task == "spot_late":
        oracle = replace(oracle, colour_swaps=0)
    out = Path(out_dir)
    params = {
        # 5: need_K* in the spot rows, spot_late, spot_decoy; 6: x264 mbtree=0 (deterministic);
        # 7: the spot colours scarlet and lemon (were red and yellow), colour_swaps;
        # 8: the oracle's call shares (call_share_missed / _seen)
        "version": 8,
        "task": task,
        "num_videos": num_videos,
        "seed": seed,
        "codec": codec,
        "min_duration": min_duration,
        "max_duration": max_duration,
        "fps": fps,
        "gop": gop,
        "size": list(size),
        "val_fraction": val_fraction,
        "oracle": json.loads(json.dumps(asdict(oracle))),  # tuples as JSON lists
        "mcq_variants": mcq_variants,
    }
    if task == "spot_decoy":
        params["decoy_share"] = decoy_share
    manifest = out / "manifest.json"
    ext = ENCODERS[codec][1]
    names = [f"vid_{v:04d}" for v in range(num_videos)]
    files = [out / "videos" / f"{n}{ext}" for n in names]
    files += [out / f for f in ("train.jsonl", "val.jsonl", "sft.jsonl")]
    try:
        old = json.loads(manifest.read_text())["params"]
    except (OSError, ValueError, KeyError, TypeError):
        old = None  # none yet, or unreadable: (re)generate
    if old == params and all(f.exists() for f in files):
        return out
    if isinstance(old, dict):
        refuse_other_task(out, old, params)
    out.mkdir(parents=True, exist_ok=True)
    n_val = 0 if num_videos < 2 else max(1, round(val_fraction * num_videos))
    train, val, plans = [], [], []
    sft: list[SFTRecord] = []
    for v, name in enumerate(names):
        # One RNG per video, seeded from (seed, v): adding videos never changes earlier ones.
        rng = random.Random(f"paravt-synth:{seed}:{v}")
        make_plan = {
            "spot": _plan_spot, "spot_late": _plan_spot_late,
            "spot_decoy": partial(_plan_spot_decoy, decoy_share=decoy_share),
        }.get(task, _plan_video)  # fmt: skip
        plan = make_plan(rng, name, min_duration, max_duration, size)
        plans.append(asdict(plan))
        rel = f"videos/{name}{ext}"
        # Write-then-rename: a crashed or concurrent (multi-rank) run never leaves a
        # half-written video under the final name.
        tmp = out / "videos" / f".{name}.{os.getpid()}.tmp{ext}"
        write_video(tmp, _render(plan, fps, size), fps=fps, gop=gop, codec=codec)
        os.replace(tmp, out / rel)
        train_video = v < num_videos - n_val
        # Held-out videos keep one mcq row each (the evaluation's 3 questions per video).
        if task in SPOT_QUESTIONS:
            rows = _spot_rows(plan, rel, seed, fps, task)
        else:
            rows = _rows(plan, rel, rng, seed, mcq_variants if train_video else 1)
        if train_video:
            train.extend(rows)
            for r in rows:
                for k in oracle.budgets:
                    if task in SPOT_QUESTIONS:
                        sft.extend(_spot_sft(r, plan, fps, k, oracle))
                    else:
                        sft.append(_sft(r, plan, fps, k, oracle))
        else:
            val.extend(rows)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "val.jsonl", val)
    write_sft_records(out / "sft.jsonl", sft)
    write_atomic(manifest, json.dumps({"params": params, "videos": plans}, indent=1) + "\n")
    return out


class SynthFolderTaken(ConfigError):
    """A synthetic task folder holds the task of other settings (another ``data.synth_seed``,
    ...): regenerating it would change the videos under a run that trains on its rows."""


# generate()'s parameter -> the config key that sets it, for the refusal's message.
_PARAM_KEYS = {
    "seed": "data.synth_seed",
    "num_videos": "data.synth_num_videos",
    "task": "data.synth_task",
    "min_duration": "data.synth_min_duration",
    "max_duration": "data.synth_max_duration",
    "mcq_variants": "data.synth_mcq_variants",
    "decoy_share": "data.synth_decoy_share",
    "version": "the generator's version",
}


def refuse_other_task(out: Path, old: dict[str, Any], new: dict[str, Any]) -> None:
    """Raise :class:`SynthFolderTaken` when folder ``out``'s manifest parameters ``old``
    differ from ``new`` in what defines the task: its videos and its rows (every parameter but
    the oracle's settings, which change ``sft.jsonl`` only and are regenerated in place).
    Before issue 66 such a folder was regenerated in place: two runs differing only in
    ``data.synth_seed`` shared ``runs/data/synth``, and the first trained on the second's
    videos against its own (old) answers, silently. Called by :func:`generate`."""
    keys = sorted((set(old) | set(new)) - {"oracle"}, key=str)
    differ = [k for k in keys if old.get(k) != new.get(k)]
    if not differ:
        return
    what = ", ".join(f"{_PARAM_KEYS.get(k, k)} {old.get(k)!r} -> {new.get(k)!r}" for k in differ)
    raise SynthFolderTaken(
        f"{out} holds the synthetic task of other settings ({what}); regenerating it would "
        "change the videos under any run that trains or evaluates on it. Give this run a task "
        f"folder of its own (data.synth_dir={out}-seed{new.get('seed')}), or delete {out} if "
        "no run uses it"
    )


def read_plans(data_dir: str | Path) -> tuple[float, dict[str, VideoPlan]]:
    """A task folder's frame rate and its videos' plans (``manifest.json``), by video name:
    what each video shows, for the oracles and probes that lay out a tool round after the
    fact (the collapse cold start, ``paravt.eval.copy_probe``)."""
    manifest = json.loads((Path(data_dir) / "manifest.json").read_text())
    plans = {}
    for v in manifest["videos"]:
        ev = {"target": Event(**v["target"]), "distractors": [Event(**e) for e in v["distractors"]]}
        plans[v["name"]] = VideoPlan(**{**v, **ev})
    return float(manifest["params"]["fps"]), plans


def generate_from_config(cfg: Any, out_dir: str | Path | None = None) -> Path:
    """The embedded task of a run config (``paravt.config.Config``): ``data.synth_*`` and the
    oracle settings of its video and agent sections, into ``out_dir`` (default
    ``data.synth_dir``). Every command that needs the task (train, rollout) calls this, so
    they agree on the parameters and never regenerate each other's folder."""
    d = cfg.data
    return generate(
        d.synth_dir if out_dir is None else out_dir,
        d.synth_num_videos,
        seed=d.synth_seed,
        min_duration=float(d.synth_min_duration),
        max_duration=float(d.synth_max_duration),
        oracle=oracle_settings(cfg),
        mcq_variants=d.synth_mcq_variants,
        task=d.synth_task,
        decoy_share=float(d.synth_decoy_share),
    )


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m paravt.data.synth", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--num-videos", type=int, default=12)
    p.add_argument(
        "--task", choices=TASKS, default="cue", help="cue (default) | spot | spot_late | spot_decoy"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--codec", choices=sorted(ENCODERS), default="h264")
    p.add_argument("--min-duration", type=float, default=60)
    p.add_argument("--max-duration", type=float, default=180)
    p.add_argument("--fps", type=float, default=DEFAULT_FPS)
    p.add_argument("--gop", type=int, default=DEFAULT_GOP)
    p.add_argument(
        "--sft-budgets", default="4,16", help="overview budgets K of the SFT rows (comma list)"
    )
    a = p.parse_args(argv)
    out = generate(
        a.out,
        a.num_videos,
        a.seed,
        codec=a.codec,
        min_duration=a.min_duration,
        max_duration=a.max_duration,
        fps=a.fps,
        gop=a.gop,
        oracle=OracleSettings(budgets=tuple(int(k) for k in a.sft_budgets.split(","))),
        task=a.task,
    )
    n = {s: sum(1 for _ in open(out / f"{s}.jsonl")) for s in ("train", "val", "sft")}
    log.info(
        f"wrote {a.num_videos} videos to {out}: {n['train']} train / {n['val']} val rows, "
        f"{n['sft']} sft trajectories"
    )


if __name__ == "__main__":
    main()
