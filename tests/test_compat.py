"""A CUDA torchvision (PyPI's build) imports on CPU torch: in-process after ``import paravt``
(``paravt._compat``), and in every process of the ``make install`` venv through the start-up
hook ``paravt_startup.pth`` (``paravt_startup``)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import paravt_startup

CUDA_TV_ON_CPU = paravt_startup.torchvision_is_cuda_build() and torch.version.cuda is None
needs_mismatch = pytest.mark.skipif(
    not CUDA_TV_ON_CPU, reason="needs a CUDA torchvision build on CPU torch (the case fixed)"
)


def _py(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


# Drops the start-up hook (if paravt_startup.pth installed it): a process as without the fix.
_NO_HOOK = (
    "import sys; sys.meta_path[:] = "
    "[f for f in sys.meta_path if type(f).__module__ != 'paravt_startup']\n"
)


@needs_mismatch
def test_cuda_torchvision_fails_without_the_fix():
    r = _py(_NO_HOOK + "import torchvision")
    assert r.returncode != 0 and "torchvision::nms does not exist" in r.stderr


@needs_mismatch
def test_import_paravt_makes_hf_video_processor_and_model_loading_work():
    r = _py(
        _NO_HOOK + "import paravt, torch, torchvision\n"
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
            "import paravt_startup\n"
            "from paravt import _compat\n"
            "print(paravt_startup.torchvision_is_cuda_build(), "
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


@pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is None,
    reason="torchvision is not installed (nothing for transformers to fail on)",
)
def test_fresh_interpreter_without_paravt_loads_a_checkpoint(tmp_path):
    """A user's own script (or vLLM's model-inspection subprocess) never imports paravt:
    transformers must still load a checkpoint of the default run, and torchvision import."""
    from paravt.models import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / "ckpt")
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys\n"
            "from transformers import AutoModelForImageTextToText\n"
            "model = AutoModelForImageTextToText.from_pretrained(sys.argv[1])\n"
            "import torchvision\n"
            "assert 'paravt' not in sys.modules, 'the child must not import paravt'\n"
            "print(type(model).__name__)",
            str(ckpt),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # not the checkout: nothing importable from the working directory
    )
    assert r.returncode == 0, (
        "a process that never imports paravt cannot load the checkpoint (is paravt_startup.pth "
        f"installed? `make install` / `python -m paravt_startup` writes it):\n{r.stderr[-3000:]}"
    )
    assert r.stdout.strip().splitlines()[-1] == "Qwen3VLForConditionalGeneration"


def _fake_torchvision(root: Path, version: str) -> None:
    pkg = root / "torchvision"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import sys\nLOADER = __loader__\n")
    (pkg / "version.py").write_text(f"__version__ = '{version}'\n")


@pytest.mark.parametrize(("version", "applied"), [("0.28.0+cu130", True), ("0.28.0+cpu", False)])
def test_startup_hook_runs_the_fix_on_first_torchvision_import_only(tmp_path, version, applied):
    """The hook imports nothing at start-up, nothing on a mere ``find_spec`` probe (as
    transformers' availability checks do), and on import runs the fix before torchvision's code,
    then leaves: torchvision keeps its real loader and the finder is gone from sys.meta_path."""
    _fake_torchvision(tmp_path, version)
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            _NO_HOOK + "sys.path.insert(0, sys.argv[1])\n"
            "import importlib.util, paravt_startup\n"
            "paravt_startup.install(); paravt_startup.install()  # idempotent\n"
            "hooks = [f for f in sys.meta_path if type(f).__module__ == 'paravt_startup']\n"
            "assert len(hooks) == 1, hooks\n"
            "assert importlib.util.find_spec('torchvision').origin.startswith(sys.argv[1])\n"
            "assert 'torch' not in sys.modules, 'find_spec must not run the fix'\n"
            "import torchvision\n"
            "assert type(torchvision.LOADER).__name__ == 'SourceFileLoader', torchvision.LOADER\n"
            "assert torchvision.__spec__.loader is torchvision.LOADER\n"
            "assert not any(type(f).__module__ == 'paravt_startup' for f in sys.meta_path)\n"
            "print(paravt_startup._TV_LIBRARY is not None, 'torch' in sys.modules, "
            "'paravt' in sys.modules)",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    fixed, torch_imported, paravt_imported = r.stdout.split()
    assert fixed == str(applied and torch.version.cuda is None)
    # A CPU build never needs torch: the hook only reads its version file.
    assert torch_imported == str(version.endswith("+cu130"))
    assert paravt_imported == "False"


def test_interpreter_startup_imports_neither_torch_nor_paravt(tmp_path):
    """With or without paravt_startup.pth, a bare interpreter stays cheap."""
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; print(sorted(m for m in ('torch', 'torchvision', 'paravt', "
            "'transformers') if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"
