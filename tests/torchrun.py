"""Launch a torchrun job on this machine's CPUs (gloo) for the distributed tests. Not a test
module: tests import it by name, as pytest puts ``tests/`` on ``sys.path``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def torchrun(
    nproc: int, *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --nproc-per-node NPROC --standalone ARGS...`` with one
    thread per rank and a fixed hash seed; output captured. ``args``: a script path or
    ``-m module``, then its arguments."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", **(env or {})}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--standalone", *args,
    ]  # fmt: skip
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)


def run_worker(
    tmp_path: Path, source: str, nproc: int, *args: str
) -> subprocess.CompletedProcess[str]:
    """Write ``source`` to ``tmp_path/worker.py`` and run it on ``nproc`` ranks; it must exit 0."""
    script = tmp_path / "worker.py"
    script.write_text(source)
    proc = torchrun(nproc, str(script), *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
