"""Resume: a run stopped after step 3 and resumed reproduces an uninterrupted run's steps 4-6.

On CPU the match is bitwise: the checkpoint holds the float32 weights (under bf16 compute: the
float32 masters beside the bf16 HF export) and AdamW moments exactly, rollouts draw from per-request generators seeded by (seed, step, uid, turn), prompts
come from a (seed, epoch) permutation whose position is saved, and the frame budgets are a
stable hash — nothing depends on process state that the checkpoint does not restore.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from assets_task import SHORT_ROLLOUT, on_assets

from paravt.config import load_config
from paravt.metrics import read_metrics

# Wall-clock metrics legitimately differ between runs.
_TIMING = ("time/", "tokens_per_s")


def tiny_overrides(assets: dict[str, str], out: Path, steps: int) -> list[str]:
    """The tiny run (~1 s a step on 2 CPU cores) as ``key=value`` overrides; the other
    train-loop tests (test_train_nonfinite.py, test_train_kill.py) use it too."""
    return [
        *on_assets(assets, out),
        f"train.steps={steps}",
        "train.prompts_per_step=1",
        "train.save_every=3",
        "train.keep_last=1",
        "train.eval_prompts=0",
        "train.progress=false",
        "train.summary_plot=false",  # 1.7 s a run (matplotlib); test_train.py checks it
        *SHORT_ROLLOUT,
        "sft.steps=0",
        "algo.adv_bias=0.1",  # non-zero advantages even when group rewards tie
        "algo.lr=1e-3",
    ]


def _cfg(
    assets: dict[str, str], out: Path, steps: int, resume: bool = False, dtype: str = "float32"
):
    return load_config(
        overrides=[
            *tiny_overrides(assets, out, steps),
            f"train.resume={str(resume).lower()}",
            f"model.dtype={dtype}",
        ]
    )


def _train_rows(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resume_matches_uninterrupted_run(assets, tmp_path, dtype) -> None:
    """``dtype``: the compute dtype (``model.dtype``); the masters are float32 either way."""
    from paravt.checkpoint import load_trainer_state, read_train_state
    from paravt.train import run

    full, cut = tmp_path / "full", tmp_path / "cut"
    run(_cfg(assets, full, 6, dtype=dtype))
    run(_cfg(assets, cut, 3, dtype=dtype))  # "killed" after the step-3 checkpoint
    # A torn line from a kill mid-write and a stale step-4 row must not survive the resume.
    with open(cut / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "kind": "train", "loss": 123.0}\n{"step": 5, "ki')
    run(_cfg(assets, cut, 6, resume=True, dtype=dtype))
    # The masters and AdamW's moments after step 6, bitwise: a resume from the bf16 export
    # alone would round the masters and drift from here on.
    sa, sb = (read_train_state(d / "checkpoints" / "step_000006") for d in (full, cut))
    # Sharded: the pickle holds no masters nor moments, they are in train_state/ (DCP).
    small = load_trainer_state(cut / "checkpoints" / "step_000006")
    assert "optimizer" not in small and "masters" not in small and small["format"] == 2
    assert ("masters" in sa) == (dtype != "float32")
    for key in ("masters",) if dtype != "float32" else ():
        assert sa[key].keys() == sb[key].keys()
        assert all(torch.equal(sa[key][k], sb[key][k]) for k in sa[key])
        assert {v.dtype for v in sa[key].values()} == {torch.float32}
    ma, mb = sa["optimizer"]["state"], sb["optimizer"]["state"]
    assert ma.keys() == mb.keys()
    for k in ma:
        assert ma[k]["exp_avg"].dtype == torch.float32
        assert torch.equal(ma[k]["exp_avg"], mb[k]["exp_avg"])
        assert torch.equal(ma[k]["exp_avg_sq"], mb[k]["exp_avg_sq"])

    a, b = _train_rows(full), _train_rows(cut)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        ra, rb = a[step], b[step]
        keys = [k for k in ra if not k.startswith(_TIMING)]
        assert set(keys) == {k for k in rb if not k.startswith(_TIMING)}
        diff = {k: (ra[k], rb[k]) for k in keys if ra[k] != rb[k]}
        assert not diff, f"step {step} differs after resume: {diff}"  # bitwise on CPU
    assert a[4]["loss"] != a[5]["loss"] or a[4]["grad_norm"] != a[5]["grad_norm"]
