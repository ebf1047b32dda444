"""Two ranks on CPU (gloo, FSDP2), as two nodes: ``torchrun --nnodes 2 --nproc-per-node 1``
twice on this host with the c10d rendezvous (the multi-node launch; one node's two ranks,
``--standalone``, is test_train_async.py's three-process run and test_distributed.py): 2
PARA-GRPO steps whose loss, gradient norm and updated weights match a single-process
computation on the same data; the ranks encode each group's prompt once
(``algo.share_prefix``), the single process every row whole.

"The same data" is taken literally: the ranks dump the packed batches they trained on
(``train.dump_batches``); the test merges both ranks' batches and recomputes, in one process
with the unsharded initial model, the step-1 loss, the pre-clip gradient norm and the weights
after one AdamW step. Tolerances: loss and grad norm 1e-4 relative (float32 reductions in a
different order); weights: Adam's update is ``lr · m / (sqrt(v) + eps)``, bounded by ``lr`` per
element, so reduction-order noise on a near-zero gradient can move an element by up to 2·lr;
we require max |Δ| <= 2·lr and fewer than 1% of elements off by more than 1e-6.

Under mixed precision (``model.dtype=bfloat16``, float32 masters: FSDP2's MixedPrecisionPolicy
on both sides, the single process on a world of one) the same comparison runs on the masters
(the checkpoint's sharded ``train_state/``, read whole) with bf16's round-off in the loss and
gradient norm (tolerances in the test).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from assets_task import SHORT_ROLLOUT, on_assets
from torchrun import lose_node, running_nodes, torchrun_nodes
from train_runs import ROOT, train_rows, wait_for

from paravt.metrics import read_metrics

LR = 1e-4


def _overrides(assets: dict[str, str], out: Path, dtype: str = "float32") -> list[str]:
    return [
        f"model.dtype={dtype}",
        *on_assets(assets, out),
        "train.steps=2",
        "train.prompts_per_step=2",
        "train.save_every=1",
        "train.keep_last=2",
        "train.eval_prompts=0",
        "train.progress=false",
        "train.summary_plot=false",
        "train.dump_batches=true",
        *SHORT_ROLLOUT,
        # One SFT step under FSDP2 too; RL then starts from out/sft (gathered full weights).
        "sft.steps=1",
        "sft.batch_size=2",
        "algo.adv_bias=0.1",  # non-zero advantages even when group rewards tie
        f"algo.lr={LR}",
        "algo.kl_coef=0.05",
        # The decoupled objective: the proximal forwards run under FSDP too (rank-balanced).
        "algo.loss=decoupled",
        "algo.behav_cap=3.0",
    ]


# bfloat16 (the GPU recipe: bf16 compute, fp32 masters under FSDP2); float32 exactness of the
# sharded step is test_distributed.py::test_fsdp2_two_ranks_equal_single_process_step.
@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_torchrun_two_ranks_match_single_process(assets, tmp_path, dtype) -> None:
    from paravt.algo.loss import agg_denominator, make_objective, policy_minibatch_backward
    from paravt.algo.packing import concat_packed
    from paravt.checkpoint import load_model_state, read_train_state
    from paravt.config import load_config
    from paravt.distributed import (
        DistContext,
        Precision,
        cleanup,
        clip_grad_norm,
        full_state_dict,
        shard_model,
    )
    from paravt.models import load_model

    out = tmp_path / "run"
    nodes = torchrun_nodes(2, "-m", "paravt.train", *_overrides(assets, out, dtype), timeout=600)
    for node, (rc, text) in enumerate(nodes):
        assert rc == 0, f"node {node}:\n{text[-4000:]}"
    # The reference model is sharded over the two ranks like the policy (algo.ref_placement's
    # auto), and its log-probs are the replica's (tests/test_reference_placement.py).
    assert "[train] reference model: shard (auto: 2 trainer ranks)" in nodes[0][1]

    rows = {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"}
    assert sorted(rows) == [1, 2]
    assert rows[1]["num_groups"] == 2.0  # one prompt per rank, both counted
    dumps = [torch.load(out / "debug" / f"step1_rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert all(d["world_size"] == 2 for d in dumps)
    # The two ranks rolled out different prompts (the step's prompts were split, not copied);
    # units may then have moved between ranks to even out tokens (algo.balance_ranks), each
    # trained exactly once.
    uids = [u for d in dumps for u in d["batches"][0].uids]
    assert len(uids) == len(set(uids)) and len({u.split(":")[1] for u in uids}) == 2
    # The cost balanced is a rank's rows with each group's prompt counted once.
    from paravt.models.prefix import shared_rows

    tokens = [shared_rows(b, range(len(b.uids))) for b in (d["batches"][0] for d in dumps)]
    print({k: v for k, v in rows[1].items() if k.startswith("balance/")}, tokens)
    assert rows[1]["balance/max_over_mean_after"] <= rows[1]["balance/max_over_mean_before"]
    assert max(tokens) / (sum(tokens) / 2) == pytest.approx(
        rows[1]["balance/max_over_mean_after"], rel=1e-6
    )

    # Single process, same data, unsharded initial weights (float32 masters; under bf16
    # compute, FSDP2's mixed precision on a world of one, as the one-process trainer runs).
    cfg = load_config(overrides=_overrides(assets, out, dtype))
    prec = Precision.from_config(cfg)
    batch = concat_packed([d["batches"][0] for d in dumps])
    # The ranks encoded each group's prompt once (algo.share_prefix, the default); the single
    # process runs every row whole: the shared forwards on two ranks must equal it.
    from paravt.models.prefix import prefix_groups

    assert len(prefix_groups(batch, range(len(batch.uids)))) == 2
    batch.group_ids = None
    model = load_model(out / "sft", device="cpu").model  # the RL starting point
    if cfg.algo.freeze_vision_tower:  # as the trainer does (the tiny preset freezes it)
        from paravt.models.loader import freeze_vit

        freeze_vit(model)
    ctx = DistContext()
    shard_model(model, ctx, prec)
    obj = make_objective(cfg.algo)
    den = agg_denominator(obj.effective_mask(batch), batch, cfg.algo.agg)

    # bf16: the two ranks' gradients are bf16 partial sums reduced in float32, the single
    # process's one bf16 sum; float32: summation order only. Measured: bf16 loss equal to 6
    # digits, grad norm 2.3e-5 relative; 0.18% of the masters off by > 1e-6 (all <= 2 lr).
    rel = 1e-4 if dtype == "float32" else 1e-3
    try:
        res = policy_minibatch_backward(
            model, batch, obj, global_den=den, max_tokens=cfg.algo.max_tokens_per_microbatch
        )
        params = [p for p in model.parameters()]
        gnorm = clip_grad_norm([p for p in params if p.grad is not None], cfg.algo.max_grad_norm)
        torch.optim.AdamW(params, lr=LR, weight_decay=cfg.algo.weight_decay).step()
        mine = full_state_dict(model, ctx)
    finally:
        cleanup(ctx)  # the group of one (mixed precision) never outlives the test
    assert res.loss_num / den == pytest.approx(rows[1]["loss"], rel=rel)
    assert gnorm == pytest.approx(rows[1]["grad_norm"], rel=rel)

    ckpt = out / "checkpoints" / "step_000001"
    after = load_model_state(ckpt)
    if prec.mixed:  # the trained weights are the masters; the export is their bf16 cast
        masters = read_train_state(ckpt)["masters"]  # the two ranks' shards, whole
        assert all(torch.equal(after[k], v.to(torch.bfloat16)) for k, v in masters.items())
        after = masters
    worst, off = 0.0, 0
    total = 0
    for k, v in mine.items():
        d = (v - after[k]).abs()
        worst = max(worst, float(d.max()))
        off += int((d > 1e-6).sum())
        total += d.numel()
    print(
        f"{dtype}: loss {res.loss_num / den:.6g} vs {rows[1]['loss']:.6g}, grad norm "
        f"{gnorm:.6g} vs {rows[1]['grad_norm']:.6g}, weights: max |d| {worst:.3g}, "
        f"{off}/{total} off by > 1e-6"
    )
    assert worst <= 2 * LR + 1e-7
    assert off < 0.01 * total, f"{off}/{total} weights differ by > 1e-6"


def test_lost_node_is_named_in_one_line(assets, tmp_path) -> None:
    """Two nodes training synchronously (FSDP2 over both); node 1 is lost mid-run (its agent
    and rank SIGKILLed). Rank 0's next collective fails at once: it exits 1 within 60 s with
    one ``error:`` line naming the lost peer and the checkpoint ``--resume`` continues from,
    not the collective's traceback."""
    out = tmp_path / "run"
    args = [a for a in _overrides(assets, out) if not a.startswith(("train.steps", "sft.steps"))]
    args += ["train.steps=40", "sft.steps=0", "train.dump_batches=false"]
    with running_nodes(2, "-m", "paravt.train", *args, cwd=ROOT) as (first, second):
        rows = out / "metrics.jsonl"
        wait_for(lambda: rows.exists() and 2 in train_rows(out), first, "step 2's row", 180)
        rest, took = lose_node(first, second)
    assert first.returncode != 0
    assert took < 60, took
    m = re.search(
        r"error: rank 0 lost a peer rank of the job .*--resume continues from (\S+)", rest
    )
    assert m, rest[-3000:]
    assert re.search(r"step_0000\d\d$", m.group(1)), m.group(1)
    assert "paravt/train.py" not in rest, rest[-3000:]  # no traceback of ours
