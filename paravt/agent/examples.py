"""Shipped example plug-ins: a second tool, ``zoom_frame``, and a per-call cost reward term.

Named like any plug-in (README, "Your own tools and rewards"; docs/tools.md)::

    agent.tools=[paravt.agent.crop:CROP,paravt.agent.examples:ZOOM]
    reward.extra_terms=[{fn: "paravt.agent.examples:zoom_cost", weight: 0.02}]

- :data:`ZOOM` (:class:`ZoomFrame`), ``zoom_frame(time, x, y, scale)``: the frame shown at
  ``time`` seconds, magnified ``scale`` times around the point ``(x, y)`` (fractions of the
  width and height, from the top left): one region of ``1/scale`` of each side of the frame,
  decoded at the video's own size and brought to the crop pixel budget, so that a region of a
  large frame is seen at a higher resolution than the K-frame overview gives it. A sub-agent
  with the same weights describes it, as it describes a ``crop_video`` window; calls of both
  tools run in the same parallel turn (one decode plan, one pixel pack, one sub-agent batch:
  ``paravt.agent.calls``).
- :func:`zoom_cost`, a reward term: minus the executed ``zoom_frame`` calls, so that
  ``weight: 0.02`` charges 0.02 a zoom (the built-in ``reward.call_cost`` charges every
  executed call of every tool alike; this one prices one tool on its own).

Written only against ``paravt.agent.toolkit`` (the helpers a tool needs), as a plug-in from
outside paravt would be: copy this file to start one's own. Used by the README's plug-in
command (tests/test_readme.py validates it; tests/test_own_data.py runs it in the agent loop
and in a training step).
"""

from __future__ import annotations

from typing import Any

import torch

from paravt.agent.toolkit import (
    FrameBatch,
    FrameRequest,
    Sample,
    ToolCall,
    ToolFailure,
    Trajectory,
    VideoConfig,
    VideoMeta,
    numbers,
    quote,
    to_crop_budget,
)

ZOOM_NAME = "zoom_frame"
ZOOM_ARGS = ("time", "x", "y", "scale")
#: ``scale`` when the call gives none, and its range: 1 is the whole frame; beyond 8 the region
#: of a 640 px wide frame is under 80 px, fewer pixels than the crop budget shows anyway.
DEFAULT_SCALE = 2.0
MAX_SCALE = 8.0

ZOOM_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": ZOOM_NAME,
        "description": (
            "Look closely at one frame of the video: the region around a point, magnified. A "
            "helper looks at the region at a higher resolution and describes it."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "time": {"type": "number", "description": "Seconds from the video's start."},
                "x": {"type": "number", "description": "Centre, 0-1 of the width from the left."},
                "y": {"type": "number", "description": "Centre, 0-1 of the height from the top."},
                "scale": {
                    "type": "number",
                    "description": f"Magnification, 1-{MAX_SCALE:g} (default {DEFAULT_SCALE:g}).",
                },
            },
            "required": ["time", "x", "y"],
            "additionalProperties": False,
        },
    },
}


def zoom_region(call: ToolCall, h: int, w: int) -> tuple[int, int, int, int]:
    """A checked call's region as pixel bounds ``(top, bottom, left, right)`` of an ``h x w``
    frame: ``round(h / scale) x round(w / scale)`` pixels (at least 1) centred on ``(x, y)``,
    shifted inside the frame where the centre is near an edge."""
    a = call.arguments
    scale = float(a.get("scale", DEFAULT_SCALE))
    rh, rw = max(1, round(h / scale)), max(1, round(w / scale))
    top = min(max(round(float(a["y"]) * h - rh / 2), 0), h - rh)
    left = min(max(round(float(a["x"]) * w - rw / 2), 0), w - rw)
    return top, top + rh, left, left + rw


class ZoomFrame:
    """``zoom_frame(time, x, y, scale)`` (module docstring); a ``paravt.agent.tools.Tool``."""

    name = ZOOM_NAME
    schema = ZOOM_SCHEMA

    def check(self, call: ToolCall, args: dict[str, Any], duration: float) -> None:
        extra = sorted(set(args) - set(ZOOM_ARGS))
        if extra:
            call.status = "bad_arguments"
            call.error = (
                f"unknown argument(s) {quote(', '.join(extra))}; {ZOOM_NAME} takes time, x, y "
                "and scale"
            )
            return
        vals = numbers(call, args, ZOOM_ARGS, optional=("scale",))
        if vals is None:
            return
        if not 0.0 <= vals["time"] <= duration:
            call.status = "outside_video"
            call.error = f"time {vals['time']:g} s is outside the video [0, {duration:.1f}] s"
            return
        for k in ("x", "y"):
            if not 0.0 <= vals[k] <= 1.0:
                call.status = "bad_range"
                call.error = f"{k} {vals[k]:g} must be within 0-1 (a fraction of the frame)"
                return
        if not 1.0 <= vals.get("scale", DEFAULT_SCALE) <= MAX_SCALE:
            call.status = "bad_range"
            call.error = f"scale {vals['scale']:g} must be within 1-{MAX_SCALE:g}"
            return
        call.start = call.end = vals["time"]

    def plan(
        self, call: ToolCall, video: str, meta: VideoMeta, vcfg: VideoConfig, factor: int
    ) -> FrameRequest | ToolFailure:
        # The last frame starts before the duration: a time at the very end reads that frame.
        t = min(float(call.start or 0.0), max(meta.duration - 1e-3, 0.0))
        return FrameRequest(video, (t,), None, tag="zoom")  # the video's own size

    def view(
        self, call: ToolCall, batch: FrameBatch, vcfg: VideoConfig, factor: int
    ) -> tuple[torch.Tensor, list[float]]:
        frame = batch.frames[:1]
        top, bottom, left, right = zoom_region(call, int(frame.shape[1]), int(frame.shape[2]))
        return to_crop_budget(frame[:, top:bottom, left:right], vcfg, factor), [
            float(batch.timestamps[0])
        ]

    def instruction(self, call: ToolCall, question: str | None) -> str:
        a = call.arguments
        s = (
            f"The image is the frame at {call.start:.1f} s, magnified "
            f"{a.get('scale', DEFAULT_SCALE):g} times around x {a['x']:.2f}, y {a['y']:.2f} "
            "(fractions of the width and height). Describe what it shows."
        )
        return s + (f" It will help answer: {question}" if question else "")

    def label(self, call: ToolCall) -> str:
        a = call.arguments
        scale = a.get("scale", DEFAULT_SCALE)
        return f"[zoom {call.start:.1f} s, x {a['x']:.2f}, y {a['y']:.2f}, {scale:g}x]"


#: The instance ``agent.tools`` names: ``paravt.agent.examples:ZOOM``.
ZOOM = ZoomFrame()


def zoom_cost(traj: Trajectory, sample: Sample) -> float:
    """A reward term (``reward.extra_terms``): minus the number of executed (status ``ok``)
    ``zoom_frame`` calls of the main trajectory, counted from its parsed calls, never from
    text the model could write to claim them. Logged as ``reward/zoom_cost``."""
    return -float(
        sum(c.name == ZOOM_NAME and c.status == "ok" for t in traj.turns for c in t.calls)
    )
