"""Frame-accurate PyAV decoding: probe, the timestamp→frame rule, overview/crop sampling.

Clips carry their display index in every frame (``read_frame_index``), so each test compares
the decoded frame against the index the rule predicts, computed here independently:
``expected(t) = min(floor(t * fps + 1e-6), num_frames - 1)`` for constant-rate clips.
"""

from __future__ import annotations

import math

import pytest
import torch

from paravt.data.synth import read_frame_index
from paravt.types import VideoMeta
from paravt.video import (
    VideoError,
    crop_timestamps,
    decode,
    frame_size_for_budget,
    overview_timestamps,
    probe,
    resize_frames,
)

GOPS = [1, 12, 50]
FPS = 4.0
DURATION = 30.0


def expected_index(t: float, fps: float, n: int) -> int:
    return min(math.floor(t * fps + 1e-6), n - 1)


def read_indices(frames: torch.Tensor) -> list[int]:
    return [read_frame_index(f) for f in frames]


@pytest.mark.parametrize("gop", GOPS)
def test_probe_reads_metadata_and_keyframes(make_clip, gop: int) -> None:
    path = make_clip(gop=gop, fps=FPS, duration=DURATION)
    m = probe(path)
    n = round(DURATION * FPS)
    assert (m.num_frames, m.width, m.height, m.codec) == (n, 160, 128, "h264")
    assert m.fps == pytest.approx(FPS)
    assert m.duration == pytest.approx(DURATION)
    # scenecut is off in the writer: keyframes exactly every `gop` frames.
    assert m.keyframes == tuple(range(0, n, gop))


@pytest.mark.parametrize("gop", GOPS)
@pytest.mark.parametrize("k", [4, 7, 16, 64])
def test_overview_frames_are_the_frames_shown_at_each_time(make_clip, gop: int, k: int) -> None:
    path = make_clip(gop=gop, fps=FPS, duration=DURATION)
    m = probe(path)
    ts = overview_timestamps(m, k)
    assert len(ts) == k
    fb = decode(path, ts)
    want = [expected_index(t, FPS, m.num_frames) for t in ts]
    assert fb.frames.shape == (k, 128, 160, 3) and fb.frames.dtype == torch.uint8
    assert fb.indices.tolist() == want
    assert read_indices(fb.frames) == want
    assert torch.equal(fb.timestamps, torch.tensor(ts, dtype=torch.float64))


@pytest.mark.parametrize("gop", GOPS)
@pytest.mark.parametrize(
    "window", [(0.0, 5.0), (3.3, 11.7), (9.0, 29.99), (-4.0, 2.0), (25.0, 45.0), (0.0, 30.0)]
)
def test_crop_frames_are_the_frames_shown_at_each_time(make_clip, gop, window) -> None:
    path = make_clip(gop=gop, fps=FPS, duration=DURATION)
    m = probe(path)
    ts = crop_timestamps(m, *window, fps=2.0, max_frames=16)
    fb = decode(path, ts, size=(64, 80))  # index strip still readable after resizing
    want = [expected_index(t, FPS, m.num_frames) for t in ts]
    assert fb.frames.shape == (len(ts), 64, 80, 3)
    assert read_indices(fb.frames) == want == fb.indices.tolist()


def test_unsorted_duplicate_and_boundary_times(make_clip) -> None:
    path = make_clip(gop=12, fps=FPS, duration=DURATION)
    n = probe(path).num_frames
    # exact frame times (t = i/fps) map to frame i, not i-1; t == duration is the last frame.
    ts = [20.25, 0.0, 0.25, 20.25, 0.2499, DURATION, 7.0, 0.0]
    fb = decode(path, ts)
    want = [81, 0, 1, 81, 0, n - 1, 28, 0]
    assert read_indices(fb.frames) == want == fb.indices.tolist()
    assert torch.equal(fb.frames[0], fb.frames[3])


def test_decode_rejects_times_outside_the_video(make_clip) -> None:
    path = make_clip(gop=12, fps=FPS, duration=DURATION)
    with pytest.raises(
        VideoError, match=r"timestamp 30\.500 s is outside the video \[0, 30\.000\]"
    ):
        decode(path, [1.0, 30.5])
    with pytest.raises(VideoError, match="outside the video"):
        decode(path, [-0.5])
    with pytest.raises(VideoError, match="outside the video"):
        decode(path, [float("nan")])
    with pytest.raises(ValueError, match="backend 'nope'"):
        decode(path, [1.0], backend="nope")


