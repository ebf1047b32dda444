"""A corpus of real-world-shaped video files, written at test time by PyAV's bundled encoders.

Every displayed frame carries its own index as a barcode: the top half of the frame is
``BARCODE_BITS`` full-height vertical bars (black = 0, white = 1, most significant bit left),
the bottom half is mid-grey with a small moving square (so inter frames carry motion). The
bars are a quarter of the frame wide at the smallest size here, so every lossy codec keeps
them; a frame that comes back sideways, upside down or mirrored reads as an error or as a wrong
index, never as the right one (the grey bottom half is checked too).

``build_corpus(root)`` writes each case once (about 1.5 s on 2 cores) and returns
``{name: Case}``; each ``Case`` says which barcode is on screen at every time of the file's
own timeline, so a test can check ``decode(path, ts)`` frame by frame. The cases cover the
files users' benchmarks ship: H.264 (B-frames, long GOP), HEVC 8/10-bit, VP9 (also with no
duration or seek index), AV1, MPEG-4 part 2 in AVI, MJPEG, variable frame rate in mp4 and mkv,
sizes that are not multiples of 16, and the hostile-but-common ones of issue 34: an audio
stream first, two video tracks, an mp4 trimmed without re-encoding (edit list), phone rotation,
streams that start late, non-square pixels, a corrupt packet.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its whole config at info level

BARCODE_BITS = 8
GREY = 128


# ------------------------------------------------------------------------------- barcode
def barcode_frame(index: int, h: int, w: int, t: int | None = None) -> np.ndarray:
    """An (h, w, 3) uint8 RGB frame whose top half encodes ``index`` (< 2**BARCODE_BITS)."""
    if not 0 <= index < 2**BARCODE_BITS:
        raise ValueError(f"barcode index {index} does not fit in {BARCODE_BITS} bits")
    f = np.full((h, w, 3), GREY, np.uint8)
    edges = [round(b * w / BARCODE_BITS) for b in range(BARCODE_BITS + 1)]
    for b in range(BARCODE_BITS):
        bit = (index >> (BARCODE_BITS - 1 - b)) & 1
        f[: h // 2, edges[b] : edges[b + 1]] = 255 if bit else 0
    s = max(2, h // 8)
    x = ((index if t is None else t) * 3) % max(1, w - s)
    f[h // 2 + h // 8 : h // 2 + h // 8 + s, x : x + s] = 200
    return f


def read_barcode(frame: np.ndarray) -> int:
    """The index ``barcode_frame`` drew, read back from a decoded (possibly resized) frame.

    Raises ``ValueError`` when a bar is neither clearly black nor white, or the bottom half is
    not grey: a frame turned sideways or upside down never reads as a valid index.
    """
    a = np.asarray(frame)
    if a.ndim != 3 or a.shape[-1] != 3:
        raise ValueError(f"read_barcode: expected an (H, W, 3) frame, got {a.shape}")
    h, w = a.shape[:2]
    y0, y1 = h // 8, max(h // 8 + 1, (3 * h) // 8)
    edges = [round(b * w / BARCODE_BITS) for b in range(BARCODE_BITS + 1)]
    value = 0
    for b in range(BARCODE_BITS):
        x0, x1 = edges[b], edges[b + 1]
        q = (x1 - x0) // 4
        m = float(a[y0:y1, x0 + q : max(x0 + q + 1, x1 - q)].astype(np.float32).mean())
        if 64 <= m <= 191:
            raise ValueError(f"read_barcode: bar {b} has mean {m:.0f} (neither black nor white)")
        value = (value << 1) | int(m > 127.5)
    # The grey band just under the bars (above the moving square) must be grey.
    band = a[h // 2 + h // 32 + 1 : h // 2 + h // 8 - 1 or None, w // 8 : w - w // 8]
    if band.size and not 96 <= float(band.astype(np.float32).mean()) <= 160:
        raise ValueError("read_barcode: the bottom half is not grey (frame upside down?)")
    return value


# ------------------------------------------------------------------------------- the cases
@dataclass
class Case:
    """One corpus file and what a correct reader must see in it.

    ``times[k]`` is when displayed frame ``k`` appears, in seconds on the file's timeline (0 =
    the container's start, what a player shows as 0:00); ``codes[k]`` is its barcode.
    ``undecodable`` are display frames a decoder cannot produce (corrupt data).
    """

    name: str
    path: str
    container: str
    codec: str
    width: int  # display size (after rotation and pixel aspect)
    height: int
    fps: float
    times: list[float]
    codes: list[int]
    covers: str
    undecodable: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.container in ("mkv", "webm"):
            # Matroska stores milliseconds: 1/30 s is written as 0.033 s.
            self.times = [round(t, 3) for t in self.times]

    @property
    def duration(self) -> float:
        n = len(self.times)
        span = self.times[-1] - self.times[0]
        return self.times[-1] + (span / (n - 1) if n > 1 else 1 / self.fps)

    def code_at(self, t: float) -> int:
        """Barcode on screen at ``t``: the last frame with ``times[k] <= t`` (frame 0 before)."""
        k = max(0, int(np.searchsorted(self.times, t + 1e-6, side="right")) - 1)
        return self.codes[k]

    def frame_at(self, t: float) -> int:
        return max(0, int(np.searchsorted(self.times, t + 1e-6, side="right")) - 1)

    def probe_times(self) -> list[float]:
        """Every frame's midpoint (and its start), plus a few times before the first frame."""
        ts = [0.0]
        for k, t in enumerate(self.times):
            nxt = self.times[k + 1] if k + 1 < len(self.times) else self.duration
            ts += [t, (t + nxt) / 2]
        return sorted({round(x, 9) for x in ts if x <= self.duration})


