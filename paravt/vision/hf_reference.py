"""transformers' own Qwen3-VL vision code paths, called the way the model calls them: the
oracles of paravt's parity tests and the baselines of its benchmarks (one copy for both).

* :func:`hf_video_pixels`: ``Qwen3VLVideoProcessor._preprocess`` (rescale + normalise +
  patchify; no resize, no frame sampling) on uint8 ``(T, H, W, 3)`` crops.
* :func:`hf_vision_metadata`: what ``Qwen3VLVisionModel.forward`` computes from ``grid_thw``
  (``transformers.vision_utils``: bilinear position-embedding taps, rotary ids, cu_seqlens).
* :func:`tiny_vision_tower`: a small randomly initialised ``Qwen3VLVisionModel``.

The processor's normalise is torchvision's ``normalize``. ``make install`` installs
torchvision (``paravt._compat`` makes PyPI's CUDA build import on CPU torch); where it is
absent, :func:`video_processor` substitutes torchvision 0.28's exact maths (sub, then div).
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import torch


def _tv_normalize(image, mean, std, inplace=False):
    """torchvision 0.28 ``normalize_image`` (transforms/v2/functional/_misc.py), verbatim maths."""
    mean = torch.as_tensor(mean, dtype=image.dtype, device=image.device)
    std = torch.as_tensor(std, dtype=image.dtype, device=image.device)
    if mean.ndim == 1:
        mean = mean.view(-1, 1, 1)
    if std.ndim == 1:
        std = std.view(-1, 1, 1)
    image = image.sub_(mean) if inplace else image.sub(mean)
    return image.div_(std)


def video_processor(patch_size: int = 16, temporal_patch_size: int = 2, merge_size: int = 2):
    """A ``Qwen3VLVideoProcessor`` with this geometry (torchvision's normalize, or its maths)."""
    import transformers.image_processing_backends as hf_backends
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    if getattr(hf_backends, "tvF", None) is None:
        hf_backends.tvF = types.SimpleNamespace(normalize=_tv_normalize)
    return Qwen3VLVideoProcessor(
        patch_size=patch_size, temporal_patch_size=temporal_patch_size, merge_size=merge_size
    )


def hf_video_pixels(
    proc,
    crops: Sequence[torch.Tensor],
    mean: Sequence[float] = (0.5, 0.5, 0.5),
    std: Sequence[float] = (0.5, 0.5, 0.5),
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pixel_values_videos, video_grid_thw)`` of the HF processor for uint8 crops."""
    out = proc._preprocess(
        [c.permute(0, 3, 1, 2) for c in crops],
        do_resize=False,
        size=None,
        resample=None,
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=tuple(mean),
        image_std=tuple(std),
        patch_size=proc.patch_size,
        temporal_patch_size=proc.temporal_patch_size,
        merge_size=proc.merge_size,
        cap_pixels_per_frame=False,
    )
    return out["pixel_values_videos"], out["video_grid_thw"]


def hf_vision_metadata(
    grid_thw: torch.Tensor, *, merge_size: int, num_position_embeddings: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(cu_seqlens, position_ids, interp_indices, interp_weights, max_seqlen)`` exactly as
    ``Qwen3VLVisionModel.forward`` builds them (same helpers, same arguments)."""
    from transformers import vision_utils as hf_vu

    idx, wt = hf_vu.get_vision_interpolation_indices_and_weights(
        grid_thw,
        num_grid_per_side=int(num_position_embeddings**0.5),
        mode="bilinear",
        align_corners=True,
        spatial_merge_size=merge_size,
    )
    pos = hf_vu.get_vision_position_ids(grid_thw, merge_size)
    cu = hf_vu.get_vision_cu_seqlens(grid_thw)
    return cu, pos, idx, wt, int((cu[1:] - cu[:-1]).max())


def tiny_vision_tower(
    *,
    depth: int = 2,
    hidden_size: int = 32,
    num_heads: int = 2,
    out_hidden_size: int = 32,
    num_position_embeddings: int = 2304,
    deepstack_visual_indexes: Sequence[int] = (0,),
    device: str = "cpu",
):
    """A randomly initialised ``Qwen3VLVisionModel`` (patch 16, merge 2, temporal patch 2),
    SDPA attention, eval mode."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    cfg = Qwen3VLVisionConfig(
        depth=depth,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_heads=num_heads,
        out_hidden_size=out_hidden_size,
        num_position_embeddings=num_position_embeddings,
        deepstack_visual_indexes=list(deepstack_visual_indexes),
    )
    cfg._attn_implementation = "sdpa"
    return Qwen3VLVisionModel(cfg).eval().to(device)
