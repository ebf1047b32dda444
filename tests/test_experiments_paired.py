"""Collapse protocol 5's reading (``python -m paravt.experiments paired``): per-seed paired
differences, the preconditions and the bars, over collapse folders (one per regime, or one per
seed of a regime run side by side). The folders here are written row by row in the layout and
keys ``paravt.train`` writes (``heldout.jsonl``, ``metrics.jsonl``); the end-to-end reading of a
real collapse folder is in tests/test_experiments_collapse.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from paravt.experiments import main
from paravt.experiments.paired import paired, paired_report


def _held(path: Path, k: int, need: list[tuple[float, float]], free: list[tuple[float, float]],
          closure: float, fmt: float = 1.0) -> None:  # fmt: skip
    """``heldout.jsonl`` of one evaluation: (call rate, accuracy) per needing / free prompt."""
    path.mkdir(parents=True, exist_ok=True)
    rows = []
    for flag, prompts in ((True, need), (False, free)):
        for rate, acc in prompts:
            rows.append({"kind": "eval_after", "step": 50, "condition": f"K{k}_tools", "K": k,
                         "extra": {f"need_K{k}": flag}, "tool_call_rate": rate,
                         "accuracy": acc, "format_compliance": fmt,
                         "tool_turn_closure": closure})  # fmt: skip
    (path / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _arm(out: Path, arm: str, seed: int, rate: float, acc: float, kappa: tuple[float, float],
         closure: float = 0.9) -> None:  # fmt: skip
    run = out / arm / f"seed{seed}"
    _held(run, 32, [(rate, acc)] * 3, [(0.0, 1.0)] * 5, closure)
    train = [{"kind": "train", "step": s, "tool_calls_per_rollout": kappa[s > 1]}
             for s in range(1, 7)]  # fmt: skip
    rows = [*train, {"kind": "eval_after", "step": 6}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _regime(out: Path, seeds: list[int], closure: float, arms: dict[str, list[float]]) -> None:
    """A regime's folder: each seed's cold start (call rate 0.5, accuracy 0.45 on needing
    prompts) and each arm's call rate per seed (accuracy = 0.9 x rate)."""
    for i, s in enumerate(seeds):
        _held(out / "cold" / f"seed{s}" / "sft_eval", 32, [(0.5, 0.45)] * 3, [(0.3, 1.0)] * 5,
              closure, fmt=0.6)  # fmt: skip
        for arm, rates in arms.items():
            _arm(out, arm, s, rates[i], 0.9 * rates[i], (1.0, 2 * rates[i]))


def test_paired_differences_clear_only_beyond_twice_their_std() -> None:
    p = paired({1: 0.5, 2: 0.6, 3: 0.7, 4: math.nan}, {1: 0.1, 2: 0.1, 3: 0.2, 5: 0.0})
    assert p.per_seed == pytest.approx({1: 0.4, 2: 0.5, 3: 0.5})
    assert p.mean == pytest.approx(1.4 / 3) and p.std == pytest.approx(0.057735, abs=1e-5)
    assert p.clears is True
    # The same mean with a seed of the other sign: the across-seed spread wins.
    assert paired({1: 1.2, 2: -0.2, 3: 0.4}, {1: 0.0, 2: 0.0, 3: 0.0}).clears is False
    assert paired({1: 0.9}, {1: 0.1}).clears is None  # one seed: nothing judged