def _sine(n: int, rate: int, channels: int = 1) -> np.ndarray:
    t = np.arange(n) / rate
    return np.tile((0.2 * np.sin(2 * math.pi * 440 * t)).astype(np.float32), (channels, 1))


def _add_audio(c: av.container.OutputContainer, codec: str = "aac") -> av.AudioStream:
    a = c.add_stream(codec, rate=16000)
    a.layout = "mono"
    if codec == "pcm_s16le":
        a.format = "s16"
    return a


def _mux_audio(
    c: av.container.OutputContainer, a: av.AudioStream, seconds: float, start: float = 0.0
) -> None:
    rate = a.rate
    fmt = a.format.name
    frame_n = a.frame_size or 1024
    total = int(seconds * rate)
    pts = int(start * rate)
    for s0 in range(0, total, frame_n):
        n = min(frame_n, total - s0)
        x = _sine(n, rate)
        if fmt == "s16":
            arr = (x * 32767).astype(np.int16)
        else:
            arr = x
        fr = av.AudioFrame.from_ndarray(arr, format=fmt, layout="mono")
        fr.sample_rate = rate
        fr.pts = pts + s0
        fr.time_base = Fraction(1, rate)
        c.mux(a.encode(fr))
    c.mux(a.encode(None))


def _video_stream(
    c: av.container.OutputContainer,
    encoder: str,
    fps: Fraction,
    size: tuple[int, int],
    *,
    gop: int = 12,
    bframes: int = 0,
    pix_fmt: str = "yuv420p",
) -> av.VideoStream:
    s = c.add_stream(encoder, rate=fps)
    s.height, s.width = size
    s.pix_fmt = pix_fmt
    s.thread_count = 1
    s.gop_size = gop
    if encoder == "libx264":
        s.options = {
            "preset": "veryfast",
            "crf": "18",
            # mbtree=0: x264's macroblock tree reads uninitialised memory (the bytes change from
            # run to run; paravt/data/synth.py found it)
            "x264-params": f"keyint={gop}:min-keyint={gop}:scenecut=0:bframes={bframes}:mbtree=0",
        }
    elif encoder == "libx265":
        s.options = {
            "preset": "ultrafast",
            "crf": "18",
            "x265-params": f"log-level=error:keyint={gop}:min-keyint={gop}:scenecut=0:"
            f"bframes={bframes}:pools=1:frame-threads=1",
        }
    elif encoder == "libvpx-vp9":
        s.options = {"crf": "20", "b": "0", "deadline": "realtime", "cpu-used": "8"}
    elif encoder == "libsvtav1":
        s.options = {"preset": "12", "crf": "30", "svtav1-params": f"keyint={gop}"}
    elif encoder in ("mpeg4", "mjpeg"):
        s.options = {"qscale": "3"} if encoder == "mpeg4" else {}
        if encoder == "mjpeg":
            s.pix_fmt = "yuvj420p"
    return s


