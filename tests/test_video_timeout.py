"""A read that never returns (a FIFO, a stalled network mount, a pathological file) costs one
sample and ``video.decode_timeout_s`` seconds, never the step or the eval.

The stall is real, not a sleep: ``av.open`` of the victim file is pointed at a FIFO that no
process writes, so FFmpeg blocks in ``open(2)`` exactly as on a dead mount. Each test opens the
FIFO's write end at the end, which lets the abandoned decode thread finish.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import av
import pytest

from paravt.config import ConfigError, load_config
from paravt.types import FrameBatch, FrameRequest
from paravt.video import DecodePlanner, VideoError, decode, probe, stream_index, stuck_reads
from paravt.video.probe import clear_probe_cache

SLACK_S = 3.0  # thread hand-off + the healthy file's decode, on a busy 2-core machine


@pytest.fixture
def fifo(tmp_path: Path):
    path = tmp_path / "stalled.mp4"
    os.mkfifo(path)
    yield str(path)
    _release(str(path))


def _release(fifo: str) -> None:
    """Open the FIFO's write end (without blocking) and close it: a reader stuck in open()
    returns and sees EOF, so the abandoned decode thread ends."""
    for _ in range(50):
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # ENXIO: no reader (yet, or any more)
            pass
        time.sleep(0.01)


def _stall(monkeypatch: pytest.MonkeyPatch, victim: str, fifo: str) -> None:
    """``av.open(victim)`` blocks like a read from a dead mount (it opens the FIFO)."""
    real_open = av.open

    def open_(path, *a, **k):
        return real_open(fifo if str(path) == victim else path, *a, **k)

    monkeypatch.setattr(av, "open", open_)


def _bounded(fn, limit_s: float):
    """``fn()`` in a thread; fails the test (instead of hanging it) past ``limit_s``."""
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t0 = time.perf_counter()
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"the call did not return within {limit_s} s: it hangs"
    if "error" in box:
        raise box["error"]
    return box["value"], time.perf_counter() - t0


def test_a_fifo_as_the_video_fails_at_once_without_being_opened(fifo: str) -> None:
    """Opening a FIFO for reading blocks until a writer appears: probe, decode and the
    planner must refuse it from its ``stat`` and never open it."""
    for call in (
        lambda: probe(fifo),
        lambda: decode(fifo, [0.0]),
        lambda: DecodePlanner().run([FrameRequest(fifo, (0.0,), None, "overview")])[0],
    ):
        out, took = _bounded(lambda call=call: _result(call), limit_s=10)
        assert isinstance(out, VideoError) and out.path == fifo
        assert "not a regular file" in out.problem and took < 1.0


def _result(call):
    try:
        return call()
    except VideoError as e:
        return e


def test_a_decode_that_never_returns_times_out_and_the_worker_is_replaced(
    make_clip, fifo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    good, bad = make_clip(duration=8.0), make_clip(duration=6.0)
    want = decode(good, [0.0, 3.0, 7.5])
    stream_index(bad)  # probed while healthy; the decode itself stalls
    _stall(monkeypatch, bad, fifo)
    timeout = 0.5
    planner = DecodePlanner(timeout_s=timeout)
    reqs = [
        FrameRequest(bad, (0.0, 1.0), None, "overview"),
        FrameRequest(good, (0.0, 3.0, 7.5), None, "crop:0"),
    ]
    (out_bad, out_good), took = _bounded(lambda: planner.run(reqs), limit_s=30)
    assert took < timeout + SLACK_S, took
    assert isinstance(out_bad, VideoError) and out_bad.path == bad, out_bad
    assert "video.decode_timeout_s=0.5" in out_bad.problem and "skipped" in out_bad.problem
    assert isinstance(out_good, FrameBatch) and out_good.frames.equal(want.frames)
    assert planner.stats["decode_timeouts"] == 1 and planner.stats["failed_requests"] == 1

    # The next run gets a fresh worker: the good file decodes, the stalled one fails fast
    # (its abandoned read is still stuck: it is not retried until that read returns).
    (again_bad, again_good), took = _bounded(lambda: planner.run(reqs), limit_s=30)
    assert isinstance(again_good, FrameBatch) and again_good.frames.equal(want.frames)
    assert isinstance(again_bad, VideoError) and "still blocked" in again_bad.problem
    assert took < SLACK_S and planner.stats["decode_timeouts"] == 1, (took, planner.stats)

    # Once the stuck read returns (here: a writer opens and closes the FIFO) and the file
    # reads again (the "mount" recovered), it is tried again and decodes.
    _release(fifo)
    monkeypatch.undo()
    for _ in range(500):  # the abandoned thread ends once FFmpeg sees the EOF
        if stuck_reads() == 0:
            break
        time.sleep(0.02)
    assert stuck_reads() == 0
    (third_bad, _), _ = _bounded(lambda: planner.run(reqs), limit_s=30)
    assert isinstance(third_bad, FrameBatch) and third_bad.frames.equal(decode(bad, [0, 1]).frames)


def test_a_probe_that_never_returns_times_out(
    make_clip, fifo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = make_clip(duration=5.0)
    clear_probe_cache()
    _stall(monkeypatch, bad, fifo)
    out, took = _bounded(lambda: _result(lambda: probe(bad, timeout_s=0.4)), limit_s=30)
    assert isinstance(out, VideoError) and out.path == bad and took < 0.4 + SLACK_S
    assert "video.decode_timeout_s=0.4" in out.problem and "probing" in out.problem


def test_decode_timeout_is_validated() -> None:
    assert load_config("tiny_cpu").video.decode_timeout_s == 60.0
    for bad, why in (("0", "must be > 0"), ("-1", "must be > 0"), ("nan", "is not a finite")):
        with pytest.raises(ConfigError, match=rf"video\.decode_timeout_s=\S+ {why}"):
            load_config("tiny_cpu", overrides=[f"video.decode_timeout_s={bad}"])


def test_an_eval_finishes_with_the_stalled_video_as_an_error_row(
    assets, synth_dir, fifo: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``paravt.eval``'s runner on the synthetic benchmark, one video's decode stalled: the
    eval completes, that sample is an error row (kind ``video``, retried on resume), the others
    are evaluated."""
    from paravt.agent import AgentRunner
    from paravt.engines.hf import HFEngine
    from paravt.eval.benchmarks import load_benchmark
    from paravt.eval.runner import EvalSettings, load_results, run_eval
    from paravt.models import load_model

    cfg = load_config(
        "tiny_cpu",
        overrides=[
            "rollout.max_new_tokens=8",
            "rollout.sub_max_new_tokens=4",
            "video.crop_max_frames=4",
            "video.decode_timeout_s=1",
        ],
    )
    tiny = load_model(assets["model"], dtype="float32", device="cpu")
    samples = load_benchmark("synth", synth_dir)[:2]  # one video: give sample 0 its own copy
    shutil.copy(samples[0].video, tmp_path / "stalled_copy.mp4")
    samples[0].video = str(tmp_path / "stalled_copy.mp4")
    stream_index(samples[0].video)  # the probe succeeds; the decode stalls
    _stall(monkeypatch, samples[0].video, fifo)
    settings = EvalSettings(
        benchmark="synth", data_root=str(synth_dir), model="m", engine="hf", frames=4,
        crop_mode="subagent", temperature=0.0, top_p=1.0, sub_temperature=0.0, max_turns=1,
        max_parallel=5, max_new_tokens=8,
    )  # fmt: skip
    runner = AgentRunner(HFEngine(tiny, seed=0), tiny, cfg)
    summary, _ = _bounded(
        lambda: run_eval(samples, runner, tmp_path, settings, show_progress=False), limit_s=240
    )
    rows = load_results(tmp_path)
    bad, good = rows[samples[0].id], rows[samples[1].id]
    assert bad["error_kind"] == "video" and "video.decode_timeout_s=1" in bad["error"]
    assert good["error"] is None and good["prediction"] is not None
    assert summary["n"] == 2 and summary["n_errors"] == 1


def test_a_forked_child_gets_its_own_reader(make_clip) -> None:
    """The helper threads do not survive ``fork``: a child must start its own, not wait on
    the parent's queue until the deadline."""
    clip = make_clip(duration=4.0)
    probe(clip, timeout_s=5)  # the parent's helper exists
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 1
        try:
            t0 = time.perf_counter()
            decode(clip, [0.0, 2.0], timeout_s=5)
            code = 0 if time.perf_counter() - t0 < 2 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
