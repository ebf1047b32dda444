"""DecodePlanner: same frames as per-request ``decode`` (bitwise), each frame decoded at most
once (GOP-optimal), a cache keyed by (file, frame, size), and per-request errors."""

from __future__ import annotations

import re
import shutil
import struct

import av
import numpy as np
import pytest
import torch

from paravt.data.synth import read_frame_index, write_index_clip
from paravt.types import FrameBatch, FrameRequest
from paravt.video import (
    DecodePlanner,
    VideoError,
    crop_timestamps,
    decode,
    overview_timestamps,
    probe,
    stream_index,
)
from paravt.video.pyav_backend import gop_optimal_decodes, gop_plan


def _step_requests(paths: list[str]) -> list[FrameRequest]:
    """A realistic step: per file an overview at one size plus many overlapping crop windows
    (as G rollouts would ask) at another size, some native-size requests, some duplicates."""
    reqs = []
    for j, p in enumerate(paths):
        m = probe(p)
        reqs.append(FrameRequest(p, tuple(overview_timestamps(m, 8)), (64, 64), "overview"))
        for g, (s, e) in enumerate([(2, 9), (4, 11), (4, 11), (3.5, 6), (15, 29), (20, 22)]):
            ts = crop_timestamps(m, s + j, e + j, fps=2.0, max_frames=12)
            reqs.append(FrameRequest(p, tuple(ts), (32, 48), f"crop:{g}"))
        reqs.append(FrameRequest(p, (0.0, 5.25, 5.25, 29.0), None, "native"))
    return reqs


def _assert_same(a: FrameBatch, b: FrameBatch) -> None:
    assert a.frames.dtype == b.frames.dtype == torch.uint8
    assert torch.equal(a.frames, b.frames)
    assert torch.equal(a.indices, b.indices)
    assert torch.equal(a.timestamps, b.timestamps)


@pytest.fixture(scope="module")
def three_files(make_clip) -> list[str]:
    return [make_clip(gop=g, duration=30.0) for g in (1, 12, 50)]


def test_planner_matches_per_request_decode_bitwise(three_files) -> None:
    reqs = _step_requests(three_files)
    planner = DecodePlanner(cache_frames=4096)
    out = planner.run(reqs)
    assert len(out) == len(reqs)
    for req, got in zip(reqs, out):
        assert isinstance(got, FrameBatch), got
        _assert_same(got, decode(req.video, req.timestamps, size=req.size))
        assert got.video == req.video
        assert [read_frame_index(f) for f in got.frames] == got.indices.tolist()


