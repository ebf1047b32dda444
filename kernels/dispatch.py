"""The one dispatch point of paravt_kernels: ``PARAVT_IMPL=auto|torch|triton``.

* ``auto`` (default): the Triton kernels for CUDA tensors when Triton imports, else the torch
  path (``reference.py``).
* ``torch``: always the torch path.
* ``triton``: always the Triton kernels; on CPU tensors this needs the Triton interpreter
  (``TRITON_INTERPRET=1``). A choice that cannot run raises; it never falls back silently.

The variable is read at every call (cheap), so tests and users can switch per call.
"""

from __future__ import annotations

import functools
import os

import torch

IMPLS = ("auto", "torch", "triton")


@functools.cache
def triton_available() -> bool:
    """True when ``import triton`` works (the wheel is optional)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1`` now)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def resolve_impl(device: torch.device, op: str) -> str:
    """``"torch"`` or ``"triton"`` for op ``op`` on ``device``, honouring ``PARAVT_IMPL``."""
    choice = os.environ.get("PARAVT_IMPL", "auto").strip().lower() or "auto"
    if choice not in IMPLS:
        raise ValueError(
            f"PARAVT_IMPL='{choice}' is not one of {'|'.join(IMPLS)}; unset it or pick one "
            "(auto: Triton on CUDA, torch on CPU)"
        )
    if choice == "torch":
        return "torch"
    if choice == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if not triton_available():
        raise RuntimeError(
            f"PARAVT_IMPL=triton was requested for paravt::{op} but `import triton` fails; "
            "install triton (pip install triton) or set PARAVT_IMPL=torch"
        )
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu" and interpreting():
        return "triton"
    raise RuntimeError(
        f"PARAVT_IMPL=triton was requested for paravt::{op} on {device.type} tensors, which "
        "Triton cannot run; move the tensors to CUDA, set TRITON_INTERPRET=1 to run the "
        "kernels in the (slow) CPU interpreter, or set PARAVT_IMPL=torch|auto"
    )
