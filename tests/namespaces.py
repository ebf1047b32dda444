"""A process of its own in a user and mount namespace of its own (``unshare -rm``), where a test
mounts what the machine cannot give it otherwise: a tiny tmpfs that really fills up, a read-only
bind mount; gone with the process. Not a test module: tests import it by name, as pytest puts
``tests/`` on ``sys.path``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def namespaced() -> str:
    """Why a user + mount namespace cannot be made here ("" when it can)."""
    if not shutil.which("unshare"):
        return "no unshare(1) on this machine"
    r = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=16k tmpfs /tmp"],
        capture_output=True,
        text=True,
    )
    return "" if r.returncode == 0 else f"unshare -rm cannot mount here: {r.stderr.strip()}"


def run_in(setup: str, code: str) -> subprocess.CompletedProcess:
    """``code`` (Python) in a process of its own; after ``setup`` (sh: mounts) in a namespace of
    its own when given (``unshare -rm``)."""
    code = textwrap.dedent(code)
    argv = [sys.executable, "-c", code]
    if setup:
        argv = ["unshare", "-rm", "sh", "-c", f"{setup} && exec {sys.executable} -c {_sq(code)}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


def _sq(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"
