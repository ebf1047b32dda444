"""Real-world video files decode the right frames, the right way up (issue 34, items 1-10).

The corpus (``tests/video_corpus.py``) is written at test time by PyAV's bundled encoders:
H.264, HEVC 8/10-bit, VP9, AV1, MPEG-4 part 2, MJPEG in mp4, mkv, webm, avi and MPEG-TS, each
frame showing its own index as a barcode. Every test reads the barcodes back from the frames
the readers return and compares them with the frame a player shows at each requested time.

Time convention (``paravt.video``): seconds on the file's own timeline, 0 = the container's
start (what a player shows as 0:00). It is the first frame's time for almost every file; a
video stream that starts after the audio starts at ``meta.start_time`` and a time before it
shows the first frame.
"""

from __future__ import annotations

import importlib
import json
import tracemalloc
from fractions import Fraction

import av
import numpy as np
import pytest
from video_corpus import (
    Case,
    build_corpus,
    elst_entries,
    read_barcode,
    tkhd_matrix,
)

from paravt.data.readers import read_samples
from paravt.eval.benchmarks import load_benchmark
from paravt.types import CropRequest, FrameRequest
from paravt.video import (
    DecodePlanner,
    VideoError,
    crop_request,
    decode,
    overview_request,
    probe,
    stream_index,
)
from paravt.vision.resize import smart_resize

# The module (``paravt.video.probe`` the attribute is the function of the same name).
probe_mod = importlib.import_module("paravt.video.probe")

NAMES = [
    "h264_bframes_longgop.mp4",
    "h264_odd_size.mkv",
    "hevc8.mp4",
    "hevc10.mkv",
    "vp9.webm",
    "vp9_no_index.webm",
    "mpeg4.avi",
    "mjpeg.avi",
    "vfr.mp4",
    "vfr.mkv",
    "audio_first.mp4",
    "two_video.mkv",
    "trimmed_editlist.mp4",
    "rotate-90.mp4",
    "rotate90.mp4",
    "rotate180.mp4",
    "late_video.mkv",
    "anamorphic.mp4",
    "mpegts.ts",
    "av1.mkv",
    "av1.mp4",
    "corrupt_packet.mp4",
    # The hostile cases again in VP9, which DALI's CPU decoder reads (test_video_corpus_dali).
    "audio_first_vp9.webm",
    "two_video_vp9.mkv",
    "trimmed_editlist_vp9.mp4",
    "rotate-90_vp9.mp4",
    "late_video_vp9.mkv",
    "anamorphic_vp9.mp4",
]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    cases = build_corpus(tmp_path_factory.mktemp("corpus"))
    assert list(cases) == NAMES
    return cases


def _codes(frames) -> list[int]:
    return [read_barcode(np.asarray(f)) for f in frames]


def _decodable_times(case: Case) -> list[float]:
    return [t for t in case.probe_times() if case.frame_at(t) not in case.undecodable]


# ------------------------------------------------------------------- the files are real
def test_corpus_files_have_the_structures_they_claim(corpus: dict[str, Case]) -> None:
    """Each hostile case really has its feature, as FFmpeg sees it (else the tests below
    would prove nothing)."""

    def streams(name: str) -> list[str]:
        with av.open(corpus[name].path) as c:
            return [s.type for s in c.streams]

    for tag, ext in (("", "mp4"), ("_vp9", "webm")):
        assert streams(f"audio_first{tag}.{ext}") == ["audio", "video"]
        assert streams(f"two_video{tag}.mkv") == ["audio", "video", "video"]
        # A real edit list that starts the presentation after the pre-roll.
        (entry,) = elst_entries(corpus[f"trimmed_editlist{tag}.mp4"].path)
        assert entry[1] > 0
        with av.open(corpus[f"trimmed_editlist{tag}.mp4"].path) as c:
            hidden = [p for p in c.demux(video=0) if p.size and p.is_discard]
        assert len(hidden) == 5
        # The -90 degree file carries the matrix an iPhone writes for a portrait video.
        (m,) = tkhd_matrix(corpus[f"rotate-90{tag}.mp4"].path)
        assert m[:5] == (0, 65536, 0, -65536, 0)
        with av.open(corpus[f"anamorphic{tag}.mp4"].path) as c:
            assert c.streams.video[0].sample_aspect_ratio == Fraction(4, 3)
    with av.open(corpus["vp9_no_index.webm"].path) as c:
        assert c.duration is None and c.streams.video[0].duration is None
    with av.open(corpus["late_video.mkv"].path) as c:
        assert [float(s.start_time * s.time_base) for s in c.streams] == [0.0, 1.0]
    with av.open(corpus["vfr.mkv"].path) as c:
        assert float(c.streams.video[0].average_rate) == 30.0  # the nominal rate, not the true


