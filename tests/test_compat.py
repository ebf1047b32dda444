"""paravt._compat: a CUDA torchvision (PyPI's build) imports on CPU torch after ``import paravt``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from paravt import _compat

CUDA_TV_ON_CPU = _compat._torchvision_is_cuda_build() and torch.version.cuda is None
needs_mismatch = pytest.mark.skipif(
    not CUDA_TV_ON_CPU, reason="needs a CUDA torchvision build on CPU torch (the case fixed)"
)


def _py(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@needs_mismatch
def test_cuda_torchvision_fails_without_the_fix():
    r = _py("import torchvision")
    assert r.returncode != 0 and "torchvision::nms does not exist" in r.stderr


@needs_mismatch
def test_import_paravt_makes_hf_video_processor_and_model_loading_work():
    r = _py(
        "import paravt, torch, torchvision\n"
        "from transformers import Qwen3VLVideoProcessor, Qwen3VLForConditionalGeneration\n"
        "import torchvision.transforms.v2.functional as F\n"
        "x = F.normalize(torch.ones(3, 4, 4), [0.5] * 3, [0.5] * 3)\n"
        "assert torch.equal(x, torch.ones(3, 4, 4))\n"
        "assert paravt._compat.fix_cuda_torchvision_on_cpu_torch() is True  # idempotent\n"
        "print('ok')"
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "ok"


@pytest.mark.parametrize(("version", "cuda_build"), [("0.28.0+cu130", True), ("0.28.0+cpu", False)])
def test_only_a_cuda_torchvision_build_is_patched(tmp_path, version, cuda_build):
    """The fix keys on the installed torchvision's version file; a CPU build is left alone
    (defining its ops first would break its own registration)."""
    pkg = tmp_path / "torchvision"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "version.py").write_text(f"__version__ = '{version}'\n")
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, sys.argv[1])\n"
            "from paravt import _compat\n"
            "print(_compat._torchvision_is_cuda_build(), "
            "_compat.fix_cuda_torchvision_on_cpu_torch())",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    detected, applied = r.stdout.split()
    assert detected == str(cuda_build)
    # import paravt already applied it once when needed; a second call reports it applied.
    assert applied == str(cuda_build and torch.version.cuda is None)
