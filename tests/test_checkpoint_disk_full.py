"""A disk that fills while a checkpoint is written: the previous checkpoint stays the newest
and loads, nothing half-written is ever listed, the error names the path and the space needed
and free, and the run stops non-zero (``train.on_save_error=fail``) or trains on (``continue``).

``OSError(ENOSPC)`` is injected at each write point of ``save_checkpoint`` in turn.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from test_train import small_overrides

from paravt import checkpoint as C


class _Tok:
    """A tokenizer whose ``save_pretrained`` writes JSON, like HF's."""

    def save_pretrained(self, out) -> None:
        with open(Path(out) / "tokenizer_config.json", "w") as f:
            json.dump({"model_max_length": 128}, f)


def _save(run: Path, step: int, src: Path, keep_last: int = 2) -> Path:
    lin = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    lin(torch.ones(1, 3)).sum().backward()
    opt.step()  # momentum buffers: optimizer state to save
    with torch.no_grad():
        lin.weight.fill_(step)
        lin.bias.fill_(step)
    return C.save_checkpoint(
        run, step, model=lin, model_state=lin.state_dict(),
        trainer_state={"tag": step, "optimizer": opt.state_dict()},
        tokenizer=_Tok(), source_dir=src, keep_last=keep_last,
    )  # fmt: skip


def _enospc(path: object = None) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), None if path is None else str(path))


def _arm(point: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the write at ``point`` fail as a full disk does (after writing part of it)."""
    import safetensors.torch

    real_replace, real_fsync, real_open = os.replace, os.fsync, open

    if point == "weights":

        def save_file(tensors, filename, *a, **k):
            Path(filename).write_bytes(b"\0" * 10)
            raise _enospc(filename)

        monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    elif point == "state":

        def save(obj, f, *a, **k):
            f.write(b"PK\x03\x04torn")
            raise _enospc()

        monkeypatch.setattr(torch, "save", save)
    elif point == "copy":  # the source model's tokenizer/processor files

        def copy2(a, b, *x, **k):
            raise _enospc(b)

        monkeypatch.setattr(shutil, "copy2", copy2)
    elif point == "json":  # tokenizer.save_pretrained's JSON write

        def save_pretrained(self, out) -> None:
            with real_open(Path(out) / "tokenizer_config.json", "w") as f:
                f.write('{"model_max')
            raise _enospc(Path(out) / "tokenizer_config.json")

        monkeypatch.setattr(_Tok, "save_pretrained", save_pretrained)
    elif point == "fsync":  # network file systems report ENOSPC at fsync/close

        def fsync(fd):
            if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) == C.STATE_FILE:
                raise _enospc()
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)
    elif point in ("rename", "resave"):

        def replace(src, dst):
            if Path(dst).name == "step_000002" and Path(src).name.startswith(".tmp-step"):
                raise _enospc(dst)
            real_replace(src, dst)

        monkeypatch.setattr(os, "replace", replace)
    elif point == "latest":  # the pointer file

        def open_(file, mode="r", *a, **k):
            if any(c in mode for c in "wax") and Path(file).name.startswith(f".{C.LATEST}"):
                raise _enospc(file)
            return real_open(file, mode, *a, **k)

        monkeypatch.setattr("builtins.open", open_)
    else:
        raise ValueError(point)


def _tag(ckpt: Path) -> int:
    tag = C.load_trainer_state(ckpt)["tag"]
    assert all(bool((w == tag).all()) for w in C.load_model_state(ckpt).values()), ckpt
    return tag


@pytest.mark.parametrize(
    "point", ["weights", "state", "copy", "json", "fsync", "rename", "latest", "resave"]
)
def test_disk_full_at_each_write_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    src = tmp_path / "model"
    src.mkdir()
    (src / "tokenizer.json").write_text("{}")
    run = tmp_path / "run"
    _save(run, 1, src)
    if point == "resave":  # a resumed run saves step 2 again over an existing step 2
        _save(run, 2, src)
        (run / C.CKPT_DIR / C.LATEST).write_text("step_000001")
    before = sorted(p.name for p in (run / C.CKPT_DIR).iterdir())

    with monkeypatch.context() as m:
        _arm(point, m)
        with pytest.raises(C.CheckpointSaveError) as info:
            _save(run, 2, src)

    msg = str(info.value)
    root = run / C.CKPT_DIR
    assert str(root / "step_000002") in msg or str(root / ".tmp-step_000002") in msg, msg
    assert "No space left on device" in msg
    needed = int(re.search(r"needs about [\d.]+ MiB \((\d+) bytes\)", msg).group(1))
    free = int(re.search(r"(\d+) bytes are free", msg).group(1))
    assert needed == info.value.needed >= 2 * 4 * (3 * 2 + 2)  # weights + momentum, fp32
    assert free == info.value.free > 0
    assert "train.on_save_error=continue" in msg and "--resume" in msg
    # Nothing changed on disk: the same entries, the previous newest still the newest.
    assert sorted(p.name for p in root.iterdir()) == before
    assert _tag(C.latest_checkpoint(run)) == 1
    for ckpt in C.list_checkpoints(run):
        _tag(ckpt)  # every listed checkpoint is complete
    assert _tag(_save(run, 3, src)) == 3  # the disk has room again: saving works


def test_a_save_that_cannot_fit_fails_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "model"
    src.mkdir()
    run = tmp_path / "run"
    _save(run, 1, src)
    real = shutil.disk_usage
    monkeypatch.setattr(
        shutil, "disk_usage", lambda p: real(p)._replace(free=100)
    )  # 100 bytes free
    with pytest.raises(C.CheckpointSaveError, match=r"100 bytes are free") as info:
        _save(run, 2, src)
    assert info.value.free == 100 and info.value.needed > 100
    assert sorted(p.name for p in (run / C.CKPT_DIR).iterdir()) == ["latest", "step_000001"]


@pytest.mark.parametrize("policy", ["fail", "continue"])
def test_training_on_a_full_disk_fails_or_continues(
    assets, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, policy: str
) -> None:
    """``python -m paravt.train``: the step-2 save hits a full disk. ``fail``: exit 1 with
    the message, step 1 is the checkpoint ``--resume`` would load. ``continue``: the run
    finishes, step 1 stays the newest checkpoint."""
    from paravt.train import main

    out = tmp_path / "run"
    real_save = torch.save

    def save(obj, f, *a, **k):
        if isinstance(obj, dict) and obj.get("step") == 2:
            raise _enospc()
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save)
    rc = main([*small_overrides(assets, out), f"train.on_save_error={policy}"])
    err = capsys.readouterr().err
    assert "step_000002" in err and "No space left on device" in err and "bytes are free" in err
    assert rc == (1 if policy == "fail" else 0)
    latest = C.latest_checkpoint(out)
    assert latest is not None and latest.name == "step_000001"
    assert C.load_trainer_state(latest)["step"] == 1
    assert [c.name for c in C.list_checkpoints(out)] == ["step_000001"]
    assert not list((out / C.CKPT_DIR).glob(".tmp-*"))


def test_on_save_error_is_validated() -> None:
    from paravt.config import ConfigError, load_config

    assert load_config("tiny_cpu").train.on_save_error == "fail"
    with pytest.raises(
        ConfigError, match=r"train\.on_save_error='skip' is not one of fail\|continue"
    ):
        load_config("tiny_cpu", overrides=["train.on_save_error=skip"])
