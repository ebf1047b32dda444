"""Fixtures shared across the suite. Keep this file small.

- ``synth_dir``: a small synthetic long-video task (3 videos of 60 s, H.264) generated once.
- ``assets``: ``{"data", "model"}`` — a 2-video synthetic task (40-50 s) and the tiny
  Qwen3-VL checkpoint (seed 0), built once for the training / SFT tests (read-only for them:
  runs write to their own ``train.out_dir``).
- ``make_clip``: ``make_clip(gop=12, codec="h264", fps=4.0, duration=10.0, size=(128, 160))``
  writes (once per parameter set) a real clip whose frames carry their index (read it back
  with ``paravt.data.synth.read_frame_index``) and returns its path as ``str``.
- a ``torch.distributed`` process group a test file leaves up is taken down after it, with a
  warning (autouse): a group left by one file changed what a later file in the same process
  did (``make test`` runs the files in two processes, in an order that varies).
- ``impl`` (per test, parametrised ``indirect=True`` with ``"torch"`` / ``"triton"`` / …):
  sets ``PARAVT_IMPL`` for the kernel dispatch, and ``TRITON_INTERPRET=1`` for ``"triton"``
  (the tests' tensors live on the CPU); returns the name.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import paravt  # noqa: F401  (first: makes a CUDA torchvision importable before transformers)


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from paravt.data.synth import generate

    return generate(tmp_path_factory.mktemp("synth"), 3, seed=0, min_duration=60, max_duration=60)


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from assets_task import ASSETS_TASK

    from paravt.data.synth import generate
    from paravt.models import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("assets")
    data = generate(
        root / "synth",
        2,
        seed=0,
        task=ASSETS_TASK["data.synth_task"],
        min_duration=ASSETS_TASK["data.synth_min_duration"],
        max_duration=ASSETS_TASK["data.synth_max_duration"],
    )
    return {"data": str(data), "model": str(build_tiny_checkpoint(root / "tiny", seed=0))}


@pytest.fixture(scope="session")
def tiny32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-VL's head-32 variant (vLLM's CPU attention needs head sizes >= 32)."""
    from paravt.models import build_tiny_checkpoint
    from paravt.models.tiny import TINY_VLLM_HEAD_DIM

    path = tmp_path_factory.mktemp("tiny32") / "model"
    return build_tiny_checkpoint(path, head_dim=TINY_VLLM_HEAD_DIM)


@pytest.fixture(scope="session")
def make_clip(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    from paravt.data.synth import ENCODERS, write_index_clip

    root = tmp_path_factory.mktemp("clips")
    made: dict[tuple, str] = {}

    def _make(
        gop: int = 12,
        codec: str = "h264",
        fps: float = 4.0,
        duration: float = 10.0,
        size: tuple[int, int] = (128, 160),
    ) -> str:
        key = (gop, codec, float(fps), float(duration), tuple(size))
        if key not in made:
            name = f"clip_g{gop}_f{fps:g}_d{duration:g}_{size[0]}x{size[1]}{ENCODERS[codec][1]}"
            write_index_clip(
                root / name, duration=duration, fps=fps, gop=gop, codec=codec, size=size
            )
            made[key] = str(root / name)
        return made[key]

    return _make


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say it at the end, loudly, when the vLLM engine tests could not run."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        terminalreporter.write_sep(
            "!",
            "vLLM NOT INSTALLED: the vLLM tests (tests/test_*vllm*.py) were SKIPPED "
            "(make install-vllm)",
            red=True,
            bold=True,
        )


@pytest.fixture
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("PARAVT_IMPL", request.param)
    if request.param == "triton":  # the tests' tensors live on the CPU: interpret
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return request.param


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_left(request: pytest.FixtureRequest):
    """Take down a default process group a test file left up, with a warning naming the file,
    so that the next file in this process starts clean: a group of one left by an unclosed
    in-process vLLM engine made a later single-process FSDP2 test join it instead of starting
    (and then taking down) its own. Runs after the file's own fixtures are torn down."""
    yield
    import warnings

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        warnings.warn(
            f"{request.node.nodeid} left a torch.distributed process group up", stacklevel=1
        )