def test_non_integer_fps_vp9(make_clip) -> None:
    # 2.5 fps in webm (1 ms time base): frame times are rounded to the ms by the muxer.
    path = make_clip(gop=5, codec="vp9", fps=2.5, duration=12.0)
    m = probe(path)
    assert (m.codec, m.num_frames) == ("vp9", 30) and m.fps == pytest.approx(2.5)
    ts = overview_timestamps(m, 9) + [0.4, 0.8, 11.6]
    fb = decode(path, ts)
    assert read_indices(fb.frames) == [expected_index(t, 2.5, 30) for t in ts]


# ------------------------------------------------------------------------------- sampling
META = VideoMeta(
    path="v.mp4", duration=100.0, fps=4.0, num_frames=400, width=640, height=360, codec="h264"
)


def test_overview_timestamps_are_bin_midpoints() -> None:
    assert overview_timestamps(META, 4) == [12.5, 37.5, 62.5, 87.5]
    assert overview_timestamps(META, 1) == [50.0]
    with pytest.raises(ValueError, match="k=0"):
        overview_timestamps(META, 0)


def test_crop_timestamps_rate_cap_floor_and_clamp() -> None:
    assert crop_timestamps(META, 10.0, 14.0) == [10.5, 11.5, 12.5, 13.5]  # 1 fps
    assert crop_timestamps(META, 10.0, 20.0, fps=2.0, max_frames=16) == pytest.approx(
        [10 + (i + 0.5) * 10 / 16 for i in range(16)]
    )  # capped: spread uniformly
    assert crop_timestamps(META, 10.0, 10.4) == pytest.approx([10.1, 10.3])  # min 2 frames
    assert crop_timestamps(META, 95.0, 130.0) == [95.5, 96.5, 97.5, 98.5, 99.5]  # clamped
    assert crop_timestamps(META, -3.0, 2.0) == [0.5, 1.5]
    for bad in [(50.0, 40.0), (120.0, 130.0), (-9.0, -1.0), (5.0, 5.0)]:
        with pytest.raises(VideoError, match="empty or outside the video"):
            crop_timestamps(META, *bad)
    with pytest.raises(VideoError, match="not finite"):
        crop_timestamps(META, float("nan"), 3.0)


def test_frame_size_for_budget_uses_smart_resize() -> None:
    assert frame_size_for_budget(META, 32 * 32, 64 * 64) == (32, 64)  # 16:9 under 4096 px
    h, w = frame_size_for_budget(META, 256 * 256, 448 * 448)
    assert h % 32 == 0 and w % 32 == 0 and 256 * 256 <= h * w <= 448 * 448
    assert abs(w / h - 640 / 360) < 0.15


def test_resize_frames_is_deterministic_and_batch_independent() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (7, 59, 111, 3), dtype=torch.uint8, generator=g)
    y = resize_frames(x, (32, 48))
    assert y.shape == (7, 32, 48, 3) and y.dtype == torch.uint8
    singles = torch.cat([resize_frames(x[i : i + 1], (32, 48)) for i in range(7)])
    assert torch.equal(y, singles)
    assert resize_frames(x, (59, 111)) is x
    flat = torch.full((2, 40, 40, 3), 77, dtype=torch.uint8)
    assert torch.equal(
        resize_frames(flat, (17, 23)), torch.full((2, 17, 23, 3), 77, dtype=torch.uint8)
    )
    # antialiased downscale of a 1-px checkerboard is mid-grey, not aliased black/white
    board = ((torch.arange(64)[:, None] + torch.arange(64)[None]) % 2 * 255).to(torch.uint8)
    small = resize_frames(board[None, :, :, None].expand(1, 64, 64, 3).contiguous(), (8, 8))
    assert (small.int() - 128).abs().max() <= 2
    with pytest.raises(ValueError, match="uint8"):
        resize_frames(x.float(), (8, 8))


def test_video_error_names_file_and_problem_and_pickles() -> None:
    import pickle

    e = VideoError("/data/v.mp4", "file not found; check the dataset's video_root")
    assert str(e) == "/data/v.mp4: file not found; check the dataset's video_root"
    back = pickle.loads(pickle.dumps(e))
    assert isinstance(back, VideoError) and (back.path, back.problem) == (e.path, e.problem)
