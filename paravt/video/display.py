"""Decoded (stored) frames -> frames as a player shows them: pixel aspect, then rotation.

Called by both backends on every frame they return (``pyav_backend.iter_indices``,
``dali_backend.decode_indices``), so ``decode``, the planner and every reader see frames of
``VideoMeta``'s displayed ``(height, width)``: a phone's portrait video upright, 16:9
anamorphic content at 16:9 (the budget resize that follows keeps that aspect).
"""

from __future__ import annotations

import numpy as np
import torch

from paravt.types import VideoMeta
from paravt.video.sampling import resize_frames


def to_display(frame: np.ndarray, meta: VideoMeta) -> np.ndarray:
    """``(H, W, 3)`` uint8 as stored -> ``(meta.height, meta.width, 3)`` as displayed.

    Non-square pixels: the width is resized (bilinear, antialiased) to the displayed width.
    Rotation: ``np.rot90`` by ``meta.rotation`` degrees counter-clockwise (the display
    matrix's angle). A frame already displayable is returned as is (no copy).
    """
    k = (meta.rotation // 90) % 4
    stored_h, stored_w = (meta.width, meta.height) if k % 2 else (meta.height, meta.width)
    if frame.shape[:2] != (stored_h, stored_w):
        # Pixel aspect: only the width differs (the height is the stored one).
        t = torch.from_numpy(np.ascontiguousarray(frame))[None]
        frame = resize_frames(t, (stored_h, stored_w))[0].numpy()
    if k:
        frame = np.ascontiguousarray(np.rot90(frame, k))
    return frame
