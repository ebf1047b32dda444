"""The video corpus (``tests/video_corpus.py``) through the DALI backend: the same frames, the
same way up, as the CPU backend returns (``test_video_corpus.py``).

Without CUDA, DALI's CPU decoder handles VP9 and MJPEG only: those cases run here, every other
case skips naming the codec; ``scripts/gpu_check.sh`` runs the whole file on the GPU (NVDEC).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_video_corpus import NAMES, _decodable_times
from video_corpus import build_corpus, read_barcode

from paravt.types import FrameRequest
from paravt.video import DecodePlanner, VideoError, decode, overview_request, probe
from paravt.video.dali_backend import CPU_CODECS, GPU_CODECS

pytest.importorskip("nvidia.dali")
pytestmark = pytest.mark.dali

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory):
    return build_corpus(tmp_path_factory.mktemp("corpus_dali"))


def _case(corpus, name: str):
    case = corpus[name]
    supported = GPU_CODECS if CUDA else CPU_CODECS
    if case.codec not in supported:
        pytest.skip(f"DALI decodes {case.codec} only on a CUDA GPU (NVDEC)")
    return case


@pytest.mark.parametrize("name", NAMES)
def test_dali_returns_the_frame_shown_at_every_time(corpus, name: str) -> None:
    case = _case(corpus, name)
    ts = _decodable_times(case)
    fb = decode(case.path, ts, backend="dali")
    assert tuple(fb.frames.shape[1:]) == (case.height, case.width, 3)
    assert [read_barcode(np.asarray(f)) for f in fb.frames] == [case.code_at(t) for t in ts]


@pytest.mark.parametrize("name", NAMES)
def test_dali_planner_matches_pyav(corpus, name: str) -> None:
    case = _case(corpus, name)
    ov = overview_request(case.path, 8, min_pixels=32 * 32, max_pixels=64 * 96)
    reqs = [ov, FrameRequest(case.path, tuple(_decodable_times(case)[:12]), None, "native")]
    got = DecodePlanner("dali", timeout_s=None).run(reqs)
    want = DecodePlanner("pyav", timeout_s=None).run(reqs)
    for g, w in zip(got, want, strict=True):
        assert not isinstance(g, VideoError), g
        assert torch.equal(g.indices, w.indices)
        assert g.frames.shape == w.frames.shape
        # Only the YUV->RGB conversion differs between the two libraries.
        assert (g.frames.int() - w.frames.int()).abs().float().mean() <= 3.0
    assert probe(case.path).num_frames == len(case.times)
