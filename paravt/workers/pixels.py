"""An asynchronous run's rollouts travel without their float pixels
(``rollout.async_pixels=frames``, the default, or ``decode``).

``frames`` (since 2026-12-07): each clip's uint8 frames at their patchified size travel (4x
smaller than the float32 patches, each clip once) and the trainer rank re-encodes them with
``encode_frames_batch``, no decode and no video read on the trainer's step: at 720p/1080p
30 fps the decode below is a full decode per group on every trainer rank, 4-12x the trainer's
seconds of ``frames`` (``bench/test_bench_async_pixels.py``, the HD cases); the trainer's
decode deadline (``RolloutPipeline.restore_deadline_s``) is then moot. ``decode`` sends the
fewest bytes (a decode request per clip), as follows.

A finished group's rows carry float32 patches of every clip they saw (and the uint8 frames
they were made from): at 32 prompts a step about 2.5 GB without tool calls and 17 GB with 12
crops a group. Sent as they are (``ship``, the reference), all of it is pickled by the worker,
received and held by trainer rank 0, pickled again and scattered to the trainer rank that
trains each group: every pixel crosses two processes, and rank 0's host memory holds the whole
step's. With ``decode`` the worker sends the token ids and, per clip, the decode request its
frames are exactly the result of (``VisualInputs.requests``: the overview; ``crop_video``'s
crops), and each trainer rank decodes what it trains on:

``ship`` sends each clip once, compacted (:func:`compact_pixels`: a turn's clips are views of
one packed tensor, whose whole storage a pickled view would carry, once per row).

* **worker** (``paravt.workers.worker``): :func:`strip_pixels` replaces each row's
  ``visuals`` by a ``VisualSource``: the requests, a digest of each clip's uint8 frames and its
  grid. A clip with no source (a plug-in tool's view that changed the decoded frames) keeps its
  pixels. Rows sharing one clip object (a group's G main rows and their overview) share one
  source, so one pickle sends it once;
* **trainer rank** (``RolloutPipeline.collect``, after rank 0 split the step by group):
  :func:`restore_pixels` decodes every request of its share in ONE ``DecodePlanner`` run (one
  pass per file, its frame cache: a group's overview is decoded once), checks each clip's
  frames against the worker's digest, re-encodes them with the worker's own
  ``encode_frames_batch`` (one native pixel pack) and puts the visuals back, shared as they
  were. The pixels are then bitwise the worker's: the same decode, the same pack.

A clip whose frames decode differently on the trainer (another decoder build, a file changed
since the rollout) or not at all drops its group, counted as a skipped prompt with an error
naming the file, the times and the fix (``rollout.async_pixels=ship``), like a video the
rollout itself could not decode: nothing trains on pixels the policy did not see.

Under ``frames`` a ``VisualSource`` carries the frames and their times instead of digests
(a plug-in view that changed its frames travels so too: it has frames, not a request), and
``restore_pixels`` re-encodes them in the same one pack; the pixels are bitwise the worker's.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from paravt.agent.context import encode_frames_batch
from paravt.types import (
    FrameRequest,
    Group,
    Trajectory,
    VisualInputs,
    VisualSource,
    own_tensor,
)
from paravt.video.errors import VideoError
from paravt.video.planner import DecodePlanner

if TYPE_CHECKING:
    from paravt.models import ModelBundle


def frames_digest(frames: torch.Tensor) -> str:
    """A digest of uint8 frames ``(T, H, W, 3)``: their shape and bytes (blake2b, 128 bits)."""
    a = np.ascontiguousarray(frames.detach().cpu().numpy())
    h = hashlib.blake2b(repr(tuple(a.shape)).encode(), digest_size=16)
    h.update(a)
    return h.hexdigest()


def _source(
    v: VisualInputs, digests: dict[int, str], owned: dict[int, torch.Tensor] | None = None
) -> VisualSource | None:
    """``v`` as a ``VisualSource``, or None when a segment has no request or frames (with
    ``owned``, the ``frames`` mode: None when a segment has no frames and times, or ``v`` is
    not a video; each distinct frames tensor is copied once into ``owned``)."""
    n = v.num_segments
    if owned is not None:
        if v.frames is None or v.timestamps is None or len(v.frames) != n or v.kind != "video":
            return None
        if len(v.timestamps) != n:
            return None
        for f in v.frames:
            if id(f) not in owned:
                owned[id(f)] = own_tensor(f)
        return VisualSource(
            tuple(v.requests) if v.requests is not None else (),
            (),
            _grids(v),
            v.kind,
            tuple(owned[id(f)] for f in v.frames),
            tuple(tuple(float(x) for x in ts) for ts in v.timestamps),
        )
    if v.requests is None or v.frames is None or len(v.requests) != n or len(v.frames) != n:
        return None
    for f in v.frames:
        if id(f) not in digests:
            digests[id(f)] = frames_digest(f)
    return VisualSource(
        tuple(v.requests),
        tuple(digests[id(f)] for f in v.frames),
        _grids(v),
        v.kind,
    )


def _grids(v: VisualInputs) -> tuple[tuple[int, int, int], ...]:
    return tuple((int(t), int(h), int(w)) for t, h, w in v.grid_thw.tolist())


def _map_rows(groups: list[Group], f: Callable[[Trajectory], Trajectory]) -> list[Group]:
    """Copies of ``groups`` with ``f`` applied to every row (main and sub-agent)."""
    return [
        replace(
            g,
            trajectories=[f(t) for t in g.trajectories],
            sub_trajectories=[f(t) for t in g.sub_trajectories],
        )
        for g in groups
    ]


def strip_pixels(groups: list[Group], frames: bool = False) -> list[Group]:
    """Copies of ``groups`` whose rows carry a ``VisualSource`` instead of their pixels where
    every clip of the row has one (the worker, before sending; ``groups`` are unchanged).
    ``frames`` (``rollout.async_pixels=frames``): the sources carry the clips' uint8 frames
    (each distinct clip once, in storage of its own) instead of digests to decode against."""
    memo: dict[int, VisualSource | None] = {}
    digests: dict[int, str] = {}
    owned: dict[int, torch.Tensor] | None = {} if frames else None

    def strip(t: Trajectory) -> Trajectory:
        v = t.visuals
        if v is None:
            return t
        if id(v) not in memo:
            memo[id(v)] = _source(v, digests, owned)
        src = memo[id(v)]
        return t if src is None else replace(t, visuals=None, visual_source=src)

    return _map_rows(groups, strip)


def compact_pixels(groups: list[Group]) -> list[Group]:
    """Copies of ``groups`` whose clips each hold storage of their own (``ship``: the worker,
    before sending). A turn's clips are views of ONE packed tensor (``encode_frames_batch``),
    and pickling a view sends its whole storage: every crop row of a turn would carry all of
    that turn's crops. Rows sharing a clip object still share its compacted copy."""
    memo: dict[int, VisualInputs] = {}

    def own(t: Trajectory) -> Trajectory:
        v = t.visuals
        if v is None:
            return t
        if id(v) not in memo:
            memo[id(v)] = v.compact()
        return replace(t, visuals=memo[id(v)])

    return _map_rows(groups, own)


