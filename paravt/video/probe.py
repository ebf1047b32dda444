"""``probe``: container/stream metadata and the keyframe index, in-process (no ffprobe).

The file is demuxed packet by packet without decoding. Every video packet gives one frame's
presentation timestamp (pts) and keyframe flag; sorting the pts gives display order, so frame
``i`` (display order) is shown from ``times[i]`` until ``times[i + 1]``. That per-frame index
is what makes decoding frame-accurate: the frame for time ``t`` is the last frame whose pts is
``<= t`` (see :meth:`StreamIndex.indices_at`), the same rule for every backend.

Demuxing a 300 s, 4 fps clip takes a few milliseconds; results are cached per
``(path, size, mtime)`` so the planner probes each file once per process.
"""

from __future__ import annotations

import bisect
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import av

from paravt.types import VideoMeta
from paravt.video.deadline import DEFAULT_DECODE_TIMEOUT_S, with_deadline
from paravt.video.errors import VideoError

# Tolerance (seconds) when comparing a requested time with frame times: callers compute times
# as ``i / fps`` in float while pts are integer multiples of the stream time base.
TIME_EPS = 1e-6

_PROBE_CACHE_SIZE = 1024


@dataclass(frozen=True)
class StreamIndex:
    """Per-frame index of one video stream (display order), kept beside its ``VideoMeta``.

    ``pts[i]`` is frame ``i``'s presentation timestamp in ``time_base`` units; ``times[i]`` is
    the same in seconds relative to the first frame (so ``times[0] == 0``).
    """

    meta: VideoMeta
    pts: tuple[int, ...]
    times: tuple[float, ...]
    time_base: Fraction
    stream_index: int
    file_key: tuple[int, int]  # (st_size, st_mtime_ns): invalidates caches on rewrite
    # Duration the container header declares (s), when it claims more than the packets hold:
    # the file is truncated and only ``meta.duration`` seconds are readable.
    declared_duration: float | None = None

    def indices_at(self, timestamps: Sequence[float]) -> list[int]:
        """Display index of the frame shown at each time ``t`` (seconds from the first frame).

        Rule: the last frame with ``times[i] <= t`` (+``TIME_EPS``). ``t`` must lie in
        ``[0, duration]``; ``t == duration`` maps to the last frame.
        """
        dur = self.meta.duration
        out = []
        for t in timestamps:
            t = float(t)
            if not math.isfinite(t) or t < -TIME_EPS or t > dur + TIME_EPS:
                why = (
                    f" (the file is truncated: its header declares {self.declared_duration:.3f}"
                    " s but only the first frames are present)"
                    if self.declared_duration is not None
                    else ""
                )
                raise VideoError(
                    self.meta.path,
                    f"timestamp {t:.3f} s is outside the video [0, {dur:.3f}] s{why}; clamp the "
                    "window to the video's duration",
                )
            out.append(max(0, bisect.bisect_right(self.times, t + TIME_EPS) - 1))
        return out


_cache: OrderedDict[tuple[str, int, int], StreamIndex] = OrderedDict()
_cache_lock = threading.Lock()


