"""What a plug-in tool needs, from one public place: ``from paravt.agent.toolkit import ...``.

A tool (``agent.tools=[..., my_module:MY_TOOL]``) is a view of the sample's own video
(``paravt.agent.tools``; docs/tools.md says what a tool can and cannot be). Writing one takes
the protocol, the records it reads and fills, and a few helpers that the built-in
``crop_video`` and the shipped examples (``paravt.agent.examples``) use. They live in the
modules that own them; this module only names them, so a tool written against it keeps
working when those modules move code around:

- the protocol and its failure record: :class:`Tool`, :class:`ToolFailure`;
- the records: :class:`ToolCall` (what :meth:`Tool.check` fills), :class:`FrameRequest` (what
  :meth:`Tool.plan` returns), :class:`FrameBatch` (what :meth:`Tool.view` gets),
  :class:`VideoMeta`, :class:`VideoConfig`, and for reward terms :class:`Trajectory` and
  :class:`Sample`;
- argument checks: :func:`number` (a finite JSON number or None), :func:`numbers` (a call's
  named numbers, or the call's ``bad_arguments`` error), :func:`quote` (a model-written value
  for an error message);
- pixels: :func:`smart_resize` (the Qwen-VL size rule), :func:`resize_frames` (uint8
  ``(T, H, W, 3)`` resize), and :func:`to_crop_budget`, the two together: a view at the crop
  pixel budget, as :meth:`Tool.view` must return it.
"""

from __future__ import annotations

import torch

from paravt.agent.tools import Tool, ToolFailure, number, numbers, quote
from paravt.config import VideoConfig
from paravt.types import FrameBatch, FrameRequest, Sample, ToolCall, Trajectory, VideoMeta
from paravt.video.sampling import resize_frames
from paravt.vision.resize import smart_resize

__all__ = [
    "FrameBatch",
    "FrameRequest",
    "Sample",
    "Tool",
    "ToolCall",
    "ToolFailure",
    "Trajectory",
    "VideoConfig",
    "VideoMeta",
    "number",
    "numbers",
    "quote",
    "resize_frames",
    "smart_resize",
    "to_crop_budget",
]


def to_crop_budget(frames: torch.Tensor, vcfg: VideoConfig, factor: int) -> torch.Tensor:
    """uint8 ``(T, H, W, 3)`` frames resized to the crop pixel budget (``video.crop_min_pixels``
    to ``video.crop_max_pixels``, sides multiples of ``factor``, aspect kept): what
    :meth:`Tool.view` returns. A small region comes back upscaled, a large frame downscaled."""
    if frames.ndim != 4 or frames.shape[1] < 1 or frames.shape[2] < 1:
        raise ValueError(
            f"to_crop_budget: frames of shape {tuple(frames.shape)} are not (T, H, W, 3) with "
            "H, W >= 1; cut a non-empty region"
        )
    size = smart_resize(
        int(frames.shape[1]),
        int(frames.shape[2]),
        factor,
        vcfg.crop_min_pixels,
        vcfg.crop_max_pixels,
    )
    return resize_frames(frames, size)
