"""Non-finite guard in a real training run: a NaN reward or an inf gradient never reaches the
optimizer. The step's update is skipped (parameters and AdamW state bitwise unchanged),
counted in metrics.jsonl, logged with the sample ids, and the next step trains again.

Tiny config of tests/test_train_resume.py: 3 steps of ~1 s; the fault is injected at step 2.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from test_train_resume import tiny_overrides

from paravt.config import load_config

FAULT_STEP = 2


def _snapshot(tr: Any) -> dict[str, Any]:
    params = {n: p.detach().clone() for n, p in tr.policy.named_parameters()}
    moments = {
        (id(p), k): (v.detach().clone() if torch.is_tensor(v) else v)
        for p, st in tr.optimizer.state.items()
        for k, v in st.items()
    }
    return {"params": params, "moments": moments, "sched": tr.scheduler.state_dict()}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a["params"].keys() == b["params"].keys()
        and all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
        and a["moments"].keys() == b["moments"].keys()
        and all(
            torch.equal(x, b["moments"][k]) if torch.is_tensor(x) else x == b["moments"][k]
            for k, x in a["moments"].items()
        )
        and a["sched"] == b["sched"]
    )


def _strict_jsonl(path: Path) -> list[dict[str, Any]]:
    """A .jsonl file parsed as strict JSON (NaN / Infinity tokens raise)."""

    def no_constants(tok: str) -> Any:
        raise AssertionError(f"{path.name} holds the non-JSON constant {tok}")

    lines = [x for x in path.read_text().split("\n") if x.strip()]
    return [json.loads(x, parse_constant=no_constants) for x in lines]


def _strict_rows(path: Path) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in _strict_jsonl(path) if r["kind"] == "train"}


def _run_with_fault(assets, out: Path, monkeypatch, fault) -> dict[int, tuple]:
    """Run 3 steps; ``fault(tr)`` is called before step ``FAULT_STEP`` and returns an undo
    callable. Returns {step: (state before, state after)}."""
    import paravt.train as train

    real_step = train.train_step
    seen: dict[int, tuple] = {}

    def step(tr: Any, s: int) -> dict[str, float]:
        before = _snapshot(tr)
        undo = fault(tr) if s == FAULT_STEP else None
        try:
            m = real_step(tr, s)
        finally:
            if undo is not None:
                undo()
        seen[s] = (before, _snapshot(tr))
        return m

    monkeypatch.setattr(train, "train_step", step)
    train.run(load_config(overrides=tiny_overrides(assets, out, 3)))
    assert sorted(seen) == [1, 2, 3]
    return seen


def _assert_skipped_at_fault_step(seen: dict[int, tuple], rows: dict[int, dict]) -> None:
    assert _same(*seen[FAULT_STEP]), "the faulty step changed parameters / AdamW state"
    for s in (1, 3):  # the steps around it train
        assert not _same(*seen[s]), f"step {s} did not update the policy"
    for p in seen[3][1]["params"].values():
        assert torch.isfinite(p).all()
    assert [rows[s]["skipped_updates"] for s in (1, 2, 3)] == [0.0, 1.0, 0.0]
    row = rows[FAULT_STEP]
    for k in ("loss", "grad_norm", "lr", "kl", "entropy"):
        assert isinstance(row[k], float) and math.isfinite(row[k]), (k, row[k])


def test_nan_reward_skips_the_step_update(assets, tmp_path, monkeypatch, capsys) -> None:
    import paravt.train as train

    real_score = train.score_groups
    poisoned: list[str] = []

    def fault(tr: Any):
        def score(groups, cfg):  # train_step's score_groups (imported from paravt.rewards)
            real_score(groups, cfg)
            t = groups[0].trajectories[1]
            t.reward = float("nan")
            poisoned.append(t.sample_id)

        monkeypatch.setattr(train, "score_groups", score)
        return lambda: monkeypatch.setattr(train, "score_groups", real_score)

    seen = _run_with_fault(assets, tmp_path / "run", monkeypatch, fault)
    rows = _strict_rows(tmp_path / "run" / "metrics.jsonl")
    _assert_skipped_at_fault_step(seen, rows)
    assert poisoned, "the fault was not injected"
    assert rows[2]["nonfinite/reward"] == 1.0
    assert rows[2]["nonfinite/advantage"] == 2.0  # the NaN spreads to its group of 2
    assert rows[1]["nonfinite/reward"] == rows[3]["nonfinite/reward"] == 0.0
    assert rows[2]["reward/total"] is None  # undefined mean: JSON null, never NaN
    logged = [t for t in _strict_jsonl(tmp_path / "run" / "trajectories.jsonl") if t["step"] == 2]
    assert None in [t["reward"] for t in logged]  # the NaN trajectory, written as null
    log = capsys.readouterr().out
    line = next(x for x in log.splitlines() if x.startswith("[guard] step 2: non-finite reward"))
    assert poisoned[0] in line and "skipped" in line
    assert "[guard] step 1" not in log and "[guard] step 3" not in log


def test_inf_gradient_skips_the_optimizer_step(assets, tmp_path, monkeypatch, capsys) -> None:
    fired: list[bool] = []

    def fault(tr: Any):
        weight = tr.policy.get_input_embeddings().weight

        def make_inf(g: torch.Tensor) -> torch.Tensor:
            fired.append(True)
            g = g.clone()
            g.view(-1)[0] = float("inf")
            return g

        return weight.register_hook(make_inf).remove

    seen = _run_with_fault(assets, tmp_path / "run", monkeypatch, fault)
    rows = _strict_rows(tmp_path / "run" / "metrics.jsonl")
    assert fired, "the gradient hook never ran"
    _assert_skipped_at_fault_step(seen, rows)
    assert rows[2]["nonfinite/grad_norm"] == 1.0
    assert rows[2]["nonfinite/loss"] == rows[2]["nonfinite/reward"] == 0.0
    assert rows[2]["grad_norm"] == 0.0  # no applied update in step 2 to average over
    log = capsys.readouterr().out
    line = next(x for x in log.splitlines() if x.startswith("[guard] step 2: non-finite"))
    assert "grad_norm inf" in line and "minibatch samples" in line
