"""Which times to sample (overview, crop windows) and at what size.

All functions are pure: they take a ``VideoMeta`` and return seconds or sizes; decoding the
frame shown at each time is the backends' job (``StreamIndex.indices_at`` holds the rule).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from paravt.types import VideoMeta
from paravt.video.errors import VideoError, VideoUnsupported
from paravt.vision.resize import MAX_ASPECT, smart_resize


def overview_timestamps(meta: VideoMeta, k: int) -> list[float]:
    """``k`` times spread uniformly over the video's frames: midpoints of ``k`` equal bins of
    ``[start_time, duration]``, ``t_i = s + (i + 1/2) · (duration - s) / k`` for ``i = 0..k-1``
    (``s = meta.start_time``: 0 unless the video stream starts after the audio, when the
    frames begin later on the file's timeline).

    Midpoints (not ``linspace(0, duration)``) keep the first and last frames from being
    over-represented and make the K=4 and K=64 overviews nest-free but equally spaced.
    ``k`` may exceed the frame count (frames then repeat).
    """
    if k < 1:
        raise ValueError(f"overview_timestamps: k={k} must be >= 1 (the frame budget K)")
    if meta.duration <= 0:
        raise VideoError(meta.path, f"duration {meta.duration} s is not positive")
    # getattr: callers (synth planning) pass duration-only records.
    s = min(max(float(getattr(meta, "start_time", 0.0)), 0.0), meta.duration)
    step = (meta.duration - s) / k
    return [s + (i + 0.5) * step for i in range(k)]


def crop_timestamps(
    meta: VideoMeta,
    start: float,
    end: float,
    *,
    fps: float = 1.0,
    max_frames: int = 16,
    min_frames: int = 2,
) -> list[float]:
    """Times to sample in the window ``[start, end]`` after clamping it to ``[0, duration]``.

    ``n = clamp(ceil((end - start) · fps), min_frames, max_frames)`` frames at the midpoints of
    ``n`` equal bins of the clamped window: spacing ``1/fps`` when the cap does not bind,
    spread uniformly over the window when it does. Raises ``VideoError`` when the window is
    empty after clamping (``start >= end`` or entirely outside the video).
    """
    if fps <= 0:
        raise ValueError(f"crop_timestamps: fps={fps} must be > 0")
    if min_frames < 1 or max_frames < min_frames:
        raise ValueError(
            f"crop_timestamps: need 1 <= min_frames ({min_frames}) <= max_frames ({max_frames})"
        )
    if not (math.isfinite(start) and math.isfinite(end)):
        raise VideoError(meta.path, f"crop window [{start}, {end}] is not finite")
    s = min(max(float(start), 0.0), meta.duration)
    e = min(max(float(end), 0.0), meta.duration)
    if e <= s:
        raise VideoError(
            meta.path,
            f"crop window [{start:.2f}, {end:.2f}] s is empty or outside the video "
            f"[0, {meta.duration:.2f}] s; start must be < end and inside the video",
        )
    # The 1e-9 keeps an exact 10 s window at 1 fps at 10 frames, not 11.
    n = min(max(math.ceil((e - s) * fps - 1e-9), min_frames), max_frames)
    step = (e - s) / n
    return [s + (i + 0.5) * step for i in range(n)]


def frame_size_for_budget(
    meta: VideoMeta, min_pixels: int, max_pixels: int, factor: int = 32
) -> tuple[int, int]:
    """``(h, w)`` for this video under a pixel budget: ``smart_resize`` of its size (sides
    multiples of ``factor`` = patch × merge, aspect kept, ``min_pixels <= h·w <= max_pixels``).
    A video past ``MAX_ASPECT`` raises ``VideoUnsupported`` (smart_resize's ``ValueError``
    would leave the agent loop and fail the whole batch as an engine error)."""
    h, w = int(meta.height), int(meta.width)
    if min(h, w) > 0 and max(h, w) / min(h, w) > MAX_ASPECT:
        raise VideoUnsupported(
            meta.path,
            f"aspect ratio of {h}x{w} exceeds {MAX_ASPECT} (the Qwen-VL preprocessing's limit); "
            "crop or pad the video to a less extreme shape",
        )
    return smart_resize(h, w, factor, min_pixels, max_pixels)


def resize_frames(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Resize uint8 RGB frames ``(T, H, W, 3)`` to ``(T, h, w, 3)``, ``size = (h, w)``.

    Bilinear with antialiasing (``F.interpolate(..., antialias=True)``, half-pixel centres).
    On CPU it runs torch's native uint8 kernel on the channels-last view (no float copy: ~7x
    faster than converting to float32 and 4x less memory), which stays within 1 level of the
    float32 computation; elsewhere it computes in float32 and rounds. Either way each frame is
    interpolated on its own, so the result is deterministic and independent of batching.
    Returns the input unchanged when the size already matches.
    """
    if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(
            f"resize_frames: expected uint8 (T, H, W, 3), got {frames.dtype} {tuple(frames.shape)}"
        )
    h, w = int(size[0]), int(size[1])
    if h <= 0 or w <= 0:
        raise ValueError(f"resize_frames: target size {size} must be positive")
    if frames.shape[1] == h and frames.shape[2] == w:
        return frames
    if frames.shape[0] == 0:
        return frames.new_empty((0, h, w, 3))
    x = frames.permute(0, 3, 1, 2)  # channels-last view, no copy
    if x.device.type == "cpu":
        y = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False, antialias=True)
        return y.permute(0, 2, 3, 1).contiguous()
    y = F.interpolate(
        x.to(torch.float32), size=(h, w), mode="bilinear", align_corners=False, antialias=True
    )
    return y.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()
