"""The Qwen-VL ``smart_resize`` rule, shared by the video sampler and the vision preprocessor."""

from __future__ import annotations

import math

# Qwen-VL's image processors refuse frames whose longer side is more than 200 times the
# shorter one (transformers' qwen2_vl ``smart_resize``); so do we, with the same message.
MAX_ASPECT = 200


def smart_resize(
    height: int,
    width: int,
    factor: int = 32,
    min_pixels: int = 32 * 32,
    max_pixels: int = 64 * 64,
) -> tuple[int, int]:
    """Size ``(h, w)`` closest to ``(height, width)`` with both sides multiples of ``factor``
    (patch_size × merge_size) and ``min_pixels <= h*w <= max_pixels``, aspect ratio kept.

    Same rule as transformers' ``qwen2_vl`` image processor (round to the factor, then scale
    down by ``sqrt(h*w/max_pixels)`` with floor, or up by ``sqrt(min_pixels/(h*w))`` with ceil).
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"smart_resize: frame size {height}x{width} must be positive")
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(
            f"smart_resize: aspect ratio of {height}x{width} exceeds {MAX_ASPECT}; crop or pad "
            "the frame"
        )
    if min_pixels > max_pixels:
        raise ValueError(f"smart_resize: min_pixels {min_pixels} > max_pixels {max_pixels}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
