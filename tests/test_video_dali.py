"""DALI backend vs PyAV: same frames for the same times. On CPU, DALI decodes VP9/MJPEG only,
so these tests use VP9 clips (H.264 through DALI needs the GPU ``mixed`` backend)."""

from __future__ import annotations

import pytest
import torch

from paravt.data.synth import read_frame_index
from paravt.types import FrameRequest
from paravt.video import (
    DecodePlanner,
    VideoError,
    crop_timestamps,
    decode,
    overview_timestamps,
    probe,
)

pytest.importorskip("nvidia.dali")
pytestmark = pytest.mark.dali

CPU_ONLY = not torch.cuda.is_available()


@pytest.mark.parametrize("gop", [1, 12, 50])
def test_dali_and_pyav_return_the_same_frames_vp9(make_clip, gop: int) -> None:
    path = make_clip(gop=gop, codec="vp9", duration=20.0)
    m = probe(path)
    ts = overview_timestamps(m, 9) + crop_timestamps(m, 3.3, 11.0, fps=2.0) + [0.0, 20.0]
    a = decode(path, ts, backend="pyav")
    b = decode(path, ts, backend="dali")
    assert torch.equal(a.indices, b.indices)
    assert [read_frame_index(f) for f in b.frames] == b.indices.tolist()
    assert a.frames.shape == b.frames.shape
    # Only the YUV->RGB conversion differs between the two libraries.
    diff = (a.frames.int() - b.frames.int()).abs()
    assert diff.max() <= 8 and diff.float().mean() <= 2.0
    # Resizing happens after decoding, in one shared function: sizes and indices agree too.
    r = decode(path, ts, backend="dali", size=(32, 48))
    assert r.frames.shape == (len(ts), 32, 48, 3)


def test_dali_planner_serves_overlapping_requests(make_clip) -> None:
    path = make_clip(gop=12, codec="vp9", duration=20.0)
    reqs = [
        FrameRequest(path, (1.0, 2.0, 3.0), (32, 32)),
        FrameRequest(path, (2.0, 3.0, 4.0, 19.5), (32, 32)),
        FrameRequest(path, (25.0,), None),
    ]
    planner = DecodePlanner(backend="dali")
    out = planner.run(reqs)
    assert isinstance(out[2], VideoError) and "outside the video" in str(out[2])
    for req, got in zip(reqs[:2], out[:2]):
        want = decode(path, req.timestamps, size=req.size, backend="dali")
        assert torch.equal(got.frames, want.frames) and torch.equal(got.indices, want.indices)
    assert planner.stats["frames_decoded"] == 5  # union of distinct frames, once each


@pytest.mark.skipif(not CPU_ONLY, reason="on a GPU, DALI decodes H.264 with NVDEC")
def test_dali_h264_on_cpu_is_a_clear_error(make_clip) -> None:
    path = make_clip(gop=12, codec="h264", duration=10.0)
    with pytest.raises(VideoError, match=r"codec 'h264' cannot be decoded without a GPU.*pyav"):
        decode(path, [1.0], backend="dali")
    out = DecodePlanner(backend="dali").run([FrameRequest(path, (1.0,))])
    assert isinstance(out[0], VideoError) and path in str(out[0])


@pytest.mark.cuda
@pytest.mark.skipif(CPU_ONLY, reason="needs a CUDA GPU (NVDEC)")
def test_dali_gpu_h264_matches_pyav(make_clip) -> None:
    path = make_clip(gop=12, codec="h264", duration=20.0)
    ts = overview_timestamps(probe(path), 16)
    a, b = decode(path, ts), decode(path, ts, backend="dali")
    assert torch.equal(a.indices, b.indices)
    assert [read_frame_index(f) for f in b.frames] == b.indices.tolist()
    assert (a.frames.int() - b.frames.int()).abs().float().mean() <= 2.0
