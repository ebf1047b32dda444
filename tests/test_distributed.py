"""torchrun/FSDP2 plumbing on a tiny plain module (gloo on CPU): sharding, global loss
normalisation, full state-dict gather for checkpoints, optimizer-state reload, helpers."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torchrun import run_worker

from paravt.distributed import DistContext, all_gather_objects, all_reduce_sum, shard_list

WORKER = textwrap.dedent(
    """
    import sys, torch
    from paravt.distributed import (init_distributed, shard_model, all_reduce_sum, clip_grad_norm,
        full_state_dict, full_optimizer_state, load_full_optimizer_state, shard_list, cleanup,
        all_gather_objects)

    out = sys.argv[1]
    ctx = init_distributed("cpu")
    torch.manual_seed(0)
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))
    model = shard_model(make(), ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(7, 5)                      # same data on every rank (seeded) ...
    mask = torch.tensor([1., 1, 0, 1, 1, 1, 0])
    rows = shard_list(list(range(6)), ctx)     # ... but each rank trains its own rows
    xl, ml = x[rows], mask[rows]
    local_den = float(ml.sum())
    global_den = float(all_reduce_sum(local_den, ctx)[0])
    per_row = model(xl).square().sum(-1)
    local = (per_row * ml).sum() / local_den   # locally normalised token-mean
    (local * ctx.world_size * local_den / global_den).backward()
    gn = clip_grad_norm(list(model.parameters()), 10.0)
    opt.step()
    sd = full_state_dict(model, ctx)
    # The weight push's stream casts each shard before its gather (issue 61 item 5): every
    # all-gather moves bf16, and the values are the gathered fp32 ones cast.
    from torch.distributed.tensor import DTensor
    from paravt.distributed import full_weights
    gathered, real = [], DTensor.full_tensor
    def spy(self, *a, **k):
        gathered.append(self.dtype)
        return real(self, *a, **k)
    DTensor.full_tensor = spy
    pushed = dict(full_weights(model, torch.bfloat16))
    DTensor.full_tensor = real
    assert gathered and set(gathered) == {torch.bfloat16}, gathered
    for k, v in sd.items():
        assert torch.equal(pushed[k], v.to(torch.bfloat16)), k
    osd = full_optimizer_state(model, opt, ctx)
    n_forwards = all_gather_objects(len(rows), ctx)
    if ctx.is_main:
        torch.save({"sd": sd, "osd": osd, "gn": gn, "n": n_forwards}, out)
    # Reload the full optimizer state into a fresh sharded model (what --resume does).
    model2 = shard_model(make(), ctx)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    full = torch.load(out, weights_only=False)["osd"] if ctx.is_main else None
    from paravt.distributed import broadcast_object
    full = broadcast_object(full, ctx)
    load_full_optimizer_state(model2, opt2, full, ctx)
    again = full_optimizer_state(model2, opt2, ctx)
    if ctx.is_main:
        for k, v in full["state"].items():
            for name, t in v.items():
                assert torch.equal(torch.as_tensor(t), torch.as_tensor(again["state"][k][name])), k
        print("RELOAD_OK")
    cleanup(ctx)
    """
)


def test_fsdp2_two_ranks_equal_single_process_step(tmp_path: Path) -> None:
    out = tmp_path / "state.pt"
    proc = run_worker(tmp_path, WORKER, 2, str(out))
    assert "RELOAD_OK" in proc.stdout
    got = torch.load(out, weights_only=False)
    assert got["n"] == [3, 3]

    # The same step in one process over all six rows.
    torch.manual_seed(0)  # the worker's RNG sequence: model init, then the data
    model = torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))
    x = torch.randn(7, 5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mask = torch.tensor([1.0, 1, 0, 1, 1, 1, 0])
    per_row = model(x[:6]).square().sum(-1)
    ((per_row * mask[:6]).sum() / mask[:6].sum()).backward()
    gn = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0))
    opt.step()
    assert got["gn"] == pytest.approx(gn, rel=1e-5)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(got["sd"][k], v, rtol=1e-5, atol=1e-6)


def test_single_process_context_helpers() -> None:
    ctx = DistContext()
    assert not ctx.distributed and ctx.is_main
    assert shard_list([1, 2, 3], ctx) == [1, 2, 3]
    assert all_gather_objects({"a": 1}, ctx) == [{"a": 1}]
    assert all_reduce_sum(torch.tensor([1.5, 2.0]), ctx).tolist() == [1.5, 2.0]
    two = DistContext(rank=1, world_size=2)
    assert shard_list([1, 2, 3, 4], two) == [3, 4]
    with pytest.raises(ValueError, match="prompts_per_step a multiple of the world size"):
        shard_list([1, 2, 3], two)
