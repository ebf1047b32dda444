"""NonFiniteGuard (paravt.algo.guard): what it flags, what it counts, and that ranks agree.

The training-run behaviour (parameters untouched, metrics.jsonl, next step trains) is in
tests/test_train_nonfinite.py; here the guard alone, on one rank and on two gloo ranks where
only one rank sees the bad value.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

from paravt.algo.guard import NonFiniteGuard
from paravt.distributed import DistContext

NAN, INF = float("nan"), float("inf")


def _groups(rewards: list[list[float]]) -> list[SimpleNamespace]:
    return [
        SimpleNamespace(
            trajectories=[
                SimpleNamespace(uid=f"{gi}:s{gi}:r{i}", sample_id=f"s{gi}", reward=r)
                for i, r in enumerate(rs)
            ],
            sub_trajectories=[SimpleNamespace(uid=f"{gi}:s{gi}:r0:t0:c0", sample_id=f"s{gi}")],
        )
        for gi, rs in enumerate(rewards)
    ]


def test_single_rank_flags_counts_and_names_samples(capsys) -> None:
    guard = NonFiniteGuard(DistContext(), step=7)
    assert guard.check_rewards(_groups([[1.0, 0.5], [0.0, 1.0]]))
    assert guard.planned_epochs(2, 3) == 2 and not guard.skip_step
    assert guard.update_is_finite(0.25, 3.0, ["0:s0:r0"])
    assert capsys.readouterr().out == ""

    assert not guard.check_rewards(_groups([[1.0, 0.5], [INF, NAN]]))
    units = [SimpleNamespace(main=SimpleNamespace(uid="1:s1:r0", sample_id="s1"), advantage=NAN)]
    assert not guard.check_advantages(units)
    assert guard.planned_epochs(2, 3) == 0  # the whole step: 2 epochs x 3 minibatches skipped
    assert not guard.update_is_finite(NAN, 1.0, ["1:s1:r0:t0:c0"])
    assert not guard.update_is_finite(0.1, INF, ["0:s0:r1"])
    assert guard.metrics() == {
        "skipped_updates": 8.0,
        "nonfinite/reward": 2.0,
        "nonfinite/advantage": 1.0,
        "nonfinite/loss": 1.0,
        "nonfinite/grad_norm": 1.0,
    }
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[guard] step 7: non-finite reward in 2 trajectories: sample s1")
    assert "reward inf" in out[0] and "reward nan" in out[0] and "1:s1:r1" in out[0]
    assert out[1].startswith("[guard] step 7: non-finite advantage in 1 trajectory: sample s1")
    assert "loss nan on minibatch samples s1" in out[2]  # a sub-agent uid maps to its sample
    assert "grad_norm inf on minibatch samples s0" in out[3]


WORKER = textwrap.dedent(
    """
    import json, sys
    from types import SimpleNamespace as NS
    from paravt.algo.guard import NonFiniteGuard
    from paravt.distributed import init_distributed, cleanup

    ctx = init_distributed("cpu")
    r = ctx.rank
    guard = NonFiniteGuard(ctx, step=3)
    t = NS(uid=f"{r}:s{r}:r0", sample_id=f"s{r}", reward=float("nan") if r == 1 else 1.0)
    ok_reward = guard.check_rewards([NS(trajectories=[t], sub_trajectories=[])])
    epochs = guard.planned_epochs(1, 2)
    # Only rank 0's loss is NaN; the grad norm (global) is finite everywhere.
    ok_loss = guard.update_is_finite(float("nan") if r == 0 else 0.5, 1.0, [t.uid])
    ok_clean = guard.update_is_finite(0.5, 1.0, [t.uid])
    res = dict(rank=r, ok_reward=ok_reward, epochs=epochs, ok_loss=ok_loss, ok_clean=ok_clean,
               metrics=guard.metrics())
    # One file per rank: two ranks' lines on one stdout pipe can interleave.
    with open(f"{sys.argv[1]}/rank{r}.json", "w") as f:
        json.dump(res, f)
    cleanup(ctx)
    """
)


def test_two_ranks_agree_when_only_one_sees_a_nan(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--standalone", str(script), str(tmp_path),
    ]  # fmt: skip
    root = str(Path(__file__).resolve().parents[1])  # this checkout's paravt, not an install
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1)]
    assert sorted(r["rank"] for r in res) == [0, 1]
    for r in res:  # both ranks skip both updates, whichever rank saw the NaN
        assert (r["ok_reward"], r["epochs"], r["ok_loss"], r["ok_clean"]) == (False, 0, False, True)
    assert (
        res[0]["metrics"]
        == res[1]["metrics"]
        == {
            "skipped_updates": 3.0,
            "nonfinite/reward": 1.0,
            "nonfinite/advantage": 0.0,
            "nonfinite/loss": 1.0,
            "nonfinite/grad_norm": 0.0,
        }
    )
    # One line each, printed by rank 0, naming rank 1's sample for the reward.
    assert proc.stdout.count("[guard] step 3:") == 2
    assert "non-finite reward in 1 trajectory: sample s1 (uid 1:s1:r0" in proc.stdout
    assert "loss nan on minibatch samples s0;" in proc.stdout
