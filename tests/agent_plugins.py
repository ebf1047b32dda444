"""Plug-ins from outside paravt, named by ``module:attr`` in the config (tests/test_agent_plugins):
a second tool, ``zoom_frame`` (one decoded frame's region, looked at by a sub-agent), and a
reward term. Not a test module (no ``test_`` prefix): pytest puts ``tests/`` on ``sys.path``.
"""

from __future__ import annotations

from typing import Any

import torch

from paravt.agent.tools import ToolFailure, number, quote
from paravt.config import VideoConfig
from paravt.types import FrameBatch, FrameRequest, Sample, ToolCall, Trajectory, VideoMeta
from paravt.video.sampling import resize_frames
from paravt.vision.resize import smart_resize

ZOOM_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "zoom_frame",
        "description": (
            "Look closely at a region of the video frame shown at one time. A helper looks at "
            "the region at a higher resolution and describes it."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "time": {"type": "number", "description": "Seconds from the video's start."},
                "x0": {"type": "number", "description": "Region left, 0-1 of the width."},
                "y0": {"type": "number", "description": "Region top, 0-1 of the height."},
                "x1": {"type": "number", "description": "Region right, 0-1 of the width."},
                "y1": {"type": "number", "description": "Region bottom, 0-1 of the height."},
            },
            "required": ["time", "x0", "y0", "x1", "y1"],
            "additionalProperties": False,
        },
    },
}
ARGS = ("time", "x0", "y0", "x1", "y1")


def region_pixels(call: ToolCall, h: int, w: int) -> tuple[int, int, int, int]:
    """The call's region as pixel bounds ``(top, bottom, left, right)`` of an ``h x w`` frame
    (at least one pixel each way)."""
    a = call.arguments
    top, left = int(a["y0"] * h), int(a["x0"] * w)
    bottom, right = max(int(round(a["y1"] * h)), top + 1), max(int(round(a["x1"] * w)), left + 1)
    return top, min(bottom, h), left, min(right, w)


class ZoomFrame:
    """``zoom_frame(time, x0, y0, x1, y1)``: the region ``[x0, x1] x [y0, y1]`` (fractions of
    the frame) of the frame shown at ``time``, at the crop pixel budget."""

    name = "zoom_frame"
    schema = ZOOM_SCHEMA

    def check(self, call: ToolCall, args: dict[str, Any], duration: float) -> None:
        extra = sorted(set(args) - set(ARGS))
        if extra:
            call.status = "bad_arguments"
            call.error = f"unknown argument(s) {quote(', '.join(extra))}; zoom_frame takes {ARGS}"
            return
        vals = {}
        for k in ARGS:
            v = number(args.get(k))
            if v is None:
                call.status, call.error = "bad_arguments", f"argument {k} must be a number"
                return
            vals[k] = v
        if not 0.0 <= vals["time"] <= duration:
            call.status = "outside_video"
            call.error = f"time {vals['time']:g} s is outside the video [0, {duration:.1f}] s"
            return
        for lo, hi in (("x0", "x1"), ("y0", "y1")):
            if not 0.0 <= vals[lo] < vals[hi] <= 1.0:
                call.status = "bad_range"
                call.error = f"need 0 <= {lo} < {hi} <= 1 (fractions of the frame)"
                return
        call.start = call.end = vals["time"]

    def plan(
        self, call: ToolCall, video: str, meta: VideoMeta, vcfg: VideoConfig, factor: int
    ) -> FrameRequest | ToolFailure:
        t = min(float(call.start or 0.0), max(meta.duration - 1e-3, 0.0))
        return FrameRequest(video, (t,), None)  # the frame at its full size

    def view(
        self, call: ToolCall, batch: FrameBatch, vcfg: VideoConfig, factor: int
    ) -> tuple[torch.Tensor, list[float]]:
        frame = batch.frames[:1]
        top, bottom, left, right = region_pixels(call, frame.shape[1], frame.shape[2])
        region = frame[:, top:bottom, left:right]
        size = smart_resize(
            region.shape[1], region.shape[2], factor, vcfg.crop_min_pixels, vcfg.crop_max_pixels
        )
        return resize_frames(region, size), [float(batch.timestamps[0])]

    def instruction(self, call: ToolCall, question: str | None) -> str:
        a = call.arguments
        s = (
            f"The image is the region x {a['x0']:g}-{a['x1']:g}, y {a['y0']:g}-{a['y1']:g} of "
            f"the frame at {call.start:.1f} s. Describe what it shows."
        )
        return s + (f" It will help answer: {question}" if question else "")

    def label(self, call: ToolCall) -> str:
        a = call.arguments
        return f"[zoom {call.start:.1f} s, x {a['x0']:g}-{a['x1']:g}, y {a['y0']:g}-{a['y1']:g}]"


ZOOM = ZoomFrame()


def zoom_calls(traj: Trajectory, sample: Sample) -> float:
    """A plug-in reward term: the executed ``zoom_frame`` calls (structure, not text)."""
    return float(
        sum(c.name == "zoom_frame" and c.status == "ok" for t in traj.turns for c in t.calls)
    )


NOT_A_TOOL = 42
