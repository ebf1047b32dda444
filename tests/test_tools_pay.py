"""``python -m paravt.experiments tools-pay``: the per-run numbers (accuracy with and without
tools on the prompts that need them, the call and copy rates) from evaluation rows, their mean
and standard deviation over runs, and its refusals."""

from __future__ import annotations

import pytest

from paravt.experiments.tools_pay import main, markdown, mean_std, run_numbers

OPTS = ["SCARLET", "LEMON", "CYAN", "MAGENTA"]


def _val(i: int, colour: str, need: bool) -> dict:
    return {"id": f"v{i}", "target": f"{colour} square", "event_start": 10.0, "event_end": 15.0,
            "options": OPTS, "need_K4": need}  # fmt: skip


def _res(i: int, letter: str, correct: bool, summary: str | None) -> dict:
    calls = (
        [] if summary is None else [{"status": "ok", "start": 0, "end": 20, "response": summary}]
    )
    return {"id": f"v{i}", "frames": 4, "parsed": letter, "correct": correct,
            "trace": [{"text": "", "calls": calls}]}  # fmt: skip


def test_numbers_split_by_need_and_the_copy_rate() -> None:
    val = {v["id"]: v for v in (_val(0, "cyan", True), _val(1, "lemon", True),
                                _val(2, "magenta", True), _val(3, "scarlet", False))}  # fmt: skip
    tools = [
        _res(0, "C", True, "A cyan square appears at 10.0-15.0 s."),  # right summary, copied
        _res(1, "A", False, "A lemon square appears at 10.0-15.0 s."),  # right, not copied
        _res(2, "B", False, None),  # no call
        _res(3, "A", True, None),  # answered from the overview
    ]
    notools = [_res(0, "A", False, None), _res(1, "B", True, None), _res(2, "A", False, None),
               _res(3, "A", True, None)]  # fmt: skip
    got = run_numbers(tools, notools, val, 4)
    assert got["n_need"] == 3
    assert got["acc_tools_need"] == pytest.approx(1 / 3)
    assert got["acc_notools_need"] == pytest.approx(1 / 3)
    assert got["gain_need"] == pytest.approx(0.0)
    assert got["call_rate_need"] == pytest.approx(2 / 3)
    assert got["copy_rate_need"] == pytest.approx(1 / 2)
    assert got["acc_tools_all"] == pytest.approx(0.5) and got["acc_notools_all"] == 0.5


def test_mean_std_and_table() -> None:
    assert mean_std([0.8, 1.0]) == (pytest.approx(0.9), pytest.approx(0.1414, abs=1e-4))
    assert mean_std([0.5]) == (0.5, 0.0)
    keys = ("n_need", "acc_tools_need", "acc_notools_need", "gain_need", "call_rate_need",
            "copy_rate_need", "acc_tools_all", "acc_notools_all", "gain_all")  # fmt: skip
    res = {"runs": {"r1": dict.fromkeys(keys, 1.0)}, "mean": dict.fromkeys(keys, 1.0),
           "std": dict.fromkeys(keys, 0.0)}  # fmt: skip
    table = markdown(res)
    assert "| r1 | 1.000 |" in table and "| mean +- std | 1.000 +- 0.000 |" in table


def test_refuses_a_folder_that_is_not_a_run(tmp_path, capsys) -> None:
    assert main([str(tmp_path)]) == 2
    assert "no config.yaml" in capsys.readouterr().err
