"""Environment fixes applied once, at ``import paravt``, before transformers is imported.

CUDA torchvision on CPU torch. PyPI's torchvision wheels are CUDA builds; on a CPU torch (the
pinned CPU install of ``make install``) their ``_C`` extension cannot load, and
``import torchvision`` then fails in its ``register_fake("torchvision::nms")`` with
"operator torchvision::nms does not exist". transformers imports torchvision whenever it is
installed (fast image processors, the Qwen3-VL video processor, even model loading), so one such
wheel breaks every model load. The fix defines the schemas of the two ops torchvision's Python
side registers fake kernels for; nothing here calls them (paravt uses torchvision only through
transformers' processors: resize/normalise, pure torch). It is applied only when the installed
torchvision is a CUDA build (``+cuXXX`` in its version file) and torch has no CUDA; a CPU or
matching CUDA torchvision is left untouched.
"""

from __future__ import annotations

import importlib.util
import os

_TV_LIBRARY = None  # keeps the op definitions alive for the life of the process


def _torchvision_is_cuda_build() -> bool:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return False
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as f:
            text = f.read()
    except OSError:
        return False
    return "+cu" in text and "+cpu" not in text


def fix_cuda_torchvision_on_cpu_torch() -> bool:
    """Make a CUDA torchvision importable on CPU torch; True when the fix was applied."""
    global _TV_LIBRARY
    if _TV_LIBRARY is not None:
        return True
    if not _torchvision_is_cuda_build():
        return False
    import torch

    if torch.version.cuda is not None:
        return False
    try:
        lib = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except RuntimeError:
        # The namespace or the ops exist already (another library applied the same fix, or
        # torchvision registered them itself): nothing left to do, and import must not fail.
        return False
    _TV_LIBRARY = lib
    return True