def _mux_video(
    c: av.container.OutputContainer,
    s: av.VideoStream,
    codes: Sequence[int],
    pts: Sequence[int],
    *,
    tb: Fraction | None = None,
) -> None:
    for k, (code, p) in enumerate(zip(codes, pts, strict=True)):
        img = barcode_frame(code, s.height, s.width, t=k)
        fr = av.VideoFrame.from_ndarray(img, format="rgb24")
        fr.pts = p
        if tb is not None:
            fr.time_base = tb
        c.mux(s.encode(fr))
    c.mux(s.encode(None))


def _cfr(n: int, fps: float) -> list[float]:
    return [k / fps for k in range(n)]


def _write_vfr(p: Path, ticks: list[int]) -> Path:
    """H.264 at the encoder's nominal 30 fps whose frame ``i`` sits at ``ticks[i] / 30`` s."""
    c = av.open(str(p), "w")
    s = _video_stream(c, "libx264", Fraction(30), (48, 64), gop=10)
    s.codec_context.time_base = Fraction(1, 30)
    _mux_video(c, s, list(range(len(ticks))), ticks, tb=Fraction(1, 30))
    c.close()
    return p


def _write_simple(
    path: Path,
    encoder: str,
    *,
    n: int,
    fps: float,
    size: tuple[int, int],
    fmt: str | None = None,
    **kw,
) -> None:
    rate = Fraction(fps).limit_denominator(1001)
    c = av.open(str(path), "w", format=fmt)
    try:
        s = _video_stream(c, encoder, rate, size, **kw)
        _mux_video(c, s, list(range(n)), list(range(n)))
    finally:
        c.close()


class _NoSeek:
    """A write-only file: the matroska muxer then writes no duration and no cues (seek index),
    as live recorders and streamed downloads do."""

    def __init__(self, path: Path) -> None:
        self._f = open(path, "wb")  # noqa: SIM115 - closed by close()

    def write(self, b: bytes) -> int:
        return self._f.write(b)

    def close(self) -> None:
        self._f.close()


def _mp4_boxes(path: str | Path) -> dict[str, list[bytes]]:
    """The payload of every box in the moov tree of an mp4, by type (``elst``, ``tkhd``...)."""
    data = Path(path).read_bytes()
    out: dict[str, list[bytes]] = {}

    def walk(off: int, end: int) -> None:
        while off + 8 <= end:
            size, typ = struct.unpack(">I4s", data[off : off + 8])
            name = typ.decode("latin1")
            if size < 8:
                return
            out.setdefault(name, []).append(data[off + 8 : off + size])
            if name in ("moov", "trak", "edts", "mdia", "minf", "stbl"):
                walk(off + 8, off + size)
            off += size

    walk(0, len(data))
    return out


def elst_entries(path: str | Path) -> list[tuple[int, int]]:
    """``(segment_duration, media_time)`` of every edit-list entry of an mp4 (version 0/1)."""
    out = []
    for b in _mp4_boxes(path).get("elst", []):
        version = b[0]
        (count,) = struct.unpack(">I", b[4:8])
        off = 8
        for _ in range(count):
            if version == 1:
                dur, mt = struct.unpack(">Qq", b[off : off + 16])
                off += 20
            else:
                dur, mt = struct.unpack(">Ii", b[off : off + 8])
                off += 12
            out.append((dur, mt))
    return out


def tkhd_matrix(path: str | Path) -> list[tuple[int, ...]]:
    """The 3x3 display matrix of every track header (``tkhd``) of an mp4, as 9 int32 each."""
    out = []
    for b in _mp4_boxes(path).get("tkhd", []):
        off = 4 + (32 if b[0] == 1 else 20) + 8 + 8
        out.append(struct.unpack(">9i", b[off : off + 36]))
    return out