def test_threaded_decode_is_bitwise_the_one_thread_decode_and_config_reaches_it(
    three_files, monkeypatch
) -> None:
    """``video.decode_threads`` (0 = FFmpeg's frame + slice threads, the default): the same
    frames as one thread, and ``DecodePlanner.from_config`` (every planner of a run) passes it
    to the PyAV decoder."""
    from paravt.config import load_config
    from paravt.video import pyav_backend

    reqs = _step_requests(three_files)
    one = DecodePlanner(cache_frames=0, threads=1).run(reqs)
    auto = DecodePlanner(cache_frames=0, threads=0).run(reqs)
    for a, b in zip(one, auto):
        _assert_same(a, b)
    seen: list[int] = []
    real = pyav_backend.iter_indices

    def spy(sidx, indices, stats=None, threads=0):
        seen.append(threads)
        return real(sidx, indices, stats, threads)

    monkeypatch.setattr("paravt.video.planner._ITER_BACKENDS", {"pyav": spy})
    from paravt.video.planner import default_decode_threads

    for n, local, want in ((3, "8", 3), (0, "1", None), (0, "10000", 1)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        cfg = load_config("tiny_cpu", overrides=[f"video.decode_threads={n}"])
        planner = DecodePlanner.from_config(cfg.video)
        assert planner.timeout_s == cfg.video.decode_timeout_s
        planner.run(reqs[:1])
        # 0: this process's share of the cores (one rank a node: all of them, at most 16)
        assert seen[-1] == (want or default_decode_threads()) and 1 <= seen[-1] <= 16
    with pytest.raises(ValueError, match="decoder threads must be >= 0"):
        DecodePlanner(threads=-1)


def test_planner_decodes_each_frame_at_most_once_gop_optimal(three_files) -> None:
    reqs = _step_requests(three_files)
    planner = DecodePlanner(cache_frames=4096)
    planner.run(reqs)
    st = planner.stats
    optimal = seeks = distinct = 0
    for p in three_files:
        sidx = stream_index(p)
        idx = sorted({i for r in reqs if r.video == p for i in sidx.indices_at(r.timestamps)})
        distinct += len(idx)
        optimal += gop_optimal_decodes(sidx.meta.keyframes, idx)
        seeks += len(gop_plan(sidx.meta.keyframes, idx))
    assert st["files_opened"] == 3
    assert st["frames_requested"] == sum(len(r.timestamps) for r in reqs)
    # Every decoded frame is inside a needed GOP span, and no span is decoded twice.
    assert st["frames_decoded"] == optimal
    assert st["seeks"] <= seeks
    assert distinct < st["frames_requested"]  # windows overlap: sharing actually happened
    # Each (frame, size) resized once: resized count = distinct (frame, size) pairs.
    pairs = {
        (r.video, i, r.size)
        for r in reqs
        if r.size is not None
        for i in stream_index(r.video).indices_at(r.timestamps)
    }
    assert st["frames_resized"] == len(pairs)


def test_cache_serves_repeat_calls_and_is_keyed_by_size(three_files) -> None:
    p = three_files[1]
    planner = DecodePlanner(cache_frames=4096)
    first = planner.run([FrameRequest(p, (1.0, 2.0, 3.0), (32, 32))])[0]
    decoded = planner.stats["frames_decoded"]
    again = planner.run([FrameRequest(p, (1.0, 2.0, 3.0), (32, 32))])[0]
    assert planner.stats["frames_decoded"] == decoded  # nothing decoded the second time
    assert planner.stats["cache_hits"] == 3
    _assert_same(first, again)
    # Same frames at another size: a different cache entry, correct size, not the 32x32 one.
    other = planner.run([FrameRequest(p, (1.0, 2.0, 3.0), (64, 80))])[0]
    assert other.frames.shape == (3, 64, 80, 3)
    _assert_same(other, decode(p, (1.0, 2.0, 3.0), size=(64, 80)))
    # Same frame index of another file must not collide.
    q = three_files[2]
    _assert_same(
        planner.run([FrameRequest(q, (1.0,), (32, 32))])[0], decode(q, [1.0], size=(32, 32))
    )


def test_small_cache_stays_bounded_and_correct(three_files) -> None:
    reqs = _step_requests(three_files)
    planner = DecodePlanner(cache_frames=5)
    for _ in range(2):
        for req, got in zip(reqs, planner.run(reqs)):
            _assert_same(got, decode(req.video, req.timestamps, size=req.size))
        assert len(planner.cache) <= 5
    off = DecodePlanner(cache_frames=0)
    off.run(reqs)
    assert len(off.cache) == 0 and off.stats["cache_hits"] == 0


# ------------------------------------------------------------------------------ bad input
@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, make_clip) -> dict[str, str]:
    d = tmp_path_factory.mktemp("bad")
    good = make_clip(gop=12, duration=30.0)
    files = {"missing": str(d / "nope.mp4")}
    (d / "empty.mp4").write_bytes(b"")
    files["empty"] = str(d / "empty.mp4")
    data = open(good, "rb").read()
    (d / "trunc.mp4").write_bytes(data[: len(data) // 2])  # moov atom (index) is at the end
    files["truncated_mp4"] = str(d / "trunc.mp4")
    webm = write_index_clip(d / "full.webm", duration=30.0, gop=12, codec="vp9")
    wdata = webm.read_bytes()
    (d / "trunc.webm").write_bytes(wdata[: len(wdata) // 3])  # streams: fewer frames remain
    files["truncated_webm"] = str(d / "trunc.webm")
    # mp4 with the index up front (faststart): opens, but the sample data stops halfway.
    fast = d / "fast.mp4"
    c = av.open(str(fast), "w", options={"movflags": "faststart"})
    s = c.add_stream("libx264", rate=4)
    s.width, s.height, s.pix_fmt, s.gop_size = 160, 128, "yuv420p", 12
    for i in range(120):
        f = np.full((128, 160, 3), 40, np.uint8)
        f[60:70, i : i + 8] = 200
        vf = av.VideoFrame.from_ndarray(f, format="rgb24")
        vf.pts = i
        c.mux(s.encode(vf))
    c.mux(s.encode(None))
    c.close()
    fdata = fast.read_bytes()
    (d / "trunc_fast.mp4").write_bytes(fdata[: len(fdata) // 2])
    files["truncated_faststart_mp4"] = str(d / "trunc_fast.mp4")
    (d / "garbage.mp4").write_bytes(np.random.default_rng(0).bytes(50_000))
    files["garbage"] = str(d / "garbage.mp4")
    # Index intact, payload zeroed: opens and probes fine, but no frame decodes.
    z = bytearray(data)
    off = 0
    while off < len(z):
        size, kind = struct.unpack(">I4s", z[off : off + 8])
        if kind == b"mdat":
            z[off + 8 : off + size] = bytes(size - 8)
        off += size
    (d / "zeroed.mp4").write_bytes(bytes(z))
    files["undecodable"] = str(d / "zeroed.mp4")
    # A valid container without a video stream.
    c = av.open(str(d / "audio.mka"), "w")
    s = c.add_stream("pcm_s16le", rate=8000)
    frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
    frame.sample_rate = 8000
    c.mux(s.encode(frame))
    c.mux(s.encode(None))
    c.close()
    files["audio_only"] = str(d / "audio.mka")
    # 2000 bytes zeroed 40% into a VP9 webm: the demuxer skips the cluster, and the probe saw
    # a 30 s video whose frames 11-21 s were one held frame (issue 50 item 8).
    zw = bytearray(wdata)
    zw[int(len(zw) * 0.4) : int(len(zw) * 0.4) + 2000] = bytes(2000)
    (d / "zeroed.webm").write_bytes(bytes(zw))
    files["zeroed_webm"] = str(d / "zeroed.webm")
    # The sample entry's codec tag flipped (issue 50 item 8: a bit-flipped HEVC file did this):
    # the stream has no decoder, and the probe raised a raw AttributeError.
    assert data.count(b"avc1") >= 1
    (d / "unknown_codec.mp4").write_bytes(data.replace(b"avc1", b"zq91"))
    files["unknown_codec"] = str(d / "unknown_codec.mp4")
    shutil.copy(good, d / "good.mp4")
    files["good"] = str(d / "good.mp4")
    return files


@pytest.mark.parametrize(
    "case, pattern",
    [
        ("missing", "file not found"),
        ("empty", r"file is empty \(0 bytes\)"),
        ("truncated_mp4", "cannot open as a video container"),
        ("garbage", "cannot open as a video container"),
        ("audio_only", "has no video stream"),
        ("undecodable", "decoding failed .* the stream is corrupt"),
        ("truncated_webm", r"header declares 30\.000 s but its frames end at .* cut short"),
        ("truncated_faststart_mp4", r"header declares 30\.000 s but its frames end at"),
        ("unknown_codec", "codec is unknown or has no decoder here"),
        ("zeroed_webm", r"timestamps jump from \d+\.\d+ s to \d+\.\d+ s \(\d+ frame intervals"),
    ],
)
def test_bad_input_fails_only_its_own_requests(bad_files, case: str, pattern: str) -> None:
    good = bad_files["good"]
    bad = bad_files[case]
    reqs = [
        FrameRequest(good, (1.0, 2.0), (32, 32)),
        FrameRequest(bad, (1.0, 25.0), (32, 32)),
        FrameRequest(good, (3.0, 29.0), None),
        FrameRequest(bad, (25.0,), None),
    ]
    planner = DecodePlanner()
    out = planner.run(reqs)
    for r in (1, 3):
        assert isinstance(out[r], VideoError), out[r]
        assert out[r].path == bad and bad in str(out[r])
        assert re.search(pattern, str(out[r])), str(out[r])
    for r in (0, 2):
        _assert_same(out[r], decode(good, reqs[r].timestamps, size=reqs[r].size))
    assert planner.stats["failed_requests"] == 2
    with pytest.raises(VideoError, match=pattern):
        decode(bad, [1.0, 25.0])


def test_window_outside_the_video_fails_that_request_only(bad_files) -> None:
    good = bad_files["good"]
    planner = DecodePlanner()
    out = planner.run(
        [
            FrameRequest(good, (10.0, 31.0), None, "crop:late"),
            FrameRequest(good, (10.0, 11.0), None),
            FrameRequest(good, (), None, "crop:empty"),
            FrameRequest(good, (1.0,), (0, 5)),
        ]
    )
    assert isinstance(out[0], VideoError)
    assert "timestamp 31.000 s is outside the video [0, 30.000] s" in str(out[0])
    assert isinstance(out[2], VideoError) and "crop:empty" in str(out[2])
    assert isinstance(out[3], VideoError) and "frame size (0, 5)" in str(out[3])
    _assert_same(out[1], decode(good, (10.0, 11.0)))


def test_cached_frames_survive_a_file_going_bad(tmp_path, make_clip) -> None:
    # Frames already in the cache are still served; a rewritten file is never served stale.
    p = tmp_path / "v.mp4"
    shutil.copy(make_clip(gop=12, duration=30.0), p)
    planner = DecodePlanner()
    first = planner.run([FrameRequest(str(p), (1.0,), (32, 32))])[0]
    assert isinstance(first, FrameBatch)
    write_index_clip(p, duration=20.0, gop=4)  # different content/size on disk now
    out = planner.run([FrameRequest(str(p), (25.0,), None), FrameRequest(str(p), (1.0,), None)])
    assert isinstance(out[0], VideoError)  # 25 s is past the new 20 s duration
    _assert_same(out[1], decode(str(p), [1.0]))


def test_crop_and_overview_requests_follow_the_sampling_rules(make_clip) -> None:
    from paravt.types import CropRequest
    from paravt.video import crop_request, overview_request

    p = make_clip(gop=12, duration=30.0)
    m = probe(p)
    ov = overview_request(p, 6, min_pixels=32 * 32, max_pixels=64 * 64)
    assert ov.timestamps == tuple(overview_timestamps(m, 6)) and ov.size == (32, 64)
    crop = CropRequest(p, start=25.0, end=40.0, fps=1.0, max_frames=16, max_pixels=64 * 64)
    cr = crop_request(crop, tag="crop:0")
    assert cr.timestamps == tuple(crop_timestamps(m, 25.0, 30.0)) and cr.tag == "crop:0"
    assert cr.size == (32, 64)  # smart_resize of 128x160 under 4096 px
    out = DecodePlanner().run([ov, cr])
    assert [f.shape[0] for f in (out[0].frames, out[1].frames)] == [6, 5]
    with pytest.raises(VideoError, match="outside the video"):
        crop_request(CropRequest(p, start=31.0, end=40.0))


def test_a_variable_rate_mp4_that_holds_still_is_not_a_hole(tmp_path) -> None:
    """A 3 s hold in a variable-rate mp4 (a screen recording): its declared rate is its average,
    which its frames match, so the hole rule (``probe.HOLE_INTERVALS``) does not look at it."""
    from video_corpus import _write_vfr

    ticks = [*range(30), *range(120, 150)]  # 1 s at 30 fps, a 3 s hold, 1 s more
    p = _write_vfr(tmp_path / "hold.mp4", ticks)
    m = probe(str(p))
    assert m.num_frames == 60 and m.duration == pytest.approx(150 / 30, abs=0.1)
    assert decode(str(p), [0.5, 2.5, 4.5]).indices.tolist() == [15, 29, 45]
