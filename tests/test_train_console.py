"""What ``python -m paravt.train`` says on the console while nothing else shows progress: the
warning when RL would start from weights nothing trained, and one line per held-out condition
of each evaluation (minutes each on a CPU). A real tiny run (``tiny_overrides``: ~1 s a step,
no SFT) with a two-condition evaluation before and after its one step."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from test_train_resume import tiny_overrides


def test_an_untrained_start_warns_and_each_condition_logs_a_line(
    assets: dict[str, str], tmp_path: Path, capsys
) -> None:
    from paravt.train import main

    out = tmp_path / "run"
    base = [
        *tiny_overrides(assets, out, 1),
        "train.save_every=0",
        "train.eval_prompts=1",
        "train.eval_samples=1",
        "train.eval_conditions=[2:tools,2:notools]",
    ]
    assert main(base) == 0
    printed = capsys.readouterr()
    warned = [x for x in printed.err.splitlines() if "random weights" in x]
    assert len(warned) == 1, printed.err
    assert "the tiny model (model.path is empty)" in warned[0] and "sft.steps > 0" in warned[0]
    for when in ("before RL", "after RL"):
        assert f"[eval] {when}: 1 held-out prompt(s), 2 condition(s): 2:tools, 2:notools" in (
            printed.out
        )
        lines = re.findall(rf"\[eval\] {when}: condition (\d)/2 (\w+) done \(\d+ s\)", printed.out)
        assert lines == [("1", "K2_tools"), ("2", "K2_notools")], printed.out
    # The resumed run (its checkpoint was trained) and its evaluation say nothing of the kind.
    assert main([*base, "train.steps=2", "--resume"]) == 0
    assert "random weights" not in capsys.readouterr().err


def test_untrained_start_names_the_case() -> None:
    from paravt.config import load_config
    from paravt.train import untrained_start

    cfg = load_config(overrides=["sft.steps=0"])
    assert "the tiny model (model.path is empty)" in untrained_start(cfg)
    assert untrained_start(load_config()) == ""  # the default: a 4000-step cold start
    evaluate_only = load_config(overrides=["sft.steps=0", "train.steps=0"])
    assert untrained_start(evaluate_only) == ""  # no RL to warn about
    pretrained = replace(cfg, model=replace(cfg.model, path="/ckpt/Qwen3-VL-8B"))
    assert untrained_start(pretrained) == ""
    random8b = replace(cfg, model=replace(cfg.model, init="random", config="qwen3vl_8b"))
    assert "model.init=random (qwen3vl_8b's architecture)" in untrained_start(random8b)
