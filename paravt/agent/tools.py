"""The ``crop_video`` tool: validated calls -> decode requests on the sample's own video.

The model's call names only a time window; the file is always the sample's video (a path the
model writes is rejected by the parser and never opened). Each window is clamped to the video
(the parser already did), sampled at ``video.crop_fps`` up to ``video.crop_max_frames`` and at
least ``video.crop_min_frames`` frames, and resized to the crop pixel budget. All windows of
all rollouts of a turn are handed to ``DecodePlanner.run`` together, so each file is opened and
each needed GOP decoded once per turn, however many rollouts asked for overlapping windows.
"""

from __future__ import annotations

from paravt.config import VideoConfig
from paravt.types import CropRequest, FrameRequest, ToolCall, VideoMeta
from paravt.video import VideoError, crop_timestamps, frame_size_for_budget


def crop_request(call: ToolCall, video: str, vcfg: VideoConfig) -> CropRequest:
    """The ``CropRequest`` of a validated (``status == 'ok'``) call on ``video``."""
    if call.status != "ok" or call.start is None or call.end is None:
        raise ValueError(
            f"crop_request: call {call.raw!r} has status {call.status!r}; only validated calls "
            "(parser status 'ok', clamped start/end) can be cropped"
        )
    return CropRequest(
        video=video,
        start=call.start,
        end=call.end,
        fps=vcfg.crop_fps,
        max_frames=vcfg.crop_max_frames,
        min_frames=vcfg.crop_min_frames,
        max_pixels=vcfg.crop_max_pixels,
        min_pixels=vcfg.crop_min_pixels,
    )


def frame_request(req: CropRequest, meta: VideoMeta, factor: int, tag: str = "") -> FrameRequest:
    """Times and frame size of one crop (raises ``VideoError`` for an empty window)."""
    ts = crop_timestamps(
        meta, req.start, req.end, fps=req.fps, max_frames=req.max_frames, min_frames=req.min_frames
    )
    size = frame_size_for_budget(meta, req.min_pixels, req.max_pixels, factor)
    return FrameRequest(video=req.video, timestamps=tuple(ts), size=size, tag=tag)


def plan_crops(
    jobs: list[tuple[ToolCall, str, VideoMeta]], vcfg: VideoConfig, factor: int
) -> list[FrameRequest | VideoError]:
    """Frame requests for ``(call, video, meta)`` jobs, or the error that prevents one."""
    out: list[FrameRequest | VideoError] = []
    for i, (call, video, meta) in enumerate(jobs):
        try:
            out.append(frame_request(crop_request(call, video, vcfg), meta, factor, f"crop:{i}"))
        except VideoError as e:
            out.append(e)
    return out
