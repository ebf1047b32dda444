"""Small Triton helpers shared by the kernel modules (imported only when Triton is used).

``lazy_jit`` defers ``triton.jit`` to the first launch and caches one compiled object per
interpreter mode. ``triton.jit`` decides at decoration time whether a kernel is interpreted
(``TRITON_INTERPRET``), so decorating at import would freeze whatever the environment was
when some other module first imported ``paravt_kernels``; deferring makes the choice follow
the environment of the call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import triton

from .dispatch import interpreting

# The launch log of ``record_launches`` (None: not recording; checked once per launch).
_LAUNCH_LOG: list[tuple[str, tuple[tuple[int, int], ...]]] | None = None


@contextlib.contextmanager
def record_launches():
    """Record every ``lazy_jit`` kernel launch made inside the block (compiled or interpreted):
    yields a list of ``(kernel name, ((numel, bytes) of each tensor argument))``, filled as launches
    happen. Used by ``profiling.count_launches`` (launch counts and the byte model's check)."""
    global _LAUNCH_LOG
    prev, log = _LAUNCH_LOG, []
    _LAUNCH_LOG = log
    try:
        yield log
    finally:
        _LAUNCH_LOG = prev


def _log_launch(name: str, args: tuple) -> None:
    sizes = tuple(
        (a.numel(), a.numel() * a.element_size()) for a in args if isinstance(a, torch.Tensor)
    )
    _LAUNCH_LOG.append((name, sizes))  # type: ignore[union-attr]


class lazy_jit:  # noqa: N801 - used like a decorator, named like one
    """``@lazy_jit`` on a plain kernel function; launch as ``kernel[grid](...)``."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self._compiled: dict[bool, object] = {}

    def __getitem__(self, grid):
        mode = interpreting()
        k = self._compiled.get(mode)
        if k is None:
            k = triton.jit(self.fn)  # reads TRITON_INTERPRET now
            self._compiled[mode] = k
        launch = k[grid]
        if _LAUNCH_LOG is not None:
            inner, name = launch, self.fn.__name__

            def launch(*args, **kwargs):
                _log_launch(name, args)
                # a profiler range, so that count_launches can tell the interpreter's own
                # torch copies (inside the launch) from the op's torch kernels
                with torch.profiler.record_function(f"triton::{name}"):
                    return inner(*args, **kwargs)

        if not mode:
            return launch

        def run(*args, **kwargs):
            with _interpretable_stdlib():
                return launch(*args, **kwargs)

        return run


def _stdlib_modules():
    import triton.language as tl
    import triton.language.standard as std

    return [m for m in (tl, std, getattr(tl, "math", None)) if m is not None]


@contextlib.contextmanager
def _interpretable_stdlib():
    """Run interpreted kernels even when Triton was imported without ``TRITON_INTERPRET=1``.

    Triton's standard library (``tl.sum``, ``tl.max``, ... and their combine functions) is
    ``@triton.jit``-decorated when ``triton.language`` is first imported; imported in compiled
    mode, the interpreter cannot call them ("Cannot call @triton.jit'd outside of the scope of
    a kernel"). For the duration of one interpreted launch, swap those module attributes for
    interpreted twins and restore them afterwards, so compiled kernels are never affected.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    swapped = []
    for mod in _stdlib_modules():
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, JITFunction):
                twin = _TWINS.get(id(obj))
                if twin is None:
                    twin = _TWINS[id(obj)] = InterpretedFunction(obj.fn)
                swapped.append((mod, name, obj))
                setattr(mod, name, twin)
    try:
        yield
    finally:
        for mod, name, obj in swapped:
            setattr(mod, name, obj)


_TWINS: dict[int, object] = {}


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (used to size grids); 1 on CPU."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