def _file_key(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise VideoError(path, "file not found; check the dataset's video_root") from None
    except OSError as e:
        raise VideoError(path, f"cannot stat the file ({e.strerror})") from None
    if not os.path.isfile(path):
        # Never open it: opening a FIFO for reading blocks until a writer appears.
        raise VideoError(
            path,
            "is not a regular file (a FIFO, device or socket); point the dataset at the "
            "video file itself",
        )
    if st.st_size == 0:
        raise VideoError(path, "file is empty (0 bytes); re-download or re-encode it")
    return st.st_size, st.st_mtime_ns


def stream_index(path: str, timeout_s: float | None = DEFAULT_DECODE_TIMEOUT_S) -> StreamIndex:
    """Probe ``path`` (cached) and return its per-frame index. Raises ``VideoError``, also
    when the ``stat`` or the probe takes longer than ``timeout_s`` seconds (a FIFO, a stalled
    mount; None = no deadline; see ``paravt.video.deadline``)."""
    path = str(path)
    return with_deadline(lambda: _stream_index(path), timeout_s, path, "probing the file")


def _stream_index(path: str) -> StreamIndex:
    key = (path, *_file_key(path))
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    idx = _probe_uncached(path, key[1:])
    with _cache_lock:
        _cache[key] = idx
        while len(_cache) > _PROBE_CACHE_SIZE:
            _cache.popitem(last=False)
    return idx


def clear_probe_cache() -> None:
    """Forget every probed file (benchmarks use it to measure cold probing)."""
    with _cache_lock:
        _cache.clear()


def probe(path: str, timeout_s: float | None = DEFAULT_DECODE_TIMEOUT_S) -> VideoMeta:
    """Metadata of the first video stream of ``path``: duration, fps, frame count, size, codec
    and keyframe indices (display order). No subprocess; no frame is decoded.

    Raises ``VideoError`` for a missing/empty/unreadable file, one without a video stream, a
    FIFO or other non-regular file (never opened: opening a FIFO blocks until a writer comes),
    or a probe that takes longer than ``timeout_s`` seconds (``video.decode_timeout_s``).
    """
    return stream_index(path, timeout_s).meta


def _probe_uncached(path: str, file_key: tuple[int, int]) -> StreamIndex:
    try:
        container = av.open(path, metadata_errors="ignore")
    except av.error.FFmpegError as e:
        raise VideoError(
            path, f"cannot open as a video container ({e}); the file is truncated or not a video"
        ) from None
    try:
        if not container.streams.video:
            raise VideoError(path, "has no video stream (audio-only or data file)")
        stream = container.streams.video[0]
        if stream.time_base is None:
            raise VideoError(path, "video stream has no time base; re-mux the file")
        pts_kf: list[tuple[int, bool]] = []
        try:
            for packet in container.demux(stream):
                # The demuxer ends with an empty flush packet; packets without pts
                # (raw elementary streams) fall back to dts.
                if packet.size == 0:
                    continue
                ts = packet.pts if packet.pts is not None else packet.dts
                if ts is None:
                    raise VideoError(path, "video packets carry no timestamps; re-mux into mp4/mkv")
                pts_kf.append((int(ts), bool(packet.is_keyframe)))
        except av.error.FFmpegError as e:
            raise VideoError(
                path, f"demuxing failed ({e}); the file is truncated or corrupt"
            ) from None
        if not pts_kf:
            raise VideoError(path, "video stream has no frames")
        pts_kf.sort()
        # Duplicate pts (broken muxers) would make two frames share one display time.
        pts = [p for p, _ in pts_kf]
        if len(set(pts)) != len(pts):
            raise VideoError(path, "video stream has duplicate timestamps; re-mux the file")
        keyframes = tuple(i for i, (_, k) in enumerate(pts_kf) if k)
        if not keyframes or keyframes[0] != 0:
            # Streams that do not start on a keyframe: frames before the first keyframe cannot
            # be decoded on their own; treat frame 0 as a seek point anyway (decoders output
            # from the first decodable frame and the planner reports anything missing).
            keyframes = (0, *keyframes)
        tb = Fraction(stream.time_base)
        t0 = pts[0]
        times = tuple(float((p - t0) * tb) for p in pts)
        n = len(pts)
        if n > 1:
            # Last frame lasts one average frame interval (packet durations are unreliable).
            frame_dur = times[-1] / (n - 1)
        else:
            rate = stream.average_rate or stream.guessed_rate
            frame_dur = float(1 / rate) if rate else 0.0
        duration = times[-1] + frame_dur
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else (n / duration if duration > 0 else 0.0)
        cc = stream.codec_context
        meta = VideoMeta(
            path=path,
            duration=duration,
            fps=fps,
            num_frames=n,
            width=int(cc.width),
            height=int(cc.height),
            codec=str(cc.name),
            keyframes=keyframes,
            start_time=float(t0 * tb),
        )
        if meta.width <= 0 or meta.height <= 0:
            raise VideoError(path, f"video stream has invalid size {meta.width}x{meta.height}")
        declared = None
        if stream.duration is not None:
            declared = float(stream.duration * tb)
        elif container.duration is not None:
            declared = container.duration / 1e6  # AV_TIME_BASE units
        if declared is not None and declared <= duration + 1.5 * frame_dur:
            declared = None  # consistent with the packets: not truncated
        return StreamIndex(meta, tuple(pts), times, tb, stream.index, file_key, declared)
    finally:
        container.close()
