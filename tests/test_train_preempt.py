"""Preemption: SIGTERM / SIGUSR1 mid-step, a clean exit 0 with a checkpoint, then ``--resume``
continues as if nothing had happened (``paravt.preempt``; docs/hostile_input.md, "Preemption").

Real ``python -m paravt.train`` processes on the tiny config of test_train_resume.py (4 steps,
checkpoint only at the end). The signal is real and goes through the production handler: the
run sends it to itself at a chosen phase of a chosen step (``PARAVT_PREEMPT_TEST_SIGNAL``, the
only test hook; it prints the wall time it sent the signal at), or the test sends it from
outside. Each case checks the exit code, the log line, the checkpoint written, that
metrics.jsonl holds no row past it, and that ``--resume`` reproduces the uninterrupted run's
metrics and final weights bitwise (CPU). The signal-to-exit times are printed
(``pytest tests/test_train_preempt.py -s``) and must stay under ``train.preempt_grace_s``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_train_resume import tiny_overrides
from torchrun import torchrun
from train_runs import (
    ROOT,
    assert_same_row,
    assert_same_weights,
    train_rows,
    train_steps,
    wait_for,
)

from paravt.metrics import read_metrics

GRACE_S = 30.0
STEPS = 4
ENV = "PARAVT_PREEMPT_TEST_SIGNAL"


def _overrides(assets: dict[str, str], out: Path, steps: int = STEPS) -> list[str]:
    return [
        *tiny_overrides(assets, out, steps),
        "train.save_every=0",  # only at the end: a preemption checkpoint is the only other
        f"train.preempt_grace_s={GRACE_S}",
    ]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    return {**env, "PYTHONHASHSEED": "0", **extra}


def _train(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "w") as f:  # a file, not a pipe: wait() returns the moment it exits
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def _sent_at(text: str) -> float:
    """The wall time the run's test hook sent its signal (its ``[preempt-test]`` line)."""
    m = re.search(r"\[preempt-test\] .* at wall time ([0-9.]+)", text)
    assert m, f"no [preempt-test] line in the log:\n{text[-3000:]}"
    return float(m.group(1))


def _report(what: str, seconds: float, line: str) -> None:
    """Print a measured exit time and the run's log line (``pytest -s``; docs/hostile_input.md
    quotes them)."""
    print(f"\n[preempt exit time] {what}: {seconds:.2f} s from the signal to exit\n  {line}")


