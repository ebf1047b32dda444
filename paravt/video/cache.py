"""Bounded LRU cache of decoded (and resized) frames.

Key: ``(path, file_key, frame_index, size)`` — the file (with its size/mtime, so a rewritten
file never serves stale frames), the display-order frame and the output size (``None`` =
native). Never keyed by video alone: two questions on one video, or overview vs crop frames
at different sizes, are different entries.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable

import numpy as np


class FrameCache:
    """LRU over frames (``(H, W, 3)`` uint8 numpy arrays), bounded by a frame count and a byte budget (whichever binds first)."""

    def __init__(self, max_frames: int = 4096, max_bytes: int = 2 << 30) -> None:
        self.max_frames = max(0, int(max_frames))
        self.max_bytes = max(0, int(max_bytes))
        self._d: OrderedDict[Hashable, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._d)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, key: Hashable) -> np.ndarray | None:
        with self._lock:
            v = self._d.get(key)
            if v is not None:
                self._d.move_to_end(key)
            return v

    def put(self, key: Hashable, frame: np.ndarray) -> None:
        if self.max_frames == 0 or frame.nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._d.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._d[key] = frame
            self._bytes += frame.nbytes
            while len(self._d) > self.max_frames or self._bytes > self.max_bytes:
                _, ev = self._d.popitem(last=False)
                self._bytes -= ev.nbytes

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self._bytes = 0
