"""Pure-torch Qwen-VL patchify: uint8 frames -> normalised patches in spatial-merge order.

This is the reference path (and the CPU fallback) for ``paravt._C.pack_vision``; it matches
transformers' Qwen3-VL video processor ``patchify`` after ``rescale_and_normalize``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VisionSpec:
    """Patch geometry and normalisation of a Qwen-VL vision tower."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    model_type: str = "qwen3_vl"  # 'qwen3_vl' | 'qwen2_5_vl'

    @property
    def factor(self) -> int:
        """Side lengths must be multiples of this (patch_size * merge_size)."""
        return self.patch_size * self.merge_size


def patchify_frames(frames: torch.Tensor, spec: VisionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise and patchify one clip.

    Args:
        frames: ``(T, H, W, 3)`` uint8 RGB, H and W multiples of ``spec.factor``. An odd ``T``
            (not a multiple of the temporal patch) is padded by repeating the last frame.
    Returns:
        ``pixel_values`` ``(t*h*w, 3*tp*p*p)`` float32 and ``grid_thw`` ``(3,)`` int64 where
        ``t = ceil(T/tp)``, ``h = H/p``, ``w = W/p``.
    """
    if frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[-1] != 3:
        raise ValueError(
            f"patchify_frames: expected uint8 frames of shape (T, H, W, 3), got "
            f"{tuple(frames.shape)} {frames.dtype}"
        )
    T, H, W, C = frames.shape
    p, tp, m = spec.patch_size, spec.temporal_patch_size, spec.merge_size
    if T == 0:
        raise ValueError("patchify_frames: clip has no frames")
    if H % spec.factor or W % spec.factor:
        raise ValueError(
            f"patchify_frames: frame size {H}x{W} is not a multiple of patch*merge={spec.factor}; "
            "resize with paravt.vision.resize.smart_resize first"
        )
    x = frames.permute(0, 3, 1, 2).to(torch.float32)  # (T, C, H, W)
    # HF's fused rescale+normalise, op for op (image_processing_backends: the rescale factor is
    # folded into mean and std, then torchvision's normalize: sub, div), so the pixels are
    # bit-identical to the processor's, and to paravt._C's lookup table.
    mean = (torch.tensor(spec.mean) * (1.0 / (1.0 / 255.0))).view(1, C, 1, 1)
    std = (torch.tensor(spec.std) * (1.0 / (1.0 / 255.0))).view(1, C, 1, 1)
    x = (x - mean) / std
    if pad := -T % tp:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)], dim=0)
    gt, gh, gw = x.shape[0] // tp, H // p, W // p
    x = x.view(gt, tp, C, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    pixel_values = x.reshape(gt * gh * gw, C * tp * p * p)
    return pixel_values, torch.tensor([gt, gh, gw], dtype=torch.int64)
