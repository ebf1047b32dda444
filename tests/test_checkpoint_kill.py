"""A process SIGKILLed while saving a checkpoint never leaves a torn one behind.

A forked child saves checkpoint 1, then saves checkpoint 2 (``keep_last=1``) with one file
operation replaced by "write part of it, then ``kill -9`` myself". Whatever the point, the
parent then finds: ``latest_checkpoint`` a complete checkpoint (1 or 2, as the point implies),
every ``step_*`` directory complete and loadable, and the next save clearing the debris.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from paravt import checkpoint as C


def _save(run: Path, step: int) -> None:
    lin = torch.nn.Linear(3, 2)
    with torch.no_grad():
        lin.weight.fill_(step)
        lin.bias.fill_(step)
    C.save_checkpoint(
        run, step, model=lin, model_state=lin.state_dict(), trainer_state={"tag": step},
        keep_last=1,
    )  # fmt: skip


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """In the child: make the file operation at ``point`` die half-way."""
    import safetensors.torch

    real_replace = os.replace

    if point == "weights":  # half of model.safetensors written

        def torn_weights(tensors, filename, *a, **k):
            Path(filename).write_bytes(b"\0" * 10)
            _die()

        monkeypatch.setattr(safetensors.torch, "save_file", torn_weights)
    elif point == "state":  # half of trainer_state.pt written

        def torn_state(obj, f, *a, **k):
            f.write(b"PK\x03\x04torn")
            f.flush()
            _die()

        monkeypatch.setattr(torch, "save", torn_state)
    elif point in ("rename", "latest"):  # just before the directory / pointer rename

        def replace(src, dst):
            if Path(dst).name == ("step_000002" if point == "rename" else C.LATEST):
                _die()
            real_replace(src, dst)

        monkeypatch.setattr(os, "replace", replace)
    elif point in ("prune", "resave"):  # a directory delete cut short: one file removed

        def rmtree(path, *a, **k):
            files = sorted(p for p in Path(path).iterdir() if p.name != C.STATE_FILE)
            files[0].unlink()
            _die()

        monkeypatch.setattr(shutil, "rmtree", rmtree)
    else:
        raise ValueError(point)


def _kill_while_saving(run: Path, point: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if point == "resave":  # step 2 exists but `latest` still names 1 (killed before it moved)
        _save(run, 2)
        (run / C.CKPT_DIR / C.LATEST).write_text("step_000001")
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        try:
            _arm(point, monkeypatch)
            _save(run, 2)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, point


def _check_complete(ckpt: Path) -> int:
    tag = C.load_trainer_state(ckpt)["tag"]
    weights = C.load_model_state(ckpt)
    assert ckpt.name == C.step_dirname(tag)
    assert all(bool((w == tag).all()) for w in weights.values()), ckpt
    return tag


@pytest.mark.parametrize(
    ("point", "expect"),
    [("weights", 1), ("state", 1), ("rename", 1), ("latest", 1), ("prune", 2), ("resave", 2)],
)
def test_kill_during_checkpoint_save_leaves_a_complete_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str, expect: int
) -> None:
    run = tmp_path / "run"
    _save(run, 1)
    _kill_while_saving(run, point, monkeypatch)

    latest = C.latest_checkpoint(run)
    assert latest is not None and _check_complete(latest) == expect
    for ckpt in C.list_checkpoints(run):  # no torn step_* directory is ever listed
        _check_complete(ckpt)
    if point == "latest":  # step 2 was complete, only the pointer missed it
        assert [c.name for c in C.list_checkpoints(run)] == ["step_000001", "step_000002"]

    _save(run, 3)  # the next save clears the half-written / half-deleted debris
    root = run / C.CKPT_DIR
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000003"]
    assert _check_complete(C.latest_checkpoint(run)) == 3
