"""Environment fixes applied once, at ``import paravt``, before transformers is imported.

CUDA torchvision on CPU torch: the fix lives in the top-level, stdlib-only module
``paravt_startup`` (see its docstring), which ``make install`` also hooks into interpreter
start-up so that processes that never import paravt get it too. Here it runs in-process, for
environments without that hook (e.g. a plain ``pip install -e .``).
"""

from __future__ import annotations

from paravt_startup import define_torchvision_ops


def fix_cuda_torchvision_on_cpu_torch() -> bool:
    """Make a CUDA torchvision importable on CPU torch; True when the fix is (or was) applied."""
    return define_torchvision_ops()
