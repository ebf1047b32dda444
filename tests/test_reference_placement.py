"""Where the frozen reference model lives (``algo.ref_placement``, issue 51 item 3) and the
device cache released between a step's phases.

* ``shard`` (FSDP2 over the trainer ranks, the default on several ranks) and ``offload``
  (sharded, in host memory) give the replica's log-probs bitwise, on two gloo ranks, on a
  real packed batch (the scripted tiny-model step: main rows with their video, sub-agent rows
  with their crops), while each rank holds half of the parameters;
* ``build_trainer`` places it as ``paravt.plan.reference_placement`` says, and a step with an
  offloaded reference on one process trains on the same reference log-probs as a replica;
* ``train_step`` releases the device cache after the rollout and before the weight push
  (``train.empty_cache``), and not when it is off;
* on CUDA (scripts/gpu_check.sh): the release hands the update's cached blocks back, and an
  offloaded reference keeps nothing on the device between passes.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from scripted_engine import captured_update_batch, own_score, scripted_trainer
from torchrun import torchrun

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from paravt.algo.reference import ReferencePolicy
    from paravt.distributed import cleanup, init_distributed, place_reference
    from paravt.models import load_model

    model_dir, batch_file, out = sys.argv[1:4]
    ctx = init_distributed("cpu")
    batch = torch.load(batch_file, weights_only=False)
    res = {}
    for where in ("replicate", "shard", "offload"):
        ref = ReferencePolicy(load_model(model_dir, device="cpu").model)
        place_reference(ref.model, ctx, where)
        lp = ref.logprobs(batch)
        local = sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() for p in ref.model.parameters()
        )
        total = sum(p.numel() for p in ref.model.parameters())
        res[where] = {"local": local, "total": total}
        torch.save(lp, f"{out}/{where}_rank{ctx.rank}.pt")
    if ctx.rank == 0:
        json.dump(res, open(f"{out}/sizes.json", "w"))
    cleanup(ctx)
    """
)


@pytest.fixture(scope="module")
def packed_batch(assets, tmp_path_factory) -> Path:
    """A real packed batch (the scripted step's, video and crops), saved for the ranks."""
    root = tmp_path_factory.mktemp("refplace")
    tr = scripted_trainer(assets, str(root / "run"), own_score, **{"algo.kl_coef": 0.0})
    path = root / "batch.pt"
    torch.save(captured_update_batch(tr), path)
    return path


def test_shard_and_offload_equal_the_replica_on_two_ranks(assets, packed_batch, tmp_path):
    script = tmp_path / "ref.py"
    script.write_text(SCRIPT)
    r = torchrun(2, str(script), assets["model"], str(packed_batch), str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in (0, 1):
        rep = torch.load(tmp_path / f"replicate_rank{rank}.pt")
        assert (rep != 0).any()
        for where in ("shard", "offload"):
            assert torch.equal(torch.load(tmp_path / f"{where}_rank{rank}.pt"), rep), where
    sizes = json.loads((tmp_path / "sizes.json").read_text())
    total = sizes["replicate"]["total"]
    assert sizes["replicate"]["local"] == total
    for where in ("shard", "offload"):  # rank 0's share: half (FSDP2 pads dim 0 to even)
        assert sizes[where]["local"] <= total / 2 + 4096, (where, sizes)


def test_build_trainer_places_it_and_an_offloaded_one_trains_on_the_same_values(assets, tmp_path):
    from paravt.distributed import is_sharded, release_single_rank_group

    kl = {"algo.kl_coef": 0.05}
    rep = scripted_trainer(assets, str(tmp_path / "rep"), own_score, **kl)
    assert not is_sharded(rep.reference.model)  # auto, one CPU rank: a replica
    b_rep = captured_update_batch(rep)
    try:
        off = scripted_trainer(
            assets, str(tmp_path / "off"), own_score, **kl, **{"algo.ref_placement": "offload"}
        )
        assert is_sharded(off.reference.model)
        assert all(p.device.type == "cpu" for p in off.reference.model.parameters())
        b_off = captured_update_batch(off)
    finally:
        release_single_rank_group()  # offload on one rank made a group of one
    assert b_rep.uids == b_off.uids and b_rep.ref_logprobs is not None
    assert (b_rep.ref_logprobs != 0).any()
    assert torch.equal(b_rep.ref_logprobs, b_off.ref_logprobs)


@pytest.mark.parametrize("on", [True, False])
def test_the_step_releases_the_cache_after_the_rollout_and_before_the_push(
    assets, tmp_path, monkeypatch, on
):
    import paravt.train as train_mod

    tr = scripted_trainer(
        assets, str(tmp_path / "run"), own_score, **{"algo.kl_coef": 0.0, "train.empty_cache": on}
    )
    events: list[str] = []
    real_release = train_mod.release_device_cache
    monkeypatch.setattr(
        train_mod, "release_device_cache", lambda d: events.append("release") or real_release(d)
    )
    for name in ("collect", "publish"):
        real = getattr(tr.source, name)
        monkeypatch.setattr(
            tr.source, name, lambda *a, _n=name, _r=real, **k: events.append(_n) or _r(*a, **k)
        )
    real_update = train_mod.update_policy
    monkeypatch.setattr(
        train_mod, "update_policy", lambda *a, **k: events.append("update") or real_update(*a, **k)
    )
    m = train_mod.train_step(tr, 1).metrics
    if on:
        assert events == ["collect", "release", "update", "release", "publish"]
    else:
        assert events == ["collect", "update", "publish"]
    assert m["mem/cache_released_gib"] == 0.0  # nothing to release off CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_release_hands_back_the_cached_blocks_and_offload_holds_nothing(tmp_path):
    from paravt.algo.reference import ReferencePolicy
    from paravt.distributed import (
        DistContext,
        place_reference,
        release_device_cache,
        release_single_rank_group,
    )
    from paravt.models import build_tiny_checkpoint, load_model

    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.empty(256 << 20, dtype=torch.uint8, device=dev)  # 256 MiB, then freed
    del x
    assert torch.cuda.memory_reserved(dev) >= 256 << 20
    assert release_device_cache(dev) >= 256 << 20
    ctx = DistContext(device=dev)
    try:
        tiny = build_tiny_checkpoint(tmp_path / "tiny")  # no video data: the image may lack PyAV
        ref = ReferencePolicy(load_model(tiny, device="cpu").model)
        before = torch.cuda.memory_allocated(dev)
        place_reference(ref.model, ctx, "offload")
        assert torch.cuda.memory_allocated(dev) == before  # its shards stay on the host
        assert all(p.device.type == "cpu" for p in ref.model.parameters())
    finally:
        release_single_rank_group()
