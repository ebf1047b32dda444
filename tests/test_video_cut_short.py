"""A video file cut short (an interrupted download or copy) is refused at probe (issue 66 item
5a): its header declares more than its frames hold by more than ``CUT_FRAC`` / ``CUT_MIN_S``.
Real files written by ``paravt.data.synth`` (VP9 webm, H.264 mkv and faststart mp4), cut with
``bytes[:n]``; whole files, with an audio track that outlasts the picture, still probe."""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest

from paravt.data.synth import read_frame_index, write_index_clip
from paravt.video import VideoError, decode, probe

DURATION = 6.0


def _remux(src: Path, dst: Path, options: dict[str, str] | None = None) -> Path:
    """``src``'s video packets copied into ``dst`` (its container from the suffix)."""
    with av.open(str(src)) as i, av.open(str(dst), "w", options=options or {}) as o:
        s = o.add_stream_from_template(i.streams.video[0])
        for pk in i.demux(i.streams.video[0]):
            if pk.dts is None:
                continue
            pk.stream = s
            o.mux(pk)
    return dst


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("whole")
    mp4 = write_index_clip(d / "src.mp4", duration=DURATION, gop=12)
    return {
        "webm": write_index_clip(d / "v.webm", duration=DURATION, gop=12, codec="vp9"),
        "mkv": _remux(mp4, d / "v.mkv"),
        "faststart_mp4": _remux(mp4, d / "fast.mp4", {"movflags": "faststart"}),
    }


def _cut(src: Path, frac: float, d: Path) -> str:
    out = d / f"cut{int(frac * 100)}_{src.name}"
    data = src.read_bytes()
    out.write_bytes(data[: int(len(data) * frac)])
    return str(out)


@pytest.mark.parametrize("kind", ["webm", "mkv", "faststart_mp4"])
@pytest.mark.parametrize("frac", [0.5, 0.8])
def test_a_file_cut_short_is_refused_at_probe(whole, tmp_path, kind: str, frac: float) -> None:
    assert probe(str(whole[kind])).duration == pytest.approx(DURATION)
    cut = _cut(whole[kind], frac, tmp_path)
    with pytest.raises(VideoError) as e:
        probe(cut)  # on main: probed as a shorter video (e.g. 1.5 s), scored as any row
    msg = str(e.value)
    assert e.value.path == cut and cut in msg
    m = re.search(r"header declares 6\.000 s but its frames end at (\d+\.\d+) s", msg)
    assert m and float(m.group(1)) < 0.9 * DURATION, msg
    assert "cut short" in msg and "re-download" in msg


def test_a_cut_within_the_tolerance_probes_and_names_the_declared_duration(whole, tmp_path) -> None:
    # The last 5% of a webm cut (0.5 s of 6): under CUT_FRAC (10%) and CUT_MIN_S, so it probes as the frames
    # it holds; those decode right, and a time past them names the header's duration.
    cut = _cut(whole["webm"], 0.95, tmp_path)
    m = probe(cut)
    assert DURATION - 1.0 <= m.duration < DURATION
    fb = decode(cut, [0.5, m.duration / 2])
    assert [read_frame_index(f) for f in fb.frames] == fb.indices.tolist()
    with pytest.raises(VideoError, match=r"header declares 6\.000 s"):
        decode(cut, [DURATION - 0.01])


def _with_audio(p: Path, extra: float) -> Path:
    """A DURATION-second H.264 mkv (4 fps, 64 x 64) with a PCM audio track ``extra`` seconds
    longer, its 0.125 s audio frames interleaved with the video's, the rest after."""
    with av.open(str(p), "w") as c:
        v = c.add_stream("libx264", rate=4)
        v.width, v.height, v.pix_fmt = 64, 64, "yuv420p"
        a = c.add_stream("pcm_s16le", rate=8000)

        def audio(k: int) -> None:
            af = av.AudioFrame.from_ndarray(
                np.zeros((1, 1000), np.int16), format="s16", layout="mono"
            )
            af.sample_rate, af.pts, af.time_base = 8000, k * 1000, Fraction(1, 8000)
            c.mux(a.encode(af))

        frames = int(DURATION * 4)
        for i in range(frames):
            f = av.VideoFrame.from_ndarray(np.full((64, 64, 3), i * 8, np.uint8), format="rgb24")
            f.pts = i
            c.mux(v.encode(f))
            audio(2 * i)
            audio(2 * i + 1)
        c.mux(v.encode(None))
        for k in range(2 * frames, round((DURATION + extra) * 8)):  # past the picture
            audio(k)
        c.mux(a.encode(None))
    return p


@pytest.mark.parametrize("extra", [0.5, 3.0])
def test_whole_files_with_a_longer_audio_track_probe(tmp_path, extra: float) -> None:
    # A container's duration spans its audio: audio past the last frame is a whole file, not
    # a cut one, also 3 s past a 6 s picture (over CUT_FRAC and CUT_MIN_S: the last packets of
    # every stream are read to tell; a cut file ends them all early).
    p = _with_audio(tmp_path / "av.mkv", extra)
    assert probe(str(p)).duration == pytest.approx(DURATION)


def test_a_file_with_audio_cut_short_is_still_refused(tmp_path) -> None:
    """The same audio + video mkv cut at 50%: every stream ends early, so it is refused."""
    p = _with_audio(tmp_path / "av.mkv", 0.0)
    assert probe(str(p)).duration == pytest.approx(DURATION)
    cut = _cut(p, 0.5, tmp_path)
    with pytest.raises(VideoError, match="cut short"):
        probe(cut)
