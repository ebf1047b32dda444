"""How many collectives one training step runs, counted on two gloo ranks (torchrun).

A step's metrics cost one packed all-reduce of every sum and one gather of the trajectory
records (``paravt.step_stats.StepStats.reduce``); the other collectives of a step decide
something (the non-finite guard, the rank balance, a minibatch's loss denominator and
micro-batch count, whether a rank has anything to train) and are counted by where they are
called from, so a new collective anywhere in the step shows up here with its caller.

The counter wraps ``torch.distributed``'s object and reduction collectives for the duration of
``train_step`` (FSDP2's own parameter all-gathers and gradient reduce-scatters are not these
calls and are not counted) and names each call by the innermost ``paravt`` function above it
outside ``paravt/distributed.py`` (the helpers there only forward).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from assets_task import SHORT_ROLLOUT, on_assets
from torchrun import run_worker

WORKER = textwrap.dedent(
    """
    import collections, json, sys, traceback
    import torch.distributed as dist
    from paravt.config import load_config
    from paravt.distributed import init_distributed, cleanup
    from paravt.train import build_trainer, train_step

    out, overrides = sys.argv[1], sys.argv[2:]
    cfg = load_config(overrides=overrides)
    ctx = init_distributed("cpu")
    tr = build_trainer(cfg, ctx)
    counts = collections.Counter()

    def caller():
        for f in reversed(traceback.extract_stack()[:-2]):
            path = f.filename.replace("\\\\", "/")
            if "/paravt/" in path and not path.endswith("/paravt/distributed.py"):
                mod = path.rsplit("/paravt/", 1)[1][:-3].replace("/", ".")
                return f"{mod}:{f.name}"
        return "?"

    def counted(name, fn):
        def wrapper(*a, **kw):
            counts[f"{caller()} {name}"] += 1
            return fn(*a, **kw)
        return wrapper

    names = ("all_reduce", "all_gather_object", "broadcast_object_list", "scatter_object_list",
             "gather_object", "broadcast", "all_gather", "barrier")
    real = {n: getattr(dist, n) for n in names}
    for n in names:
        setattr(dist, n, counted(n, real[n]))
    m = train_step(tr, 1).metrics
    for n in names:
        setattr(dist, n, real[n])
    if ctx.is_main:
        with open(out, "w") as f:
            json.dump({"counts": counts, "num_groups": m["num_groups"]}, f)
    cleanup(ctx)
    """
)


def test_one_step_runs_one_collective_for_its_sums_and_one_gather(assets, tmp_path: Path) -> None:
    out = tmp_path / "counts.json"
    overrides = [
        *on_assets(assets, tmp_path / "run"),
        "train.prompts_per_step=2",
        "train.eval_prompts=0",
        "train.progress=false",
        "train.log_trajectories=0",
        "sft.steps=0",
        *SHORT_ROLLOUT,
        "algo.adv_bias=0.1",  # non-zero advantages: the update runs
        "algo.minibatches=2",
    ]
    run_worker(tmp_path, WORKER, 2, str(out), *overrides)
    got = json.loads(out.read_text())
    assert got["num_groups"] == 2.0  # one prompt a rank, both trained on
    counts = got["counts"]
    print(json.dumps(counts, indent=1, sort_keys=True))
    # The step's numbers: exactly one all-reduce and one gather, both in StepStats.reduce.
    metrics = {k: v for k, v in counts.items() if k.startswith("step_stats:")}
    assert metrics == {"step_stats:reduce all_reduce": 1, "step_stats:reduce all_gather_object": 1}
    # Everything else decides something; per minibatch: its loss denominator, its
    # micro-batch count (FSDP ranks run the same forwards) and the update's finiteness.
    assert counts == {
        **metrics,
        "algo.guard:_whole_step all_reduce": 2,  # rewards, advantages finite on every rank
        "algo.packing:balance_units all_gather_object": 1,  # every rank's unit costs
        "train:update_policy all_gather_object": 1 + 2,  # a rank without units; 2 minibatches
        "train:update_policy all_reduce": 2,  # the minibatches' global loss denominators
        "algo.guard:update_is_finite all_reduce": 2,
    }, counts
