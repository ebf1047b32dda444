"""Deadlines for reads that may never return: every probe and planned decode runs on a helper
thread and the caller waits at most ``video.decode_timeout_s``.

Why: a FIFO, a stalled network mount or a pathological stream can block FFmpeg (in ``open``,
``read`` or the demuxer) forever, and with it a whole training step or eval. Past the deadline
the caller gets a ``VideoError`` for that file — the same error an unreadable video gives, so
the agent loop turns it into a skipped sample (overview) or an error tool response (crop) and
the eval into an error row — and the run goes on.

How, and the honest limits:

- One long-lived daemon helper thread per calling thread (no thread or process start per
  decode; the hand-off costs tens of microseconds). PyAV releases the GIL inside FFmpeg, so a
  blocked helper does not block Python.
- A Python thread cannot be killed. A helper that misses its deadline is *abandoned*: it stays
  blocked where it is (holding its file descriptor and the frames it decoded so far) until the
  read returns — for a FIFO when a writer appears, for a dead mount when it recovers or is
  unmounted, possibly never. A fresh helper serves the next call. When the abandoned one wakes
  it finishes its call, its result is dropped, and it exits. Helpers are daemon threads, so a
  stuck one never holds up interpreter exit.
- While an abandoned read of a file is still blocked, further calls for that file fail at once
  ("still blocked") instead of parking one more thread per call; once it returns, the file is
  tried again. ``stuck_reads()`` counts the helpers still blocked (logged at each timeout).
- A worker *process* would free the stuck read for real, but only at a process start per
  replacement plus a copy of every decoded frame across processes on the fast path; and a
  process in uninterruptible sleep on a dead NFS mount cannot be killed either.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

from paravt.video.errors import VideoError, VideoTimeout

log = logging.getLogger(__name__)

T = TypeVar("T")

# Default deadline (s) of one probe or one file's planned decode; ``video.decode_timeout_s``.
# Healthy decodes of the planner take milliseconds to a few seconds per file.
DEFAULT_DECODE_TIMEOUT_S = 60.0


class _Job:
    __slots__ = ("fn", "done", "value", "error", "key")

    def __init__(self, fn: Callable[[], object], key: str) -> None:
        self.fn = fn
        self.key = key
        self.done = threading.Event()
        self.value: object = None
        self.error: BaseException | None = None


_state = threading.local()  # per calling thread: its helper's queue
_blocked: dict[str, _Job] = {}  # file -> the abandoned job still blocked on it
_blocked_lock = threading.Lock()
_stuck = 0  # abandoned helpers that have not returned yet
_inside = threading.local()  # set on helper threads: nested calls run inline


def _after_fork_in_child() -> None:
    # A forked child (a DataLoader worker, a test) has none of the parent's helper threads:
    # forget their queues, and take a fresh lock (another thread may have held it at the fork).
    global _state, _blocked, _blocked_lock, _stuck
    _state, _blocked, _blocked_lock, _stuck = threading.local(), {}, threading.Lock(), 0


os.register_at_fork(after_in_child=_after_fork_in_child)


def _helper(jobs: queue.SimpleQueue) -> None:
    global _stuck
    _inside.active = True
    while True:
        job = jobs.get()
        if job is None:  # replaced after a timeout: finish and exit
            return
        try:
            job.value = job.fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            job.error = e
        job.done.set()
        with _blocked_lock:
            if _blocked.get(job.key) is job:
                del _blocked[job.key]
                _stuck -= 1


def _queue() -> queue.SimpleQueue:
    jobs = getattr(_state, "jobs", None)
    if jobs is None:
        jobs = queue.SimpleQueue()
        threading.Thread(
            target=_helper, args=(jobs,), name="paravt-video-read", daemon=True
        ).start()
        _state.jobs = jobs
    return jobs


def stuck_reads() -> int:
    """Abandoned helper threads still blocked in a read (they end when the read returns)."""
    return _stuck


def check_timeout(timeout_s: float | None) -> float | None:
    if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(
            f"video decode timeout {timeout_s!r} s must be a finite number > 0 (or None for no "
            "deadline); set video.decode_timeout_s"
        )
    return timeout_s


def with_deadline(fn: Callable[[], T], timeout_s: float | None, path: str, what: str) -> T:
    """``fn()`` on this thread's helper, waiting at most ``timeout_s`` seconds (None: run
    inline, no deadline). Raises ``fn``'s exception, or ``VideoError(path, ...)`` naming the
    deadline when it passes (a ``VideoTimeout``; the helper is then abandoned, see the module docstring)."""
    global _stuck
    if check_timeout(timeout_s) is None or getattr(_inside, "active", False):
        return fn()
    with _blocked_lock:
        prev = _blocked.get(path)
    if prev is not None and not prev.done.is_set():
        raise VideoError(
            path,
            f"{what} skipped: an earlier read of this file passed video.decode_timeout_s and is "
            "still blocked (a FIFO, a stalled network mount or a pathological stream); the "
            "file is tried again once that read returns. Check the file and its mount",
        )
    job = _Job(fn, path)
    jobs = _queue()
    jobs.put(job)
    if job.done.wait(timeout_s):
        if job.error is not None:
            raise job.error
        return job.value  # type: ignore[return-value]
    # Abandon the helper: it exits after its blocked call returns; the next call starts a new one.
    jobs.put(None)
    _state.jobs = None
    with _blocked_lock:
        if not job.done.is_set():  # it may have finished between the wait and here
            _blocked[path] = job
            _stuck += 1
        stuck = _stuck
    log.warning(
        "%s: %s passed video.decode_timeout_s=%g s; the reading thread is abandoned (%d still "
        "blocked in this process) and the run goes on",
        path,
        what,
        timeout_s,
        stuck,
    )
    raise VideoTimeout(
        path,
        f"{what} did not finish within video.decode_timeout_s={timeout_s:g} s: reading the file "
        "blocks (a FIFO, a stalled network mount or a pathological stream). The sample is "
        "skipped; check the file and its mount, or raise video.decode_timeout_s if the video is "
        "just very long",
    )