@pytest.fixture(scope="module")
def reference(assets: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted single-process run (4 steps)."""
    out = tmp_path_factory.mktemp("preempt_ref") / "run"
    argv = [sys.executable, "-m", "paravt.train", *_overrides(assets, out)]
    proc = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert train_steps(out) == [1, 2, 3, 4]
    return out


def _resume_and_compare(
    argv: list[str], out: Path, ref: Path, from_step: int, env: dict[str, str]
) -> None:
    resumed = subprocess.run(
        [*argv, "--resume"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(step {from_step})" in resumed.stdout, resumed.stdout[-2000:]
    steps = sorted(train_rows(ref))
    assert train_steps(out) == steps  # no duplicate, partial or torn row
    a, b = train_rows(ref), train_rows(out)
    for step in steps:
        assert_same_row(step, a[step], b[step], "preemption + resume")
    last = f"step_{steps[-1]:06d}"
    assert_same_weights(ref / "checkpoints" / last, out / "checkpoints" / last)


def test_a_signal_at_the_step_boundary_names_the_step_that_then_runs(monkeypatch) -> None:
    """The boundary check and the record that the next step started are one atomic move: a
    signal landing right after the check (here: sent from inside it) is named against the
    step that then runs, not against the one that ended (the race that once logged "SIGUSR1
    at step 2 (metrics): finished step 3")."""
    from paravt.preempt import Preemption

    monkeypatch.delenv(ENV, raising=False)
    with Preemption(GRACE_S) as pre:
        pre.enter(2, "metrics")
        check = pre.requested

        def late_signal() -> bool:
            answer = check()
            os.kill(os.getpid(), signal.SIGUSR1)  # after the answer, before step 3 is named
            return answer

        pre.requested = late_signal  # type: ignore[method-assign]
        assert pre.start_step(3) is False  # nothing had come when it checked: step 3 runs
        assert pre.arrival is not None
        assert (pre.arrival.signal, pre.arrival.step, pre.arrival.phase) == ("SIGUSR1", 3, "start")
        pre.requested = check  # type: ignore[method-assign]
        assert pre.start_step(4) is True  # the next boundary stops the run
        assert (pre.step, pre.phase) == (3, "start")  # and names no step 4
    assert not signal.pthread_sigmask(signal.SIG_BLOCK, []) & {signal.SIGTERM, signal.SIGUSR1}


@pytest.mark.parametrize(
    ("phase", "grace", "outcome", "kept"),
    [
        # (A SIGTERM mid-rollout that finishes its step: test_two_ranks_sigterm_on_one_rank.)
        ("update", GRACE_S, "finished step 3", 3),
        # A grace too short to finish the step: step 3 is abandoned after its rollout and
        # step 2 is checkpointed (from the state saved when step 3 began).
        ("rollout", 0.001, "abandoned step 3", 2),
    ],
    ids=["mid-update", "mid-rollout-abandon"],
)
def test_sigterm_mid_step_exits_0_and_resume_matches(
    assets: dict[str, str],
    reference: Path,
    tmp_path: Path,
    phase: str,
    grace: float,
    outcome: str,
    kept: int,
) -> None:
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "paravt.train", *_overrides(assets, out)]
    argv_run = [*argv, f"train.preempt_grace_s={grace}"]
    log = tmp_path / "train.log"
    proc = _train(argv_run, log, _env(**{ENV: f"SIGTERM:3:{phase}"}))
    rc = proc.wait(timeout=300)
    t_exit = time.time()
    text = log.read_text()
    assert rc == 0, text[-3000:]
    took = t_exit - _sent_at(text)
    line = next((x for x in text.splitlines() if x.startswith("[preempt] ")), "")
    assert f"SIGTERM at step 3 ({phase})" in line and outcome in line and "exiting 0" in line, line
    assert f"step_{kept:06d}" in line, line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", f"step_{kept:06d}"]
    assert train_steps(out) == list(range(1, kept + 1))  # nothing of an abandoned step
    _report(f"SIGTERM mid-{phase}, 1 process, grace {grace:g} s", took, line)
    if grace >= GRACE_S:
        assert took < grace
    else:
        assert "past the grace" in line, line
    # The resumed run gets the normal grace: it must not be preempted (no hook either).
    _resume_and_compare(argv, out, reference, kept, _env())


def test_ctrl_c_saves_and_exits_0_and_a_second_one_stops_at_once(
    assets: dict[str, str], reference: Path, tmp_path: Path
) -> None:
    """Issue 50 item 6: a Ctrl-C (SIGINT) from outside is said at once and handled as a
    preemption: the step is finished, checkpointed, exit 0, no traceback, and --resume matches
    the uninterrupted run (SIGUSR1, the same handler, is sent for real in
    test_a_signal_at_the_step_boundary_names_the_step_that_then_runs). Two Ctrl-C: exit 130 at
    once, no traceback, every metrics row whole and the newest checkpoint loadable."""
    from paravt.checkpoint import latest_checkpoint, load_trainer_state

    for presses, want in ((1, 0), (2, 130)):
        out = tmp_path / f"run{presses}"
        # Two presses need a run still going when the second lands: 40 steps, not 4 (a busy
        # machine's poll saw step 1's row as the 4-step run was writing its last checkpoint).
        steps = STEPS if presses == 1 else 40
        argv = [sys.executable, "-m", "paravt.train", *_overrides(assets, out, steps)]
        log = tmp_path / f"train{presses}.log"
        proc = _train(argv, log, _env())
        wait_for(lambda o=out: 1 in train_rows(o), proc, "step 1's metrics")
        for _ in range(presses):
            os.kill(proc.pid, signal.SIGINT)
            time.sleep(0.05)
        rc = proc.wait(timeout=300)
        text = log.read_text()
        assert rc == want, text[-3000:]
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
        assert re.search(r"\[signal\] SIGINT received on rank 0 at step \d", text), text[-3000:]
        assert "Ctrl-C again: stop at once" in text
        steps = train_steps(out)
        assert steps == list(range(1, len(steps) + 1))  # whole rows only
        if presses == 1:
            line = next(x for x in text.splitlines() if x.startswith("[preempt] "))
            m = re.search(r"SIGINT at step (\d) \(\w+\): finished step (\d)", line)
            assert m and m.group(1) == m.group(2) and "exiting 0" in line, line
            kept = int(m.group(1))
            assert f"step_{kept:06d}" in line and steps == list(range(1, kept + 1)), line
            _resume_and_compare(argv, out, reference, kept, _env())
        else:
            assert "a second SIGINT on rank 0: exiting at once (130)" in text, text[-3000:]
        ckpt = latest_checkpoint(out)
        if ckpt is not None:  # the newest checkpoint reads back whole
            assert load_trainer_state(ckpt)


# ------------------------------------------------------------------------------- two ranks

RANKS_STEPS = 3


def _rank_overrides(assets: dict[str, str], out: Path) -> list[str]:
    return [*_overrides(assets, out, RANKS_STEPS), "train.prompts_per_step=2"]


@pytest.fixture(scope="module")
def reference_2ranks(assets: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("preempt_ref2") / "run"
    proc = torchrun(2, "-m", "paravt.train", *_rank_overrides(assets, out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert train_steps(out) == list(range(1, RANKS_STEPS + 1))
    return out


def _torchrun_popen(args: list[str], log: Path, env: dict[str, Any]) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
        "-m", "paravt.train", *args,
    ]  # fmt: skip
    env = {**_env(), "OMP_NUM_THREADS": "1", **env}
    return _train(cmd, log, env)


# Rank 1 (not the writer) signalled mid-update; a signal mid-rollout is
# test_sigterm_mid_step_exits_0_and_resume_matches[mid-rollout-abandon] and the Ctrl-C test.
@pytest.mark.parametrize(("phase", "rank"), [("update", 1)])
def test_two_ranks_sigterm_on_one_rank(
    assets: dict[str, str], reference_2ranks: Path, tmp_path: Path, phase: str, rank: int
) -> None:
    """SIGTERM reaches one rank only, inside step 2: both ranks finish step 2, rank 0 writes
    its checkpoint, both exit 0 (so torchrun does), and --resume matches."""
    out = tmp_path / "run"
    log = tmp_path / "train.log"
    proc = _torchrun_popen(_rank_overrides(assets, out), log, {ENV: f"SIGTERM:2:{phase}:{rank}"})
    rc = proc.wait(timeout=300)
    t_exit = time.time()
    text = log.read_text()
    assert rc == 0, text[-4000:]
    took = t_exit - _sent_at(text)
    lines = [x for x in text.splitlines() if "[preempt] " in x]
    assert len(lines) == 1, lines  # rank 0 reports for both
    line = lines[0]
    assert f"SIGTERM at step 2 ({phase}) on rank {rank}:" in line, line
    assert "finished step 2" in line and "step_000002" in line and "exiting 0" in line, line
    assert train_steps(out) == [1, 2]
    _report(f"SIGTERM to rank {rank} mid-{phase}, 2 ranks (signal to torchrun's exit)", took, line)
    assert took < GRACE_S

    resumed = torchrun(2, "-m", "paravt.train", "--resume", *_rank_overrides(assets, out))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(step 2)" in resumed.stdout, resumed.stdout[-2000:]
    assert train_steps(out) == [1, 2, 3]
    a, b = train_rows(reference_2ranks), train_rows(out)
    for step in (1, 2, 3):
        assert_same_row(step, a[step], b[step], "preemption + resume on 2 ranks")
    last = f"step_{RANKS_STEPS:06d}"
    assert_same_weights(reference_2ranks / "checkpoints" / last, out / "checkpoints" / last)


# ------------------------------------------------------------------- teardown and the SFT


def test_a_repeated_sigterm_during_the_teardown_still_exits_0(
    assets: dict[str, str], tmp_path: Path
) -> None:
    """SLURM signals again at the time limit: SIGTERMs sent from the moment the ``[preempt]``
    line says "exiting 0" until the process is gone are all absorbed (the handlers stay until
    the process exits), never the default action's exit 143."""
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "paravt.train", *_overrides(assets, out, 1)]
    log = tmp_path / "train.log"
    proc = _train(argv, log, _env(**{ENV: "SIGTERM:1:update"}))
    wait_for(lambda: "exiting 0" in log.read_text(), proc, "the [preempt] line", timeout=300)
    sent = 0
    while proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGTERM)
            sent += 1
        except ProcessLookupError:
            break
        time.sleep(0.002)
    rc = proc.wait(timeout=60)
    text = log.read_text()
    assert rc == 0, f"exit {rc} after {sent} repeated SIGTERM(s):\n{text[-2000:]}"
    assert sent > 0  # the process was still tearing down when they came
    assert "finished step 1, checkpoint" in text and train_steps(out) == [1]


def test_sigterm_and_kill_9_during_the_sft_and_resume_continues_it(
    assets: dict[str, str], tmp_path: Path
) -> None:
    """A SIGTERM during the cold-start SFT is honoured within the grace: the SFT stops before
    its next step, saves its state (no ``sft/`` yet, no evaluation, no RL step) and the run
    exits 0. ``--resume`` continues the SFT from that step (it is not redone); killed with
    SIGKILL before SFT step 6 of 6 (no handler, nothing saved at the kill), it leaves the state
    ``sft.save_every=2`` saved after step 4 (issue 50 item 1: a kill -9 loses at most one
    interval), and a second ``--resume`` continues from there. The final SFT weights equal an
    uninterrupted SFT's bitwise, and the run then trains."""
    from paravt.config import load_config
    from paravt.runfolder import sft_resume_dir
    from paravt.sft import run_sft

    out = tmp_path / "run"
    over = [
        *_overrides(assets, out, 1),
        "sft.steps=6",
        "sft.batch_size=2",
        "sft.save_every=2",
        "train.eval_prompts=1",
        "train.eval_samples=1",
    ]
    argv = [sys.executable, "-m", "paravt.train", *over]
    log = tmp_path / "train.log"
    proc = _train(argv, log, _env(**{ENV: "SIGTERM:0:sft step 3"}))
    rc = proc.wait(timeout=300)
    t_exit = time.time()
    text = log.read_text()
    assert rc == 0, text[-3000:]
    line = next((x for x in text.splitlines() if x.startswith("[preempt] ")), "")
    state = sft_resume_dir(out / "sft")
    assert "SIGTERM at step 0 (sft step 3): stopped the cold-start SFT after step 2 of 6" in line
    assert f"state {state} written" in line and "exiting 0" in line, line
    took = t_exit - _sent_at(text)
    _report("SIGTERM mid-SFT, 1 process", took, line)
    assert took < GRACE_S
    assert (state / "state.pt").is_file() and not (out / "sft").exists()
    assert (state / "train_state" / "__0_0.distcp").is_file()  # the shards, not a full copy
    assert read_metrics(out / "metrics.jsonl") == []  # no evaluation, no step

    log2 = tmp_path / "resumed.log"
    proc = _train([*argv, "--resume"], log2, _env(**{ENV: "SIGKILL:0:sft step 6"}))
    rc = proc.wait(timeout=300)
    text = log2.read_text()
    assert rc == -signal.SIGKILL, text[-3000:]
    assert "[sft] continuing from" in text and "step 2 of 6 done" in text, text[-3000:]
    assert "[sft] step 1/6" not in text  # not redone
    assert f"[sft] state after step 4 saved to {state}" in text, text[-3000:]
    assert (state / "state.pt").is_file() and not (out / "sft").exists()
    assert (state / "train_state" / "__0_0.distcp").is_file()  # the shards, not a full copy
    assert not list(out.glob(".sft.resume*"))  # no temporary or set-aside state left

    resumed = subprocess.run(
        [*argv, "--resume"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step 4 of 6 done" in resumed.stdout, resumed.stdout[-3000:]
    assert not state.exists() and train_steps(out) == [1]

    ref = tmp_path / "ref_sft"
    cfg = load_config(overrides=over)
    run_sft(cfg, model_dir=assets["model"], data_dir=assets["data"], out_dir=ref)
    assert_same_weights(ref, out / "sft")


def test_an_evaluation_a_preemption_skipped_is_owed_on_resume(
    assets: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train.eval_every`` (issue 38): a SIGTERM during step 1 stops the run after it without
    step 1's held-out evaluation (the grace is for the checkpoint); ``--resume`` evaluates step
    1 first, then trains on, so the eval_step rows are those of an uninterrupted run."""
    from paravt.train import main

    out = tmp_path / "run"
    argv = [
        *tiny_overrides(assets, out, 2),
        "train.save_every=0",
        "train.eval_every=1",
        "train.eval_prompts=1",
        "train.eval_samples=1",
        "train.eval_conditions=[2:tools]",
        "train.eval_before=false",
        "algo.kl_coef=0.0",  # no reference model: one load per run
    ]
    monkeypatch.setenv(ENV, "SIGTERM:1:metrics")
    assert main(argv) == 0
    assert [(r["kind"], r["step"]) for r in read_metrics(out / "metrics.jsonl")] == [("train", 1)]
    assert not (out / "heldout.jsonl").is_file() or not read_metrics(out / "heldout.jsonl")
    monkeypatch.delenv(ENV)
    assert main([*argv, "--resume"]) == 0
    kinds = [(r["kind"], r["step"]) for r in read_metrics(out / "metrics.jsonl")]
    assert [k for k in kinds if k[0] != "alarm"] == [
        ("train", 1), ("eval_step", 1), ("train", 2), ("eval_after", 2)
    ]  # fmt: skip
    held = read_metrics(out / "heldout.jsonl")  # one prompt, one condition per evaluation
    assert [(r["kind"], r["step"], r["condition"], r["samples"]) for r in held] == [
        ("eval_step", 1, "K2_tools", 1), ("eval_after", 2, "K2_tools", 1)
    ]  # fmt: skip


def test_an_sft_state_saved_on_two_ranks_continues_on_one(
    assets: dict[str, str], tmp_path: Path
) -> None:
    """The cold-start SFT's state resumes across world sizes, like the RL state (issue 66
    item 4): a SIGTERM during SFT step 3 of a two-rank run saves the state after step 2 (each
    rank its shards); ``--resume`` on one process continues from step 2 (weights, moments,
    schedule and losses; the record order drawn again, said in the log), not from step 0 as
    before (the world size was part of the settings a state had to match)."""
    out = tmp_path / "run"
    over = [
        *_rank_overrides(assets, out),
        "train.steps=1",
        "sft.steps=4",
        "sft.batch_size=2",
        "train.eval_prompts=0",
    ]
    log = tmp_path / "train.log"
    proc = _torchrun_popen(over, log, {ENV: "SIGTERM:0:sft step 3"})
    rc = proc.wait(timeout=300)
    text = log.read_text()
    assert rc == 0, text[-4000:]
    assert "stopped the cold-start SFT after step 2 of 4" in text, text[-3000:]
    from paravt.runfolder import sft_resume_dir

    state = sft_resume_dir(out / "sft")
    assert sorted(p.name for p in (state / "train_state").glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp"
    ]  # fmt: skip
    resumed = subprocess.run(
        [sys.executable, "-m", "paravt.train", *over, "--resume"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = resumed.stdout + resumed.stderr
    assert "[sft] continuing from" in said and "step 2 of 4 done" in said, said[-3000:]
    assert "saved on 2 rank(s), now 1" in said, said[-3000:]
    assert "[sft] step 1/4" not in said  # not redone
    assert not state.exists() and (out / "sft" / "model.safetensors").is_file()
    assert train_steps(out) == [1]
