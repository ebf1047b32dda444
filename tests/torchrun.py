"""Launch a torchrun job on this machine's CPUs (gloo) for the distributed tests. Not a test
module: tests import it by name, as pytest puts ``tests/`` on ``sys.path``."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

#: The checkout these tests belong to: first on every rank's import path, so a script rank
#: (``run_worker``: ``python script.py`` puts the script's folder first, not the checkout)
#: imports this checkout's paravt, not whichever one the environment installed (a worktree,
#: a second clone sharing a virtualenv).
ROOT = Path(__file__).resolve().parents[1]


def rank_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every launched rank: one thread, a fixed hash seed, ``ROOT`` first
    on ``PYTHONPATH``; ``env`` on top."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    base = {"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "PYTHONPATH": path}
    return {**os.environ, **base, **(env or {})}


def torchrun(
    nproc: int, *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --nproc-per-node NPROC --standalone ARGS...`` with one
    thread per rank and a fixed hash seed; output captured. ``args``: a script path or
    ``-m module``, then its arguments."""
    full_env = rank_env(env)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--standalone", *args,
    ]  # fmt: skip
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)


def launch_nodes(
    nnodes: int,
    *args: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    nprocs: Sequence[int] | None = None,
) -> list[subprocess.Popen]:
    """Start ``nnodes`` torchrun agents on this host as the nodes of one job: ``--nnodes N
    --nproc-per-node nprocs[i]`` (1 each by default) with the c10d rendezvous on a free local
    port, as on N machines. Each agent's output (stdout and stderr merged) is its Popen's
    ``stdout``.

    Torch's dynamic rendezvous orders the nodes by (host, agent pid): the agent started first
    is node 0 (global rank 0; it also hosts the rendezvous store). A node is an agent and its
    worker process (torchrun starts each in its own session): ``kill_node`` kills both."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    full_env = rank_env(env)
    procs = []
    for node in range(nnodes):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
            "--nproc-per-node", str(nprocs[node] if nprocs else 1), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"paravt-test-{port}", *args,
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(
                cmd,
                env=full_env,
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
        )
        time.sleep(0.3)  # the first agent's pid is the lower one, and its store is up first
    return procs


def torchrun_nodes(nnodes: int, *args: str, timeout: float = 300) -> list[tuple[int, str]]:
    """``launch_nodes`` and wait: each node's (exit code, output)."""
    with running_nodes(nnodes, *args) as procs:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
        return [(p.returncode, text) for p, text in zip(procs, outs)]


def node_children(agent: int) -> list[int]:
    """The pids whose parent is the torchrun agent ``agent`` (its worker processes)."""
    kids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == agent:
            kids.append(int(d.name))
    return kids


def kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL a node: the torchrun agent and its worker processes at once (a lost machine)."""
    kids = node_children(agent.pid)
    for pid in [agent.pid, *kids]:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


@contextlib.contextmanager
def running_nodes(
    nnodes: int, *args: str, cwd: Path | None = None, nprocs: Sequence[int] | None = None
) -> Iterator[list[subprocess.Popen]]:
    """``launch_nodes`` for a ``with`` block: every node is killed when it ends, however."""
    procs = launch_nodes(nnodes, *args, cwd=cwd, nprocs=nprocs)
    try:
        yield procs
    finally:
        for p in procs:
            kill_node(p)


def lose_node(survivor: subprocess.Popen, lost: subprocess.Popen) -> tuple[str, float]:
    """``kill_node(lost)``, then wait (90 s at most) for ``survivor`` to exit: its output and
    the seconds it took."""
    t0 = time.monotonic()
    kill_node(lost)
    rest, _ = survivor.communicate(timeout=90)
    return rest, time.monotonic() - t0


def run_worker(
    tmp_path: Path, source: str, nproc: int, *args: str
) -> subprocess.CompletedProcess[str]:
    """Write ``source`` to ``tmp_path/worker.py`` and run it on ``nproc`` ranks; it must exit 0."""
    script = tmp_path / "worker.py"
    script.write_text(source)
    proc = torchrun(nproc, str(script), *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