def test_the_report_reads_regimes_pairs_by_seed_and_judges(tmp_path, capsys) -> None:
    seeds = [800, 801, 802]
    low = tmp_path / "L"
    _regime(low, seeds, 0.05, {"vanilla": [0.0, 0.05, 0.1], "gating": [0.05, 0.0, 0.1],
                               "paragrpo": [0.1, 0.05, 0.1]})  # fmt: skip
    # Regime M run side by side: one folder per seed.
    for i, s in enumerate(seeds):
        _regime(tmp_path / f"M{i}", [s], 0.3, {"vanilla": [0.8 + 0.05 * i],
                                              "gating": [0.85], "paragrpo": [0.9]})  # fmt: skip
    mid_dirs = [tmp_path / f"M{i}" for i in range(3)]
    res = paired_report({"L": [low], "M": mid_dirs}, k=32)
    assert res["regimes"]["M"]["seeds"] == seeds
    cold = res["regimes"]["L"]["cold"][800]
    assert cold["tool_rate_need"] == pytest.approx(0.5) and cold["share_need"] == 3 / 8
    van = res["regimes"]["M"]["arms"]["vanilla"][801]
    assert van["tool_rate_need"] == pytest.approx(0.85)
    assert van["kappa_ratio"] == pytest.approx(1.7)  # end (last 5 steps) over step 1
    assert res["regimes"]["L"]["collapsed"] == {"vanilla": True, "gating": True, "paragrpo": True}
    assert res["regimes"]["M"]["collapsed"]["paragrpo"] is False
    pre = {(p["id"], p["regime"]): p for p in res["preconditions"]}
    assert pre[("P1", "L")]["met"] and pre[("P2", "M")]["met"]
    assert pre[("P3", "L")]["met"] and pre[("P4", "M")]["met"]  # 0.45 >= 0.7 x 0.5
    assert pre[("P5", "L")]["met"] and "per seed 800: 1.00, 801: 1.00" in pre[("P5", "L")]["text"]
    bars = {(b["id"], b["what"], b["regime"], b["key"]): b for b in res["bars"]}
    q1 = bars[("Q1", "vanilla: M - L", "M-L", "tool_rate_need")]
    assert q1["per_seed"] == pytest.approx({800: 0.8, 801: 0.8, 802: 0.8}) and q1["clears"]
    q2 = bars[("Q2", "PARA-GRPO - vanilla", "M", "tool_rate_need")]
    assert q2["mean"] == pytest.approx(0.05) and q2["clears"] is False  # 0.1, 0.05, 0.0
    q2l = bars[("Q2", "PARA-GRPO - vanilla", "L", "tool_rate_need")]
    assert q2l["clears"] is False  # 0.1, 0.0, 0.0
    # Q4 is judged only where calls survive in both arms.
    q4 = bars[("Q4", "PARA-GRPO - vanilla", "L", "tool_turn_closure")]
    assert q4["clears"] is None and "did not survive" in q4["why"]
    assert bars[("Q4", "PARA-GRPO - vanilla", "M", "tool_turn_closure")]["clears"] is False
    # The command: the same numbers, a table and a JSON file.
    dst = tmp_path / "p.json"
    argv = ["paired", f"L={low}", "M=" + ",".join(map(str, mid_dirs)), "--json", str(dst)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "## Regime M" in out and "| Q1 | vanilla: M - L | M-L |" in out
    back = json.loads(dst.read_text())
    assert back["bars"][0]["per_seed"] == pytest.approx({"800": 0.8, "801": 0.8, "802": 0.8})
    # Cold starts alone (the tuning seeds' check): preconditions, no bars.
    assert main(["paired", f"L={low}", "--cold-only"]) == 0
    assert "## Bars" not in capsys.readouterr().out


def test_bad_input_is_named(tmp_path, capsys) -> None:
    assert main(["paired", "L"]) == 2
    assert "give REGIME=DIR" in capsys.readouterr().err
    assert main(["paired", f"L={tmp_path}"]) == 2
    assert "no cold/ folder" in capsys.readouterr().err
    (tmp_path / "cold" / "seed1").mkdir(parents=True)
    assert main(["paired", f"L={tmp_path}"]) == 2
    assert "no evaluated cold start at K = 32" in capsys.readouterr().err
    _regime(tmp_path / "a", [1], 0.1, {})
    _regime(tmp_path / "b", [1], 0.1, {})
    assert main(["paired", f"L={tmp_path / 'a'},{tmp_path / 'b'}"]) == 2
    assert "seed 1 is in another folder of its regime too" in capsys.readouterr().err
