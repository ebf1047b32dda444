"""The ``crop_video`` tool: a time window of the sample's own video, watched by a sub-agent.

The built-in :class:`paravt.agent.tools.Tool` (``agent.tools`` default
``["paravt.agent.crop:CROP"]``), used by the agent loop (RL, evaluation) and by the SFT
encoder. The model's call names only a time window; the file is always the sample's video (a
path the model writes is never opened: the reference's ``video_path`` argument is accepted and
ignored). The window is clamped to ``[0, duration]``; a partly-outside window is cropped to its
inside part rather than rejected. It is sampled at ``video.crop_fps`` up to
``video.crop_max_frames`` and at least ``video.crop_min_frames`` frames, resized to the crop
pixel budget. All windows of all rollouts of a turn go to ONE ``DecodePlanner.run`` (the agent
loop's tool step, ``paravt.agent.calls``), so each file is opened and each needed GOP decoded
once per turn, however many rollouts asked for overlapping windows.

Argument statuses (``paravt.types.ToolCall``): ``bad_arguments`` (``arguments`` missing / not
an object / a key missing, unknown or not a finite number), ``bad_range`` (``start_time >=
end_time``, or a window empty once clamped), ``outside_video`` (entirely outside the video).
"""

from __future__ import annotations

from typing import Any

import torch

from paravt.agent import prompts
from paravt.agent.tools import ToolFailure, numbers, quote
from paravt.config import VideoConfig
from paravt.types import CropRequest, FrameBatch, FrameRequest, ToolCall, VideoMeta
from paravt.video import VideoError, crop_timestamps, frame_size_for_budget

TOOL_NAME = "crop_video"
ARG_NAMES = ("start_time", "end_time")
# Accepted and ignored (the reference's call format); never used to open a file.
IGNORED_ARGS = ("video_path",)


def check_window(call: ToolCall, args: dict[str, Any], duration: float) -> None:
    """Validate a ``crop_video`` call's arguments; fill the clamped ``call.start/end`` or set
    its status and error (what the parser did for the one tool before tools were plug-ins)."""
    extra = sorted(set(args) - set(ARG_NAMES) - set(IGNORED_ARGS))
    if extra:
        call.status = "bad_arguments"
        call.error = (
            f"unknown argument(s) {quote(', '.join(extra))}; {TOOL_NAME} takes only start_time and "
            "end_time (the video is always the current one)"
        )
        return
    vals = numbers(call, args, ARG_NAMES, unit="seconds")
    if vals is None:
        return
    s, e = vals["start_time"], vals["end_time"]
    if s >= e:
        call.status = "bad_range"
        call.error = f"start_time {s:g} s must be smaller than end_time {e:g} s"
        return
    if e < 0 or s > duration:
        call.status = "outside_video"
        call.error = f"window [{s:g}, {e:g}] s is outside the video, which lasts {duration:.1f} s"
        return
    cs, ce = max(s, 0.0), min(e, duration)
    if ce <= cs:
        call.status = "bad_range"
        call.error = (
            f"window [{s:g}, {e:g}] s is empty inside the video [0, {duration:.1f}] s; give a "
            "window that overlaps it"
        )
        return
    call.start, call.end = cs, ce


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


class CropVideo:
    """``crop_video(start_time, end_time)``: the :class:`paravt.agent.tools.Tool` the main
    agent has by default."""

    name = TOOL_NAME
    schema = prompts.CROP_VIDEO_SCHEMA

    def check(self, call: ToolCall, args: dict[str, Any], duration: float) -> None:
        check_window(call, args, duration)

    def plan(
        self, call: ToolCall, video: str, meta: VideoMeta, vcfg: VideoConfig, factor: int
    ) -> FrameRequest | ToolFailure:
        try:
            return frame_request(crop_request(call, video, vcfg), meta, factor)
        except VideoError as e:
            return ToolFailure(
                "decode_error", f"the crop could not be decoded ({e.problem})", str(e)
            )

    def view(
        self, call: ToolCall, batch: FrameBatch, vcfg: VideoConfig, factor: int
    ) -> tuple[torch.Tensor, list[float]]:
        return batch.frames, [float(t) for t in batch.timestamps]

    def instruction(self, call: ToolCall, question: str | None) -> str:
        assert call.start is not None and call.end is not None
        return prompts.sub_user_text(call.start, call.end, question)

    def label(self, call: ToolCall) -> str:
        assert call.start is not None and call.end is not None
        return f"[{call.start:.1f}-{call.end:.1f} s]"


#: The instance ``agent.tools`` names by default.
CROP = CropVideo()
