"""torchrun/FSDP2 plumbing on a tiny plain module (gloo on CPU): sharding, global loss
normalisation, full state-dict gather for checkpoints, optimizer-state reload, helpers."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torchrun import run_worker, running_nodes

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
    if ctx.mesh.ndim == 2:  # HSDP (two nodes of two ranks): sharded within, replicated across
        from torch.distributed.tensor import Replicate, Shard
        assert ctx.mesh.mesh_dim_names == ("replicate", "shard"), ctx.mesh
        assert tuple(ctx.mesh.shape) == (2, 2), ctx.mesh
        local = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
        locs = all_gather_objects(local, ctx)  # rank = node * 2 + local rank
        for n, p in model.named_parameters():
            assert tuple(p.placements) == (Replicate(), Shard(0)), (n, p.placements)
            full = p.full_tensor()
            for node in (0, 1):
                assert torch.equal(torch.cat([locs[2 * node][n], locs[2 * node + 1][n]]), full), n
            assert torch.equal(locs[0][n], locs[2][n]) and torch.equal(locs[1][n], locs[3][n]), n
            assert locs[0][n].shape[0] < full.shape[0], n
        if ctx.is_main:
            print("HSDP_OK", flush=True)
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(13, 5)                     # same data on every rank (seeded) ...
    mask = torch.tensor([1., 1, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 0])
    rows = shard_list(list(range(12)), ctx)    # ... but each rank trains its own rows
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
    # The parallel HF export (issue 61 item 4): each entry on its owner rank only, bitwise the
    # entries rank 0 gathers alone; owners in contiguous runs.
    from paravt.distributed import gathered_state_dict, spread_state_dict
    whole = gathered_state_dict(model, ctx, torch.bfloat16)
    mine, split = spread_state_dict(model, ctx, torch.bfloat16)
    owners = split.owners
    assert split.nbytes == {n: p.numel() * 2 for n, p in model.named_parameters()}, split.nbytes
    parts = all_gather_objects(mine, ctx)
    assert list(owners.values()) == sorted(owners.values()), owners
    assert all(owners[k] == r for r, part in enumerate(parts) for k in part), owners
    if ctx.is_main:
        union = {k: v for part in parts for k, v in part.items()}
        assert list(union) == list(whole) and len(whole) == 4, (list(union), list(whole))
        assert all(torch.equal(union[k], whole[k]) and union[k].dtype == torch.bfloat16
                   for k in whole)
        assert len(set(owners.values())) > 1, owners  # the writes are shared
        print("SPREAD_OK", flush=True)
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


def _single_process_step() -> tuple[torch.nn.Module, float]:
    """WORKER's step in one process over all twelve rows: the model after it, its grad norm."""
    torch.manual_seed(0)  # the worker's RNG sequence: model init, then the data
    model = torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))
    torch.manual_seed(0)
    x = torch.randn(13, 5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mask = torch.tensor([1.0, 1, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 0])
    per_row = model(x[:12]).square().sum(-1)
    ((per_row * mask[:12]).sum() / mask[:12].sum()).backward()
    gn = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0))
    opt.step()
    return model, gn


def test_fsdp2_two_ranks_equal_single_process_step(tmp_path: Path) -> None:
    out = tmp_path / "state.pt"
    proc = run_worker(tmp_path, WORKER, 2, str(out))
    assert "RELOAD_OK" in proc.stdout and "SPREAD_OK" in proc.stdout
    assert "HSDP_OK" not in proc.stdout  # one node: the 1-D mesh
    got = torch.load(out, weights_only=False)
    assert got["n"] == [6, 6]
    model, gn = _single_process_step()
    assert got["gn"] == pytest.approx(gn, rel=1e-5)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(got["sd"][k], v, rtol=1e-5, atol=1e-6)


def test_hsdp_two_nodes_shard_within_replicate_across_and_equal_the_fsdp_step(
    tmp_path: Path,
) -> None:
    """Two torchrun "nodes" of two ranks each on this host (LOCAL_WORLD_SIZE=2, gloo): the
    mesh is HSDP's 2-D (replicate across nodes, shard within), each parameter's shards are
    equal across the nodes and make the full tensor within one, and the step (the full
    state after it, the grad norm, the optimizer state's reload) equals the one-process step
    as the 1-D run's does. On main the mesh was 1-D over all four ranks (no HSDP_OK)."""
    out = tmp_path / "state.pt"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    with running_nodes(2, str(script), str(out), nprocs=[2, 2]) as procs:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    assert all(w in outs[0] for w in ("HSDP_OK", "RELOAD_OK", "SPREAD_OK")), outs[0][-3000:]
    got = torch.load(out, weights_only=False)
    assert got["n"] == [3, 3, 3, 3]
    model, gn = _single_process_step()
    assert got["gn"] == pytest.approx(gn, rel=1e-5)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(got["sd"][k], v, rtol=1e-5, atol=1e-6)


def test_uneven_nodes_are_a_clear_error() -> None:
    from paravt.distributed import train_mesh

    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE=3 does not divide WORLD_SIZE=8"):
        train_mesh("cpu", 8, 3)


def test_export_owners_are_contiguous_runs_balanced_by_bytes() -> None:
    """The parallel HF export's split (``spread_state_dict``): each rank a contiguous run of
    the entries, the runs balanced by bytes; every entry on rank 0 for one rank."""
    from paravt.distributed import export_owners

    assert export_owners([10] * 8, 4) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert export_owners([10] * 8, 1) == [0] * 8
    assert export_owners([100, 1, 1, 1], 2) == [0, 1, 1, 1]  # the big one alone on rank 0
    assert export_owners([1, 1, 100, 1], 2) == [0, 0, 1, 1]  # its midpoint is in rank 1's half
    assert export_owners([], 3) == [] and export_owners([0, 0], 2) == [0, 0]
    sizes = [int(x) for x in torch.randint(1, 1000, (200,))]
    owners = export_owners(sizes, 8)
    assert owners == sorted(owners) and set(owners) == set(range(8))
    load = [sum(b for b, r in zip(sizes, owners) if r == k) for k in range(8)]
    assert max(load) - min(load) <= 2 * max(sizes), load


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


HSDP_CUDA_WORKER = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from paravt.distributed import HSDP_DIMS

    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (1, 1), mesh_dim_names=HSDP_DIMS)  # HSDP's 2-D mesh, one rank
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3)).cuda()
    model = torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3)).cuda()
    model.load_state_dict(ref.state_dict())
    fully_shard(model, mesh=mesh)
    for p in model.parameters():
        assert tuple(p.placements) == (Replicate(), Shard(0)), p.placements
    x = torch.randn(6, 5, device="cuda")
    for m in (ref, model):
        m(x).square().sum().backward()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad.full_tensor(), b.grad, msg=n)
    print("HSDP_CUDA_OK", flush=True)
    dist.destroy_process_group()
    """
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_hsdp_mesh_of_one_rank_over_nccl_gives_the_unsharded_gradients(tmp_path: Path) -> None:
    """The GPU half of item 6 (scripts/gpu_realscale.py hsdp): FSDP2 over HSDP's 2-D mesh on
    NCCL (one rank: replicate 1 x shard 1) gives the plain module's gradients; the two-node
    part is the gloo test above."""
    script = tmp_path / "worker.py"
    script.write_text(HSDP_CUDA_WORKER)
    from torchrun import torchrun

    proc = torchrun(1, str(script))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HSDP_CUDA_OK" in proc.stdout