@dataclass
class Restored:
    """What :func:`restore_pixels` did on this rank: the groups whose rows all have their
    visuals, the dropped groups' errors, and its ``async/restore_*`` metrics."""

    groups: list[Group]
    errors: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def _key(r: FrameRequest) -> tuple[str, tuple[float, ...], tuple[int, int] | None]:
    return (str(r.video), tuple(r.timestamps), r.size)


def _where(r: FrameRequest) -> str:
    ts = r.timestamps
    size = "decoded size" if r.size is None else f"{r.size[0]}x{r.size[1]}"
    span = f"{ts[0]:.2f}..{ts[-1]:.2f} s" if ts else "no times"
    return f"{r.video} ({len(ts)} frames at {span}, {size})"


def restore_pixels(
    groups: list[Group],
    planner: DecodePlanner,
    bundle: ModelBundle | None,
    who: str = "this trainer rank",
) -> Restored:
    """Put back the visuals of every row of ``groups`` that travelled as a ``VisualSource``
    (see the module docstring): decoded in one planner run, checked against the worker's
    digests and grids, encoded in one pixel pack. Groups with a clip that fails are dropped
    (``Restored.errors``); the others' rows are restored in place."""
    t0 = time.perf_counter()
    sources: dict[int, VisualSource] = {}
    rows = 0
    for g in groups:
        for t in (*g.trajectories, *g.sub_trajectories):
            if t.visual_source is not None:
                sources.setdefault(id(t.visual_source), t.visual_source)
                rows += 1
    if not sources:
        return Restored(groups)
    sent = {sid for sid, s in sources.items() if s.frames is not None}  # frames: no decode
    keys = list(
        dict.fromkeys(_key(r) for sid, s in sources.items() if sid not in sent for r in s.requests)
    )
    before = dict(planner.stats)
    decoded = dict(zip(keys, planner.run([FrameRequest(v, ts, size) for v, ts, size in keys])))
    digests: dict[tuple[Any, ...], str] = {}
    bad: dict[int, str] = {}
    clips: list[tuple[torch.Tensor, list[float]]] = []
    reqs: list[FrameRequest | None] = []
    for sid, src in sources.items():
        if sid in sent:  # the worker's own frames: re-encoded as they are
            assert src.frames is not None and src.timestamps is not None
            for i, f in enumerate(src.frames):
                clips.append((f, list(src.timestamps[i])))
                reqs.append(src.requests[i] if len(src.requests) == len(src.frames) else None)
            continue
        for r, want in zip(src.requests, src.digests):
            fb = decoded[_key(r)]
            if isinstance(fb, VideoError):
                bad[sid] = f"{_where(r)} could not be decoded on {who} ({fb.problem})"
                break
            got = digests.get(_key(r))
            if got is None:
                got = digests[_key(r)] = frames_digest(fb.frames)
            if got != want:
                bad[sid] = (
                    f"the frames of {_where(r)} decoded on {who} differ from those the rollout "
                    f"worker encoded (digest {got} != {want}): the two decode this file "
                    "differently (another decoder build, or the file changed since the "
                    "rollout); set rollout.async_pixels=ship to send the pixels instead"
                )
                break
        if sid not in bad:
            for r in src.requests:
                fb = decoded[_key(r)]
                clips.append((fb.frames, [float(x) for x in fb.timestamps]))  # type: ignore[union-attr]
                reqs.append(r)
    encoded = iter(encode_frames_batch(bundle, clips, reqs))  # type: ignore[arg-type]
    built: dict[int, VisualInputs] = {}
    for sid, src in sources.items():
        if sid in bad:
            continue
        parts = [next(encoded).visuals for _ in src.grids]
        vis = parts[0] if len(parts) == 1 else VisualInputs.concat(parts)
        assert vis is not None
        grids = _grids(vis)
        if grids != src.grids or vis.kind != src.kind:
            what = _where(src.requests[0]) if src.requests else "a clip sent as frames"
            bad[sid] = (
                f"the clips of {what} re-encoded on {who} have grids {grids} "
                f"({vis.kind}), the worker's {src.grids} ({src.kind}): the trainer and the "
                "worker encode differently (model.vision settings); set "
                "rollout.async_pixels=ship to send the pixels instead"
            )
            continue
        built[sid] = vis
    kept, errors = [], []
    for g in groups:
        rows_g = (*g.trajectories, *g.sub_trajectories)
        why = next((bad[id(t.visual_source)] for t in rows_g if id(t.visual_source) in bad), None)
        if why is not None:
            errors.append(f"{g.sample.id}: its rollouts were dropped: {why}")
            continue
        for t in rows_g:
            if t.visual_source is not None:
                t.visuals, t.visual_source = built[id(t.visual_source)], None
        kept.append(g)
    after = planner.stats
    metrics = {
        "async/restore_s": time.perf_counter() - t0,
        "async/restore_rows": float(rows),
        "async/restore_clips": float(len(sources)),
        "async/restore_frames_decoded": float(after["frames_decoded"] - before["frames_decoded"]),
        "async/restore_cache_hits": float(after["cache_hits"] - before["cache_hits"]),
        "async/restore_clips_sent_as_frames": float(len(sent)),
        "async/restore_dropped_groups": float(len(groups) - len(kept)),
    }
    return Restored(kept, errors, metrics)
