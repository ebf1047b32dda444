"""``probe``: container/stream metadata and the keyframe index, in-process (no ffprobe).

The file is demuxed packet by packet; only the first frame is decoded (its display matrix gives
the rotation). Every video packet gives one frame's presentation timestamp (pts) and keyframe
flag; sorting the pts gives display order, so frame ``i`` (display order) is shown from
``times[i]`` until ``times[i + 1]``. That per-frame index is what makes decoding frame-accurate:
the frame for time ``t`` is the last frame whose pts is ``<= t`` (see
:meth:`StreamIndex.indices_at`), the same rule for every backend.

What "the video" of a file is, as a player shows it:

* the stream: the first video stream that is not an attached picture (cover art), whatever its
  overall index (an audio stream often comes first; a second video track is ignored);
* the frames: packets an mp4 edit list hides (the pre-roll of a file cut with ``ffmpeg -ss …
  -c copy``, flagged "discard" by the demuxer) are not frames of the video; the decoder still
  needs them as references, and the backends decode them without returning them;
* the timeline: seconds from the container's start (the earliest start of its audio/video
  streams), what a player shows as 0:00. For almost every file that is the first frame; a
  video stream that starts after its audio starts at ``VideoMeta.start_time`` (a dataset
  annotated in a player means that timeline), and a time before it shows the first frame;
* the picture: ``width``/``height`` are the displayed size, after the pixel aspect (SAR; the
  width is scaled) and the rotation of the display matrix (phones), which the backends apply
  to every frame they return (``paravt.video.display``).

Demuxing a 300 s, 4 fps clip takes a few milliseconds; results are cached per
``(path, size, mtime)`` in an LRU bounded in bytes (``PROBE_CACHE_BYTES``): the index costs 16
bytes a frame (an int64 pts and a float64 time), 1.7 MB for an hour at 30 fps.
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import av
import numpy as np

from paravt.types import VideoMeta
from paravt.video.deadline import DEFAULT_DECODE_TIMEOUT_S, with_deadline
from paravt.video.errors import VideoError

# Tolerance (seconds) when comparing a requested time with frame times: callers compute times
# as ``i / fps`` in float while pts are integer multiples of the stream time base.
TIME_EPS = 1e-6

# Bytes of probed indexes kept per process (an LRU over files). 256 MB holds ~150 hour-long
# 30 fps videos or tens of thousands of short clips; the old bound of 1,024 files held up to
# ~8 GB of Python ints and floats for hour-long videos.
PROBE_CACHE_BYTES = 256 << 20
# Fixed cost of one cached file (the records, the dict entry) counted on top of its arrays, so
# that many tiny files are bounded too.
_ENTRY_OVERHEAD = 2048
# How many packets the probe feeds the decoder to get the first frame (its display matrix).
_FIRST_FRAME_PACKETS = 64


@dataclass(frozen=True, eq=False)
class StreamIndex:
    """Per-frame index of one video stream (display order), kept beside its ``VideoMeta``.

    ``pts[i]`` (int64) is frame ``i``'s presentation timestamp in ``time_base`` units;
    ``times[i]`` (float64) is the same in seconds relative to the first frame (so
    ``times[0] == 0``; the first frame is shown at ``meta.start_time`` on the file's timeline).
    ``stream_index`` is the stream's overall index in the container (``container.streams[i]``).
    """

    meta: VideoMeta
    pts: np.ndarray
    times: np.ndarray
    time_base: Fraction
    stream_index: int
    file_key: tuple[int, int]  # (st_size, st_mtime_ns): invalidates caches on rewrite
    # Duration the container header declares (s), when it claims more than the packets hold
    # but within ``CUT_FRAC`` (a larger gap is refused at probe as a file cut short): only
    # ``meta.duration`` seconds are readable.
    declared_duration: float | None = None

    @property
    def nbytes(self) -> int:
        """Bytes this index holds (what the probe cache counts)."""
        kf = len(self.meta.keyframes)
        return int(self.pts.nbytes + self.times.nbytes) + 36 * kf + _ENTRY_OVERHEAD

    def indices_at(self, timestamps: Sequence[float]) -> list[int]:
        """Display index of the frame shown at each time ``t`` (seconds on the file's
        timeline, see the module docstring).

        Rule: the last frame with ``start_time + times[i] <= t`` (+``TIME_EPS``); a time before
        the first frame shows the first frame. ``t`` must lie in ``[0, duration]``;
        ``t == duration`` maps to the last frame.
        """
        dur = self.meta.duration
        t0 = self.meta.start_time
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
            i = int(np.searchsorted(self.times, t - t0 + TIME_EPS, side="right")) - 1
            out.append(max(0, i))
        return out

    def index_of_pts(self, pts: int | None) -> int | None:
        """Display index of the frame with this pts, or None (not a frame of the video)."""
        if pts is None:
            return None
        i = int(np.searchsorted(self.pts, pts))
        return i if i < len(self.pts) and int(self.pts[i]) == pts else None


_cache: OrderedDict[tuple[str, int, int], StreamIndex] = OrderedDict()
_cache_bytes = 0
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
    global _cache_bytes
    with _cache_lock:
        old = _cache.pop(key, None)
        if old is not None:
            _cache_bytes -= old.nbytes
        if idx.nbytes <= PROBE_CACHE_BYTES:
            _cache[key] = idx
            _cache_bytes += idx.nbytes
        while _cache_bytes > PROBE_CACHE_BYTES and _cache:
            _, ev = _cache.popitem(last=False)
            _cache_bytes -= ev.nbytes
    return idx


def clear_probe_cache() -> None:
    """Forget every probed file (benchmarks use it to measure cold probing)."""
    global _cache_bytes
    with _cache_lock:
        _cache.clear()
        _cache_bytes = 0


def probe_cache_info() -> dict[str, int]:
    """``{"files", "bytes", "max_bytes"}`` of the probe cache (``PROBE_CACHE_BYTES``)."""
    with _cache_lock:
        return {"files": len(_cache), "bytes": _cache_bytes, "max_bytes": PROBE_CACHE_BYTES}


def _last_packet_end(container: Any, declared: float) -> float:
    """The latest end (s) of any stream's packets in the file's last seconds before
    ``declared`` (0.0 when the file cannot be read there: a cut file)."""
    end = 0.0
    try:
        container.seek(max(0, int((declared - 5.0) * 1e6)), backward=True, any_frame=True)
        for pkt in container.demux():
            if pkt.pts is None or pkt.time_base is None:
                continue
            end = max(end, float((pkt.pts + (pkt.duration or 0)) * pkt.time_base))
    except (av.error.FFmpegError, OSError):
        pass
    return end


def probe(path: str, timeout_s: float | None = DEFAULT_DECODE_TIMEOUT_S) -> VideoMeta:
    """Metadata of the video of ``path`` (see the module docstring for which stream, frames and
    timeline): duration, fps, frame count, displayed size, codec, rotation, pixel aspect and
    keyframe indices (display order). No subprocess; only the first frame is decoded.

    Raises ``VideoError`` for a missing/empty/unreadable file, one without a video stream, a
    FIFO or other non-regular file (never opened: opening a FIFO blocks until a writer comes),
    or a probe that takes longer than ``timeout_s`` seconds (``video.decode_timeout_s``).
    """
    return stream_index(path, timeout_s).meta


def _video_stream(container: av.container.InputContainer) -> av.VideoStream | None:
    """The stream a player shows: the first video stream that is not cover art."""
    for st in container.streams.video:
        if not st.disposition & av.stream.Disposition.attached_pic:
            return st
    return None


def _timeline_start(container: av.container.InputContainer) -> float | None:
    """Seconds of the container's 0:00: the earliest start of its audio and video streams."""
    starts = [
        float(st.start_time * st.time_base)
        for st in container.streams
        if st.type in ("audio", "video") and st.start_time is not None and st.time_base
    ]
    return min(starts) if starts else None


def _rotation(frame: av.VideoFrame | None) -> int:
    """Counter-clockwise degrees (0, 90, 180, 270) the display matrix turns the stored frame."""
    if frame is None:
        return 0
    try:
        deg = float(frame.rotation)
    except Exception:  # noqa: BLE001 - no or malformed display matrix: show as stored
        return 0
    return int(round(deg / 90.0)) * 90 % 360


#: A gap between two frames' timestamps this many intervals of the declared rate (and at
#: least ``HOLE_MIN_S``) in a stream that lacks at least as many frames of that rate is a hole:
#: the frames of that span are lost (a zeroed or cut cluster of a webm/mkv demuxes as a jump,
#: and every frame sampled in it would be the one before it, held).
HOLE_INTERVALS = 10
HOLE_MIN_S = 1.0


def _refuse_hole(path: str, times: np.ndarray, rate: float) -> None:
    """Raise ``VideoError`` when ``times`` (seconds, sorted) jump by a hole (``HOLE_*``) of a
    stream that declares ``rate`` fps but whose frames do not fill its span at that rate.
    A variable-rate mp4 (a screen recording that holds still) declares its average rate,
    which its frame count matches, and passes. A variable-rate mkv that holds still for
    ``HOLE_INTERVALS`` frames declares its encoder's nominal rate and is refused like a hole:
    the two are the same timestamps; re-muxed to mp4 it passes."""
    if rate <= 0 or len(times) < 2:
        return
    if float(times[-1]) * rate - (len(times) - 1) < HOLE_INTERVALS:
        return  # the frames fill the span at the declared rate, but for a few
    gaps = np.diff(times)
    i = int(np.argmax(gaps))
    gap = float(gaps[i])
    if gap < max(HOLE_INTERVALS / rate, HOLE_MIN_S):
        return
    raise VideoError(
        path,
        f"timestamps jump from {times[i]:.2f} s to {times[i + 1]:.2f} s ({gap * rate:.0f} frame "
        f"intervals of its declared {rate:g} fps): the frames between are lost, and every "
        "frame sampled there would be the one before, held; the file is corrupt or was cut: "
        "re-encode or re-download it (a variable-rate mkv that holds still that long: re-mux "
        "it to mp4)",
    )


#: A file whose header declares a duration longer than its frames reach by more than
#: ``max(CUT_MIN_S, CUT_FRAC * declared)`` is refused at probe as cut short (a webm/mkv cut
#: mid-file demuxes up to the cut and would otherwise probe as a shorter video, its answers
#: scored against a video that is not there). Files that are whole differ by far less: mkv
#: stores milliseconds, the last frame's duration is estimated, and a container's duration
#: spans an audio track that outlasts the picture by its priming/padding (tens of ms) or a
#: short tail. 10% (and 1 s, for short clips where one frame is several %) is above those and
#: far below a cut at 50% (measured: a 6 s VP9 webm cut at 30/50/80% probes as 0.5/1.5/4.25 s).
#: A smaller gap (a cut in the last 10%) still probes as the shorter video; a time past its
#: end is then refused naming the declared duration (``StreamIndex.indices_at``).
CUT_FRAC = 0.10
CUT_MIN_S = 1.0


def _sample_aspect(stream: av.VideoStream) -> Fraction:
    sar = stream.sample_aspect_ratio or stream.codec_context.sample_aspect_ratio
    if not sar or sar <= 0:
        return Fraction(1)
    return Fraction(sar)


def _probe_uncached(path: str, file_key: tuple[int, int]) -> StreamIndex:
    """:func:`_probe_fields`; whatever else a corrupt file makes PyAV raise (an
    ``AttributeError`` on a stream without a decoder, a ``ValueError`` on a nonsense field)
    becomes a ``VideoError`` naming the file, which the agent loop skips like any other."""
    try:
        return _probe_fields(path, file_key)
    except VideoError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt file must not escape as a raw error
        raise VideoError(
            path, f"probing failed ({type(e).__name__}: {e}); the file is corrupt or truncated"
        ) from None


def _probe_fields(path: str, file_key: tuple[int, int]) -> StreamIndex:
    try:
        container = av.open(path, metadata_errors="ignore")
    except av.error.FFmpegError as e:
        raise VideoError(
            path, f"cannot open as a video container ({e}); the file is truncated or not a video"
        ) from None
    try:
        stream = _video_stream(container)
        if stream is None:
            raise VideoError(path, "has no video stream (audio-only or data file)")
        if stream.time_base is None:
            raise VideoError(path, "video stream has no time base; re-mux the file")
        if stream.codec_context is None:  # an unknown or corrupt codec tag: nothing decodes it
            raise VideoError(
                path,
                "video stream's codec is unknown or has no decoder here (a corrupt codec "
                "tag, or a codec this FFmpeg lacks); re-encode the file to H.264",
            )
        pts_kf: list[tuple[int, bool]] = []
        first: av.VideoFrame | None = None
        fed = 0
        try:
            for packet in container.demux(stream):
                # The demuxer ends with an empty flush packet; packets without pts
                # (raw elementary streams) fall back to dts.
                if packet.size == 0:
                    continue
                if first is None and fed < _FIRST_FRAME_PACKETS:
                    fed += 1
                    try:
                        first = next(iter(packet.decode()), None)
                    except Exception:  # noqa: BLE001 - best effort: a bad first packet or
                        pass  # a missing decoder leaves the display matrix unknown (0 degrees)
                if packet.is_discard:
                    continue  # hidden by an edit list: a reference, not a frame of the video
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
        pts = np.array([p for p, _ in pts_kf], dtype=np.int64)
        if len(np.unique(pts)) != len(pts):
            raise VideoError(path, "video stream has duplicate timestamps; re-mux the file")
        keyframes = tuple(i for i, (_, k) in enumerate(pts_kf) if k)
        if not keyframes or keyframes[0] != 0:
            # Streams that do not start on a keyframe (or whose keyframe an edit list hides):
            # frames before the first keyframe need the one before them; treat frame 0 as a
            # seek point anyway (the seek lands on the keyframe before it, and the planner
            # reports anything the decoder cannot produce).
            keyframes = (0, *keyframes)
        tb = Fraction(stream.time_base)
        t0 = int(pts[0])
        times = (pts - t0).astype(np.float64) * float(tb)
        n = len(pts)
        declared_rate = stream.average_rate or stream.guessed_rate
        span = float(times[-1])
        if n > 1 and span > 0:
            # The true average rate. The declared one is kept when it agrees (within 1%: mkv
            # stores milliseconds), as it is exact for constant-rate files; a muxer's nominal
            # rate for a variable-rate stream (mkv's DefaultDuration) does not agree.
            measured = (n - 1) / span
            fps = measured
            if declared_rate and abs(float(declared_rate) - measured) <= 0.01 * measured:
                fps = float(declared_rate)
            frame_dur = span / (n - 1)  # the last frame lasts one average frame interval
            if declared_rate and fps != float(declared_rate):
                _refuse_hole(path, times, float(declared_rate))
        else:
            fps = float(declared_rate) if declared_rate else 0.0
            frame_dur = 1 / fps if fps > 0 else 0.0
        first_time = float(t0 * tb)
        origin = _timeline_start(container)
        # Seconds from the file's 0:00 to the first frame (never negative: a video that
        # starts first defines 0:00).
        start = max(0.0, first_time - origin) if origin is not None else 0.0
        duration = start + span + frame_dur
        cc = stream.codec_context
        rotation = _rotation(first)
        sar = _sample_aspect(stream)
        width, height = int(cc.width), int(cc.height)
        if width <= 0 or height <= 0:
            raise VideoError(path, f"video stream has invalid size {width}x{height}")
        if sar != 1:
            width = max(1, round(width * sar))  # as players do: scale the width
        if rotation in (90, 270):
            width, height = height, width
        meta = VideoMeta(
            path=path,
            duration=duration,
            fps=fps,
            num_frames=n,
            width=width,
            height=height,
            # The codec's name ('av1'), not the decoder's ('libdav1d'): backends match on it.
            codec=str(cc.codec.canonical_name),
            keyframes=keyframes,
            start_time=start,
            rotation=rotation,
            sample_aspect=float(sar),
        )
        # The duration the header declares, on the file's timeline (a stream's own duration
        # starts at its first frame; the container's at 0:00).
        declared = None
        whole_file = False  # the declared duration is the container's (all its streams)
        if stream.duration is not None:
            declared = start + float(stream.duration * tb)
        elif container.duration is not None:
            declared = container.duration / 1e6  # AV_TIME_BASE units
            whole_file = True
        if declared is not None and declared <= duration + 1.5 * frame_dur:
            declared = None  # consistent with the packets: not truncated
        short = max(CUT_MIN_S, CUT_FRAC * declared) if declared is not None else 0.0
        if declared is not None and whole_file and len(container.streams) > 1:
            # The container's duration spans every stream: an audio track that outlasts the
            # picture is a whole file; a cut one ends every stream early.
            if _last_packet_end(container, declared) >= declared - short:
                declared = None
        if declared is not None and declared - duration > short:
            raise VideoError(
                path,
                f"its header declares {declared:.3f} s but its frames end at {duration:.3f} s "
                f"({1 - duration / declared:.0%} missing): the file looks cut short (an "
                "interrupted download or copy); re-download or re-encode it",
            )
        return StreamIndex(meta, pts, times, tb, stream.index, file_key, declared)
    finally:
        container.close()
