"""Helpers of the tests that run ``python -m paravt.train`` as a real process, interrupt it and
``--resume`` it (test_train_kill.py, test_train_preempt.py). Not a test module: tests import it
by name, as pytest puts ``tests/`` on ``sys.path``."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from paravt.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]  # run from the checkout: its paravt is imported
TIMING = ("time/", "tokens_per_s")  # wall-clock metrics legitimately differ


def train_rows(out: Path) -> dict[int, dict[str, Any]]:
    """The ``kind == "train"`` rows of ``out/metrics.jsonl`` by step."""
    return {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"}


def train_steps(out: Path) -> list[int]:
    """The steps of every ``train`` row in file order (a duplicate or torn row shows)."""
    return [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]


def wait_for(
    cond: Callable[[], bool], proc: subprocess.Popen, what: str, timeout: float = 90.0
) -> None:
    """Poll ``cond`` every 10 ms; fail if ``proc`` exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            pytest.fail(f"training exited (rc {proc.returncode}) before {what}:\n{out[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def assert_same_row(step: int, ra: dict[str, Any], rb: dict[str, Any], why: str) -> None:
    """Two runs' metrics rows of ``step`` are equal bitwise, wall-clock keys aside."""
    keys = {k for k in ra if not k.startswith(TIMING)}
    assert keys == {k for k in rb if not k.startswith(TIMING)}
    diff = {k: (ra[k], rb[k]) for k in keys if ra[k] != rb[k]}
    assert not diff, f"step {step} differs after {why}: {diff}"


def assert_same_weights(a: Path, b: Path) -> None:
    """Two checkpoints' model weights are equal bitwise."""
    from paravt.checkpoint import load_model_state

    wa, wb = load_model_state(a), load_model_state(b)
    assert sorted(wa) == sorted(wb)
    diff = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not diff, f"{len(diff)} tensors differ between {a} and {b}, e.g. {diff[:3]}"
