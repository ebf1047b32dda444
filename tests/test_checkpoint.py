"""Checkpoints: HF-loadable weights, full resume state, atomic writes, keep-last-N."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from paravt.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_model_state,
    load_trainer_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)


def _module_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(7, 11), torch.nn.Tanh(), torch.nn.Linear(11, 3))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(2):
        m(torch.randn(5, 7)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def _save(run: Path, step: int, m: torch.nn.Module, opt, keep_last: int = 2) -> Path:
    return save_checkpoint(
        run,
        step,
        model=m,
        model_state=m.state_dict(),
        trainer_state={"optimizer": opt.state_dict(), "rng": rng_state(), "data": {"pos": step}},
        keep_last=keep_last,
    )


def test_roundtrip_restores_weights_optimizer_and_rng(tmp_path: Path) -> None:
    m, opt = _module_and_optimizer()
    ck = _save(tmp_path, 3, m, opt)
    expected_next = torch.rand(4)  # the draw a resumed run must reproduce
    expected_py = random.random()
    expected_np = np.random.rand()

    st = load_trainer_state(ck)
    assert st["step"] == 3 and st["data"] == {"pos": 3}
    m2, opt2 = _module_and_optimizer()
    with torch.no_grad():
        for p in m2.parameters():
            p.add_(1.0)  # make sure the load really overwrites
    m2.load_state_dict(load_model_state(ck))
    opt2.load_state_dict(st["optimizer"])
    for a, b in zip(m.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    # One more identical optimizer step gives identical weights (Adam moments restored).
    x = torch.randn(5, 7)
    for mod, o in ((m, opt), (m2, opt2)):
        mod(x).square().mean().backward()
        o.step()
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    set_rng_state(st["rng"])
    assert torch.equal(torch.rand(4), expected_next)
    assert random.random() == expected_py and np.random.rand() == expected_np


def test_keep_last_and_latest_pointer(tmp_path: Path) -> None:
    m, opt = _module_and_optimizer()
    for step in (2, 4, 6):
        _save(tmp_path, step, m, opt, keep_last=2)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step_000004", "step_000006"]
    assert latest_checkpoint(tmp_path).name == "step_000006"


def test_torn_write_is_ignored_and_cleaned(tmp_path: Path) -> None:
    m, opt = _module_and_optimizer()
    _save(tmp_path, 2, m, opt)
    # A process killed mid-save leaves a temporary directory (and no pointer update).
    torn = tmp_path / "checkpoints" / ".tmp-step_000004"
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path).name == "step_000002"
    # A pointer to a step directory that lacks trainer state is not trusted either.
    (tmp_path / "checkpoints" / "latest").write_text("step_000009")
    assert latest_checkpoint(tmp_path).name == "step_000002"
    _save(tmp_path, 4, m, opt)
    assert not torn.exists()
    assert latest_checkpoint(tmp_path).name == "step_000004"


def test_missing_state_error_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="--resume"):
        load_trainer_state(tmp_path)


def test_hf_checkpoint_loads_with_from_pretrained(tmp_path: Path) -> None:
    from transformers import Qwen3VLForConditionalGeneration

    from paravt.models.tiny import build_tiny_checkpoint

    src = build_tiny_checkpoint(tmp_path / "tiny", seed=1)
    model = Qwen3VLForConditionalGeneration.from_pretrained(src, local_files_only=True)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.5)  # a "trained" change that must survive the round trip
    ck = save_checkpoint(
        tmp_path / "run",
        1,
        model=model,
        model_state=model.state_dict(),
        trainer_state={},
        source_dir=src,
    )
    assert (ck / "tokenizer.json").is_file() and (ck / "config.json").is_file()
    back = Qwen3VLForConditionalGeneration.from_pretrained(ck, local_files_only=True)
    for (k, a), (k2, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k


def test_a_pinned_checkpoint_survives_pruning_until_released(tmp_path: Path) -> None:
    """``pin_checkpoint`` (an evaluation of a live run holds one): keep_last pruning skips the
    pinned checkpoint and prunes it at the first save after the pin is released; a path pruned
    before the pin took hold is ``CheckpointGone``, and ``resolve_and_pin`` then resolves the
    run's newest again. On main the pinned folder was deleted under its reader."""
    from contextlib import ExitStack

    from paravt.checkpoint import CheckpointGone, pin_checkpoint, resolve_and_pin
    from paravt.config import load_config

    m, opt = _module_and_optimizer()
    _save(tmp_path, 1, m, opt, keep_last=1)
    two = _save(tmp_path, 2, m, opt, keep_last=1)
    names = lambda: [p.name for p in list_checkpoints(tmp_path)]  # noqa: E731
    with pin_checkpoint(two):
        _save(tmp_path, 3, m, opt, keep_last=1)
        assert names() == ["step_000002", "step_000003"]
        _save(tmp_path, 4, m, opt, keep_last=1)
        assert names() == ["step_000002", "step_000004"]
        assert (two / "model.safetensors").is_file()
        # the readers' lock file sits beside the folder, never inside (its files are exactly
        # its manifest's)
        assert (two.parent / ".pin-step_000002").is_file()
        assert not [f for f in two.iterdir() if f.name.startswith(".pin")]
    _save(tmp_path, 5, m, opt, keep_last=1)
    assert not (two.parent / ".pin-step_000002").exists()  # pruned with its folder
    assert names() == ["step_000005"]
    with pytest.raises(CheckpointGone, match="step_000002 was pruned"):
        with pin_checkpoint(two):
            pass
    cfg = load_config("tiny_cpu")
    with ExitStack() as pins:
        got = resolve_and_pin(cfg, str(tmp_path), pins)
        assert Path(got).name == "step_000005"
        _save(tmp_path, 6, m, opt, keep_last=1)
        assert names() == ["step_000005", "step_000006"]  # pinned by this block
    _save(tmp_path, 7, m, opt, keep_last=1)
    assert names() == ["step_000007"]


def test_eval_holds_its_pin_while_it_runs(tmp_path: Path, monkeypatch) -> None:
    """``python -m paravt.eval --model RUN`` resolves the run's newest checkpoint through
    ``resolve_and_pin`` with a stack that lives as long as the evaluation: a save of the live
    run while it runs cannot prune it (checked from inside, then the evaluation is stopped)."""
    import paravt.eval.__main__ as ev
    from paravt.checkpoint import resolve_and_pin
    from paravt.config import ConfigError

    m, opt = _module_and_optimizer()
    _save(tmp_path, 1, m, opt, keep_last=1)
    seen: list[str] = []

    def spy(cfg, given, pins):
        path = resolve_and_pin(cfg, given, pins)
        _save(tmp_path, 2, m, opt, keep_last=1)  # the live run saves meanwhile
        seen.append(path)
        assert Path(path).is_dir() and Path(path).name == "step_000001"
        raise ConfigError("stop here (test)")

    monkeypatch.setattr(ev, "resolve_and_pin", spy)
    assert ev.main(["--benchmark", "synth", "--model", str(tmp_path)]) == 2
    assert len(seen) == 1
    _save(tmp_path, 3, m, opt, keep_last=1)  # released with the evaluation
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000003"]