# ------------------------------------------------------------------------------- probe
@pytest.mark.parametrize("name", NAMES)
def test_probe_reports_what_a_player_shows(corpus: dict[str, Case], name: str) -> None:
    case = corpus[name]
    m = probe(case.path)
    got = (m.codec, m.width, m.height, m.num_frames)
    assert got == (case.codec, case.width, case.height, len(case.times))
    assert m.fps == pytest.approx(case.fps, rel=2e-3)
    assert m.duration == pytest.approx(case.duration, abs=2e-3)
    assert m.start_time == pytest.approx(case.times[0], abs=1e-3)


# ------------------------------------------------------------------- frame-exact decoding
@pytest.mark.parametrize("name", NAMES)
def test_decode_returns_the_frame_shown_at_every_time(corpus: dict[str, Case], name: str) -> None:
    """``decode`` at every frame's start and midpoint: the barcode is the one on screen, and
    the frame comes back at the displayed size (rotated, pixel aspect applied)."""
    case = corpus[name]
    ts = _decodable_times(case)  # the corrupt file: the frames outside its broken GOP
    fb = decode(case.path, ts)
    assert tuple(fb.frames.shape[1:]) == (case.height, case.width, 3)
    assert _codes(fb.frames) == [case.code_at(t) for t in ts]
    assert fb.indices.tolist() == [case.frame_at(t) for t in ts]


@pytest.mark.parametrize("name", NAMES)
def test_planner_overviews_and_crops_are_frame_exact(corpus: dict[str, Case], name: str) -> None:
    """The main path: an overview and crop windows at pixel budgets, through one planner."""
    case = corpus[name]
    budget = {"overview": (32 * 32, 64 * 96), "crop": (32 * 32, 96 * 128)}
    ov = overview_request(case.path, 8, min_pixels=32 * 32, max_pixels=64 * 96)
    d = case.duration
    crops = [
        crop_request(CropRequest(case.path, s * d, e * d, 4.0, 12, 2, 96 * 128, 32 * 32))
        for s, e in [(0.0, 0.4), (0.3, 0.9), (0.75, 1.0)]
    ]
    reqs = [ov, *crops]
    res = DecodePlanner(timeout_s=None).run(reqs)
    for req, fb in zip(reqs, res, strict=True):
        want = [case.code_at(t) for t in req.timestamps]
        if any(case.frame_at(t) in case.undecodable for t in req.timestamps):
            assert isinstance(fb, VideoError), req.tag
            continue
        assert not isinstance(fb, VideoError), fb
        # The budget size is the displayed size's (portrait for the phone files, 16:9 for
        # the anamorphic one).
        assert req.size == smart_resize(case.height, case.width, 32, *budget[req.tag]), req.tag
        assert _codes(fb.frames) == want, req.tag


# ------------------------------------------------------------------- issue 34, item by item
def test_audio_first_decode_reads_the_video_stream(corpus: dict[str, Case]) -> None:
    """Item 1: the video is stream 1 (audio is 0); decode() used to raise a bare IndexError."""
    case = corpus["audio_first.mp4"]
    assert stream_index(case.path).stream_index == 1
    fb = decode(case.path, [0.05, 1.55, 2.95])
    assert _codes(fb.frames) == [0, 15, 29]


def test_two_video_tracks_decode_the_probed_one(corpus: dict[str, Case]) -> None:
    """Item 2: [audio, A, B]: the probe indexes A and the decoder must read A, not B (whose
    barcodes are 255 - index)."""
    case = corpus["two_video.mkv"]
    assert stream_index(case.path).stream_index == 1
    fb = decode(case.path, [0.05, 1.05, 2.95])
    assert _codes(fb.frames) == [0, 10, 29]