def _hostile(root: Path, add: Callable[[Case], None], encoder: str, codec: str, tag: str) -> None:
    """Issue 34's cases 1-5 and 8 in one codec (H.264, and VP9: DALI's CPU decoder reads VP9,
    so its handling of these files is checked without a GPU too)."""
    vp9 = codec == "vp9"
    # 1. An audio stream first, then the video.
    p = root / f"audio_first{tag}.{'webm' if vp9 else 'mp4'}"
    c = av.open(str(p), "w")
    a = _add_audio(c, "libopus" if vp9 else "aac")
    s = _video_stream(c, encoder, Fraction(10), (48, 64), gop=10, bframes=2)
    _mux_video(c, s, list(range(30)), list(range(30)))
    _mux_audio(c, a, 3.0)
    c.close()
    add(Case(p.name, str(p), "webm" if vp9 else "mp4", codec, 64, 48, 10.0, _cfr(30, 10), list(range(30)),
             f"issue 34.1: audio is stream 0, {codec} stream 1"))  # fmt: skip

    # 2. [audio, video A, video B]: A is the one to read (B shows other barcodes).
    p = root / f"two_video{tag}.mkv"
    c = av.open(str(p), "w")
    a = _add_audio(c, "pcm_s16le")
    s = _video_stream(c, encoder, Fraction(10), (48, 64), gop=10)
    s2 = _video_stream(c, encoder, Fraction(10), (48, 64), gop=10)
    _mux_video(c, s, list(range(30)), list(range(30)))
    _mux_video(c, s2, [255 - k for k in range(30)], list(range(30)))
    _mux_audio(c, a, 3.0)
    c.close()
    add(Case(p.name, str(p), "mkv", codec, 64, 48, 10.0, _cfr(30, 10), list(range(30)),
             f"issue 34.2: streams [PCM audio, {codec} A, {codec} B], mkv"))  # fmt: skip

    # 3. An mp4 cut without re-encoding, as `ffmpeg -ss 2.5 -c copy` writes it: the packets
    # from the keyframe before the cut on, shifted so that the cut is at 0; the pre-roll
    # frames get negative times and the mp4 muxer hides them with an edit list.
    src = root / f"_trim_source{tag}.mp4"
    _write_simple(src, encoder, n=60, fps=10, size=(48, 64), gop=20, bframes=2)
    p = root / f"trimmed_editlist{tag}.mp4"
    cut = 25  # frames: cut at 2.5 s; the keyframe before it is frame 20
    ic = av.open(str(src))
    try:
        ist = ic.streams.video[0]
        tb = ist.time_base
        per = int(1 / (10 * tb))
        oc = av.open(str(p), "w")
        ost = oc.add_stream_from_template(ist)
        pkts = [pk for pk in ic.demux(ist) if pk.size]
        start = max(i for i, pk in enumerate(pkts) if pk.is_keyframe and pk.pts <= cut * per)
        for pk in pkts[start:]:
            pk.pts -= cut * per
            pk.dts -= cut * per
            pk.stream = ost
            oc.mux(pk)
        oc.close()
    finally:
        ic.close()
    add(Case(p.name, str(p), "mp4", codec, 64, 48, 10.0, _cfr(35, 10), list(range(cut, 60)),
             f"issue 34.3: {codec} mp4 trimmed by stream copy, edit list hides the pre-roll"))  # fmt: skip

    # 4. Rotation (display matrix): a phone held upright records landscape frames and a -90
    # degree matrix (the iPhone's); 180 is a phone upside down. Frames are stored turned.
    for deg in (-90,) if vp9 else (-90, 90, 180):
        p = root / f"rotate{deg}{tag}.mp4"
        c = av.open(str(p), "w")
        k = (deg // 90) % 4
        dh, dw = (64, 48) if k % 2 else (48, 64)  # displayed size
        s = _video_stream(c, encoder, Fraction(10), (dw, dh) if k % 2 else (dh, dw), gop=10)
        s.set_display_rotation(deg)
        # Stored = displayed turned back: display = np.rot90(stored, k) (counter-clockwise).
        for i in range(20):
            img = np.ascontiguousarray(np.rot90(barcode_frame(i, dh, dw), -k))
            fr = av.VideoFrame.from_ndarray(img, format="rgb24")
            fr.pts = i
            c.mux(s.encode(fr))
        c.mux(s.encode(None))
        c.close()
        add(Case(p.name, str(p), "mp4", codec, dw, dh, 10.0, _cfr(20, 10), list(range(20)),
                 f"issue 34.4: {codec}, display matrix rotation {deg} degrees, mp4"))  # fmt: skip

    # 5. The audio starts at 0 and the video at 1.0 s: a player shows the first picture at
    # 1.0 s.
    p = root / f"late_video{tag}.mkv"
    c = av.open(str(p), "w")
    a = _add_audio(c, "pcm_s16le")
    s = _video_stream(c, encoder, Fraction(10), (48, 64), gop=10)
    _mux_video(c, s, list(range(30)), [k + 10 for k in range(30)])
    _mux_audio(c, a, 4.0)
    c.close()
    add(Case(p.name, str(p), "mkv", codec, 64, 48, 10.0, [1.0 + k / 10 for k in range(30)],
             list(range(30)), f"issue 34.5: {codec} starts 1.0 s after the audio, mkv"))  # fmt: skip
    # 8. Non-square pixels: 64x48 stored, sample aspect 4:3, displayed 85x48 (16:9).
    p = root / f"anamorphic{tag}.mp4"
    c = av.open(str(p), "w")
    s = _video_stream(c, encoder, Fraction(10), (48, 64), gop=10)
    s.codec_context.sample_aspect_ratio = Fraction(4, 3)
    _mux_video(c, s, list(range(20)), list(range(20)))
    c.close()
    add(Case(p.name, str(p), "mp4", codec, 85, 48, 10.0, _cfr(20, 10), list(range(20)),
             f"issue 34.8: {codec}, sample aspect 4:3 (64x48 stored, 16:9 shown)"))  # fmt: skip


def build_corpus(root: str | Path) -> dict[str, Case]:
    """Write every case under ``root``; return ``{name: Case}``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    cases: dict[str, Case] = {}

    def add(case: Case) -> None:
        cases[case.name] = case

    # --- files that already decoded right before issue 34 ---------------------------------
    p = root / "h264_bframes_longgop.mp4"
    _write_simple(p, "libx264", n=90, fps=15, size=(48, 64), gop=60, bframes=3)
    add(Case(p.name, str(p), "mp4", "h264", 64, 48, 15.0, _cfr(90, 15), list(range(90)),
             "H.264, 3 B-frames, 60-frame GOP, mp4"))  # fmt: skip
    p = root / "h264_odd_size.mkv"
    _write_simple(p, "libx264", n=40, fps=10, size=(54, 94), gop=8, bframes=2)
    add(Case(p.name, str(p), "mkv", "h264", 94, 54, 10.0, _cfr(40, 10), list(range(40)),
             "H.264 94x54 (not a multiple of 16), mkv"))  # fmt: skip
    p = root / "hevc8.mp4"
    _write_simple(p, "libx265", n=40, fps=10, size=(48, 64), gop=20, bframes=2)
    add(Case(p.name, str(p), "mp4", "hevc", 64, 48, 10.0, _cfr(40, 10), list(range(40)),
             "HEVC 8-bit (libx265), mp4"))  # fmt: skip
    p = root / "hevc10.mkv"
    _write_simple(p, "libx265", n=40, fps=10, size=(48, 64), gop=20, pix_fmt="yuv420p10le")
    add(Case(p.name, str(p), "mkv", "hevc", 64, 48, 10.0, _cfr(40, 10), list(range(40)),
             "HEVC 10-bit (libx265, yuv420p10le), mkv"))  # fmt: skip
    p = root / "vp9.webm"
    _write_simple(p, "libvpx-vp9", n=40, fps=10, size=(48, 64), gop=15)
    add(Case(p.name, str(p), "webm", "vp9", 64, 48, 10.0, _cfr(40, 10), list(range(40)),
             "VP9 (libvpx), webm"))  # fmt: skip
    p = root / "vp9_no_index.webm"
    sink = _NoSeek(p)
    try:
        c = av.open(sink, "w", format="webm")
        s = _video_stream(c, "libvpx-vp9", Fraction(10), (49, 75), gop=15)
        _mux_video(c, s, list(range(40)), list(range(40)))
        c.close()
    finally:
        sink.close()
    add(Case(p.name, str(p), "webm", "vp9", 75, 49, 10.0, _cfr(40, 10), list(range(40)),
             "VP9 75x49 (odd sides) webm without duration or cues (non-seekable writer)"))  # fmt: skip
    p = root / "mpeg4.avi"
    _write_simple(p, "mpeg4", n=40, fps=10, size=(48, 64), gop=12)
    add(Case(p.name, str(p), "avi", "mpeg4", 64, 48, 10.0, _cfr(40, 10), list(range(40)),
             "MPEG-4 part 2, AVI"))  # fmt: skip
    p = root / "mjpeg.avi"
    _write_simple(p, "mjpeg", n=20, fps=10, size=(48, 64))
    add(Case(p.name, str(p), "avi", "mjpeg", 64, 48, 10.0, _cfr(20, 10), list(range(20)),
             "MJPEG, AVI"))  # fmt: skip

    # Variable frame rate in mp4: gaps of 1-3 ticks of 1/30 s.
    steps = [1, 3, 2, 1, 3, 3, 1, 2] * 5
    ticks = [0, *np.cumsum(steps[:-1]).tolist()]
    p = _write_vfr(root / "vfr.mp4", ticks)
    vfr_times = [t / 30 for t in ticks]
    vfr_fps = (len(ticks) - 1) / vfr_times[-1]
    add(Case(p.name, str(p), "mp4", "h264", 64, 48, vfr_fps, vfr_times, list(range(len(ticks))),
             "H.264 variable frame rate, mp4"))  # fmt: skip

    # --- issue 34 -------------------------------------------------------------------------
    # 10. VFR in mkv: the muxer writes the encoder's nominal 30 fps as DefaultDuration.
    p = _write_vfr(root / "vfr.mkv", ticks)
    add(Case(p.name, str(p), "mkv", "h264", 64, 48, vfr_fps, vfr_times, list(range(len(ticks))),
             "issue 34.10: H.264 variable frame rate, mkv (nominal 30 fps)"))  # fmt: skip

    _hostile(root, add, "libx264", "h264", "")

    p = root / "mpegts.ts"
    c = av.open(str(p), "w", format="mpegts")
    s = _video_stream(c, "mpeg4", Fraction(10), (48, 64), gop=10)
    _mux_video(c, s, list(range(30)), list(range(30)))
    c.close()
    add(Case(p.name, str(p), "ts", "mpeg4", 64, 48, 10.0, _cfr(30, 10), list(range(30)),
             "issue 34.5: MPEG-TS, every stream starts at 1.4 s; MPEG-4 part 2"))  # fmt: skip

    # 6. AV1 (decoded by libdav1d: the codec is still 'av1').
    p = root / "av1.mkv"
    _write_simple(p, "libsvtav1", n=30, fps=10, size=(48, 64), gop=10)
    add(Case(p.name, str(p), "mkv", "av1", 64, 48, 10.0, _cfr(30, 10), list(range(30)),
             "issue 34.6: AV1 (SVT-AV1, decoded by libdav1d), mkv"))  # fmt: skip
    p = root / "av1.mp4"
    _write_simple(p, "libsvtav1", n=30, fps=10, size=(48, 64), gop=10)
    add(Case(p.name, str(p), "mp4", "av1", 64, 48, 10.0, _cfr(30, 10), list(range(30)),
             "issue 34.6: AV1, mp4"))  # fmt: skip

    # 9. One corrupt packet: frame 28's data overwritten (GOP 20-39, no B-frames).
    src = root / "_corrupt_source.mp4"
    _write_simple(src, "libx264", n=60, fps=10, size=(48, 64), gop=20)
    ic = av.open(str(src))
    try:
        pk = [(x.pts, x.pos, x.size) for x in ic.demux(ic.streams.video[0]) if x.size]
        per = int(1 / (10 * ic.streams.video[0].time_base))
    finally:
        ic.close()
    pts, pos, size = next(x for x in pk if x[0] == 28 * per)
    data = bytearray(src.read_bytes())
    rng = np.random.default_rng(0)
    data[pos + 4 : pos + size] = rng.integers(0, 256, size - 4, dtype=np.uint8).tobytes()
    p = root / "corrupt_packet.mp4"
    p.write_bytes(bytes(data))
    add(Case(p.name, str(p), "mp4", "h264", 64, 48, 10.0, _cfr(60, 10), list(range(60)),
             "issue 34.9: one corrupt packet (frame 28 of 60), mp4",
             undecodable=set(range(28, 40))))  # fmt: skip

    _hostile(root, add, "libvpx-vp9", "vp9", "_vp9")
    return cases
