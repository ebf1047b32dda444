"""The one dispatch point of every paravt fast op: which implementation runs a call.

Each op has a pure-torch path (the reference, the test oracle) and one fast path; the rule is
the same for all of them: ``auto`` runs the fast path where it runs natively on the tensors'
device and the torch path elsewhere; an explicit choice that cannot run raises, it never
falls back silently (``auto`` on an unbuilt extension falls back, loudly: see
``paravt.vision.pack.native_available``). Every environment variable of the choice is read
here, at every call (cheap), so tests and users can switch per call.

* ``paravt_kernels`` ops (``resolve_impl``), the fast path is Triton:
  ``PARAVT_IMPL=auto|torch|triton``; ``auto`` (default) is Triton for CUDA tensors when
  Triton imports, else torch; ``triton`` on CPU tensors needs the Triton interpreter
  (``TRITON_INTERPRET=1``).
* ``paravt._C`` ops (``resolve_native``: ``paravt.vision.pack``), the fast path is the C++/CUDA
  extension: the caller's ``impl=auto|native|torch``; ``PARAVT_SKIP_EXT=1``
  (``ext_skipped``) makes the extension count as not built (also read by ``setup.py``, which
  then skips the build).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

IMPLS = ("auto", "torch", "triton")
NATIVE_IMPLS = ("auto", "native", "torch")


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


def ext_skipped() -> bool:
    """True when ``PARAVT_SKIP_EXT=1``: the native extension ``paravt._C`` counts as not built."""
    return os.environ.get("PARAVT_SKIP_EXT", "0") == "1"


def resolve_native(
    op: str,
    device: torch.device,
    impl: str,
    *,
    built: Callable[[], bool],
    has_kernels: Callable[[str], bool],
    why_not_built: Callable[[], str],
) -> bool:
    """True to run ``op`` on the native extension, False for its torch path.

    ``impl``: ``"torch"`` (never native), ``"auto"`` (native when ``built()`` and the build has
    kernels for ``device``), ``"native"`` (the same, else raise). The callables are asked
    only when needed, so ``impl="torch"`` never loads the extension. ``has_kernels(type)``:
    the build has kernels for that device type; ``why_not_built()``: the reason the
    extension did not load ("" if it did)."""
    if impl == "torch":
        return False
    if impl not in ("auto", "native"):
        raise ValueError(f"{op}: impl={impl!r}; expected 'auto', 'native' or 'torch'")
    ok = built() and (device.type == "cpu" or (device.type == "cuda" and has_kernels(device.type)))
    if impl == "native" and not ok:
        raise RuntimeError(
            f"{op}: impl='native' requested for {device.type} crops but paravt._C "
            f"{'has no ' + device.type + ' kernels' if built() else 'is not built'} "
            f"({why_not_built() or 'rebuild on a machine whose torch has CUDA'}); "
            "use impl='auto' to fall back to the torch path"
        )
    return ok