def test_trimmed_mp4_hides_the_pre_roll(corpus: dict[str, Case]) -> None:
    """Item 3: the edit list hides frames 20-24 of the source: the clip is 3.5 s, 35 frames,
    and t=0 shows source frame 25."""
    case = corpus["trimmed_editlist.mp4"]
    m = probe(case.path)
    assert (m.num_frames, round(m.duration, 6)) == (35, 3.5)
    fb = decode(case.path, [0.0, 0.05, 1.0, 3.45])
    assert _codes(fb.frames) == [25, 25, 35, 59]


@pytest.mark.parametrize("deg", [-90, 90, 180])
def test_rotated_frames_come_back_upright(corpus: dict[str, Case], deg: int) -> None:
    """Item 4: frames stored turned come back as a player shows them (portrait 48x64 for the
    phone's +-90), at native size and through the planner's budget resize."""
    case = corpus[f"rotate{deg}.mp4"]
    m = probe(case.path)
    assert (m.width, m.height, m.rotation) == (case.width, case.height, deg % 360)
    fb = decode(case.path, [0.05, 1.25])
    assert fb.frames.shape[1:3] == (case.height, case.width)
    assert _codes(fb.frames) == [0, 12]
    (small,) = DecodePlanner(timeout_s=None).run(
        [FrameRequest(case.path, (0.55,), (case.height // 2, case.width // 2))]
    )
    assert _codes(small.frames) == [5]


def test_late_video_stream_lands_on_the_players_timeline(corpus: dict[str, Case]) -> None:
    """Item 5: the video starts 1.0 s after the audio. An annotation made in a player ('at
    2.0 s') means the frame shown at 2.0 s on the file's timeline: index 10, not 20."""
    case = corpus["late_video.mkv"]
    m = probe(case.path)
    assert m.start_time == pytest.approx(1.0)
    assert m.duration == pytest.approx(4.0)
    fb = decode(case.path, [0.0, 0.5, 1.0, 2.0, 3.95])
    assert _codes(fb.frames) == [0, 0, 0, 10, 29]
    # The overview spreads over the frames (1.0-4.0 s), not over the silent first second.
    ov = overview_request(case.path, 3, min_pixels=1024, max_pixels=64 * 96)
    assert ov.timestamps == pytest.approx((1.5, 2.5, 3.5))


def test_codec_is_the_codecs_name_not_the_decoders(corpus: dict[str, Case]) -> None:
    """Item 6: AV1 decodes with libdav1d; the probe must say 'av1' (DALI checks codec names)."""
    from paravt.video.dali_backend import GPU_CODECS

    for name in ("av1.mkv", "av1.mp4"):
        assert probe(corpus[name].path).codec == "av1"
    assert {probe(corpus[n].path).codec for n in NAMES} <= GPU_CODECS | {"mjpeg"}


def test_probe_cache_is_bounded_in_bytes(corpus: dict[str, Case], monkeypatch) -> None:
    """Item 7: the per-frame index costs <= 24 bytes a frame (two int64/float64 arrays; a
    tuple of Python ints and floats costs ~70) and the cache evicts by bytes."""
    path = corpus["h264_bframes_longgop.mp4"].path  # 90 frames
    probe_mod.clear_probe_cache()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        sidx = stream_index(path)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert sidx.nbytes <= 24 * sidx.meta.num_frames + 4096
    assert held <= 24 * 90 + 8192, held
    # A budget that fits two of these files holds two, never more, whatever their count.
    budget = 2 * sidx.nbytes + sidx.nbytes // 2
    monkeypatch.setattr(probe_mod, "PROBE_CACHE_BYTES", budget)
    probe_mod.clear_probe_cache()
    for name in NAMES[:6]:
        stream_index(corpus[name].path)
        info = probe_mod.probe_cache_info()
        assert info["bytes"] <= budget
    assert info["files"] >= 1
    assert info["bytes"] == sum(s.nbytes for s in probe_mod._cache.values())


def test_anamorphic_frames_reach_the_model_at_display_aspect(corpus: dict[str, Case]) -> None:
    """Item 8: 64x48 pixels of aspect 4:3 are shown 85x48 (16:9); the budget size is 16:9."""
    case = corpus["anamorphic.mp4"]
    m = probe(case.path)
    assert (m.width, m.height, m.sample_aspect) == (85, 48, pytest.approx(4 / 3))
    fb = decode(case.path, [0.05])
    assert fb.frames.shape[1:3] == (48, 85)
    ov = overview_request(case.path, 4, min_pixels=32 * 32, max_pixels=128 * 72)
    # Qwen's 32-px grid: 16:9 content gets 64x96 (the stored 4:3 pixels would get 64x64).
    assert ov.size == smart_resize(48, 85, 32, 32 * 32, 128 * 72) == (64, 96)


def test_one_corrupt_packet_fails_only_its_frames(corpus: dict[str, Case]) -> None:
    """Item 9: frame 28's packet is garbage. Frames of the other GOPs (0-19, 20-27 decoded
    before it, 40-59) are served and exact; requests needing frames 28-39 (whose references
    are gone) fail naming the count; the error is counted."""
    case = corpus["corrupt_packet.mp4"]
    planner = DecodePlanner(timeout_s=None)
    reqs = [
        FrameRequest(case.path, (0.05, 1.05, 2.05), None, "before"),
        FrameRequest(case.path, (2.85, 3.05), None, "hit"),
        FrameRequest(case.path, (4.05, 5.95), None, "after"),
    ]
    before, hit, after = planner.run(reqs)
    assert _codes(before.frames) == [0, 10, 20]
    assert _codes(after.frames) == [40, 59]
    assert isinstance(hit, VideoError)
    assert "decoding failed for 2 of 7 needed frames (near frame 28 of 60" in str(hit)
    assert "rejected 1 packet(s)" in str(hit)
    assert planner.stats["decode_errors"] == 1
    # One-shot decode of frames around (not in) the damage: served.
    fb = decode(case.path, [2.75, 4.0])
    assert _codes(fb.frames) == [27, 40]


def test_vfr_mkv_reports_the_true_average_fps(corpus: dict[str, Case]) -> None:
    """Item 10: 40 frames over 2.6 s is 15 fps, not the muxer's nominal 30."""
    for name in ("vfr.mkv", "vfr.mp4"):
        m = probe(corpus[name].path)
        assert m.fps == pytest.approx(39 / 2.6, rel=1e-3)


# -------------------------------------------------- through the datasets' and benchmarks' readers
def test_dataset_and_benchmark_rows_decode_the_right_frames(corpus, tmp_path) -> None:
    """A training JSONL row, a synth-benchmark row and a Charades-STA row per corpus file:
    the reader resolves the path, and the overview and the annotated window (as the tool would
    crop it) come back with the frames a player shows at those times."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    root = tmp_path / "data"
    (root / "videos").mkdir(parents=True)
    (root / "Charades_v1_480").mkdir()
    (root / "data").mkdir()
    rows, ch = [], {"video": [], "caption": [], "timestamp": []}
    for i, name in enumerate(NAMES):
        case = corpus[name]
        if case.undecodable:
            continue
        for d in ("videos", "Charades_v1_480"):
            (root / d / name).symlink_to(case.path)
        s, e = round(case.duration * 0.3, 3), round(case.duration * 0.7, 3)
        rows.append(
            {
                "id": f"r{i}",
                "video": f"videos/{name}",
                "question": "Which colour?",
                "answer": "A",
                "options": ["red", "blue"],
                "question_type": "mcq",
                "event_start": s,
                "event_end": e,
            }
        )
        ch["video"].append(name)
        ch["caption"].append(f"the event in {name}")
        ch["timestamp"].append([s, e])
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (root / "train.jsonl").write_text(text)
    (root / "val.jsonl").write_text(text)
    pq.write_table(pa.table(ch), root / "data" / "test-00000-of-00001.parquet")

    train, _ = read_samples(root / "train.jsonl")
    samples = train + load_benchmark("synth", root) + load_benchmark("charades_sta", root)
    assert len(samples) == 3 * len(rows)
    reqs, cases = [], []
    for smp in samples:
        case = corpus[smp.video.rsplit("/", 1)[-1]]
        reqs.append(overview_request(smp.video, 6, min_pixels=1024, max_pixels=64 * 96))
        win = CropRequest(smp.video, smp.event_start, smp.event_end, 4.0, 8, 2, 6144, 1024)
        reqs.append(crop_request(win))
        cases += [case, case]
    res = DecodePlanner(timeout_s=None).run(reqs)
    for req, fb, case in zip(reqs, res, cases, strict=True):
        assert not isinstance(fb, VideoError), fb
        assert _codes(fb.frames) == [case.code_at(t) for t in req.timestamps], req.video
