"""torchrun + FSDP2 plumbing: process group, sharding, rollout splitting, collectives.

``python -m paravt.train`` runs single-process; ``torchrun --nproc-per-node N -m paravt.train``
(and multi-node with the usual ``--nnodes/--rdzv-endpoint`` rendezvous) runs N ranks:

* backend: NCCL on CUDA, gloo on CPU (the CPU path is what the tests exercise);
* the policy is sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``): each decoder /
  vision block is its own FSDP unit, then the root; gradients are reduce-scattered and
  *averaged* over ranks, so a rank's local loss must be scaled by ``world * local/global``
  normalisers to equal the single-process loss (see ``paravt.algo.loss``); over several
  nodes the mesh is 2-D (HSDP, ``train_mesh``: sharded within a node, replicated across);
* prompts of a step are split across ranks (``shard_list``) — each rank rolls out its own
  prompts' groups (a group never straddles ranks, so group-relative advantages stay local);
* after advantages are known, whole units (a main row and its sub-agent rows) move between
  ranks so that every rank's share of each minibatch has about the same number of tokens
  (``balance_buckets``; ``algo.balance_ranks``);
* metrics are reduced on rank 0 from gathered per-trajectory records.

Single-process runs use the same code with ``world_size == 1`` and no process group, except
under mixed precision (``Precision``: fp32 masters, bf16 compute), which is FSDP2's
``MixedPrecisionPolicy`` on every world size — on one process a world of one
(``single_rank_mesh``), so that one rank and N ranks compute alike.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from paravt.config import REF_PLACEMENTS

T = TypeVar("T")

# Seconds without the GIL at exit for gloo worker threads to drop their last works (cleanup).
_EXIT_GRACE_S = 0.5


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str = ""
    mesh: Any = None  # torch.distributed.DeviceMesh when world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


# Config dtype names (model.dtype, train.master_dtype) -> torch dtypes; the loader uses it too.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """The trained weights' dtype (``master``: the parameters AdamW updates, and its moments)
    and the dtype forward and backward compute in (``compute``: ``model.dtype``, also the
    reference model's and the rollout engine's copy, the weight push and the HF export).

    ``mixed`` (master != compute, e.g. fp32 masters under bf16 compute, the 8B recipe):
    ``shard_model`` applies FSDP2's ``MixedPrecisionPolicy(param_dtype=compute,
    reduce_dtype=float32)`` over the master-dtype parameters — each unit's parameters are
    cast to ``compute`` when it is gathered, its gradients come back in float32 to the
    float32 sharded parameters, and AdamW steps there. Why: an AdamW step moves a weight by
    about the lr; at lr 2e-6 and a weight of 0.02, half a bf16 ulp is ~6e-5, so a bf16 weight
    keeps almost none of its updates (issue 33: 3.8% of a 4096x4096 bf16 weight moved at all
    in 10 steps against 9.1% of the bf16 casts of an fp32 copy).
    """

    master: torch.dtype = torch.float32
    compute: torch.dtype = torch.float32

    @property
    def mixed(self) -> bool:
        return self.master != self.compute

    @classmethod
    def from_config(cls, cfg: Any) -> Precision:
        """``train.master_dtype`` over ``model.dtype`` (names checked by ``paravt.config``)."""
        return cls(master=DTYPES[cfg.train.master_dtype], compute=DTYPES[cfg.model.dtype])


def world_size_from_env() -> int:
    """The world size torchrun announces (1 when not launched by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_device(pref: str, local_rank: int = 0) -> torch.device:
    """'auto' → cuda:<local_rank> when CUDA is available, else cpu; explicit names kept."""
    if pref == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if pref == "cuda":
        return torch.device(f"cuda:{local_rank}")
    return torch.device(pref)


def init_distributed(device: str = "auto", hsdp: bool = True) -> DistContext:
    """Join the torchrun process group if launched by torchrun; otherwise a 1-rank context.
    ``hsdp`` (``train.hsdp``): over several nodes the mesh is HSDP's 2-D one (``train_mesh``)."""
    world = world_size_from_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if world <= 1:
        return DistContext(device=torch.device(dev))
    backend = "nccl" if torch.device(dev).type == "cuda" else "gloo"
    if torch.device(dev).type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    world_n = dist.get_world_size()
    mesh = train_mesh(torch.device(dev).type, world_n, ranks_per_node(world_n) if hsdp else world_n)
    return DistContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=torch.device(dev),
        backend=backend,
        mesh=mesh,
    )


#: The dimension names of the trainers' 2-D mesh across nodes (HSDP, ``train_mesh``).
HSDP_DIMS = ("replicate", "shard")


def ranks_per_node(world: int | None = None) -> int:
    """Ranks per node: torchrun's ``LOCAL_WORLD_SIZE`` (the whole world when unset)."""
    world = world_size_from_env() if world is None else world
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))


def train_mesh(device_type: str, world: int, per_node: int) -> Any:
    """The device mesh FSDP2 shards the policy over (``init_distributed``, then
    ``shard_model``). One node (``per_node >= world``) or one rank per node: 1-D over every
    rank (FSDP). Several nodes of several ranks (torchrun's ``LOCAL_WORLD_SIZE``): HSDP, 2-D ``(nodes, per_node)`` named ``HSDP_DIMS``, parameters sharded within
    a node and replicated across nodes, so a step's all-gathers and reduce-scatters stay on
    the node's fabric and only one gradient all-reduce per shard crosses nodes
    (``paravt.plan``'s ``cross_node_gb``; ~66 GB a 16k-token micro-batch over 2 nodes' 1-D
    mesh at 8B)."""
    from torch.distributed.device_mesh import init_device_mesh

    if per_node <= 1 or per_node >= world:  # one node, or one rank a node: nothing to keep local
        return init_device_mesh(device_type, (world,))
    if world % per_node:
        raise ValueError(
            f"LOCAL_WORLD_SIZE={per_node} does not divide WORLD_SIZE={world}: HSDP shards within "
            "a node and needs the same number of ranks on every node; start every node with "
            "the same torchrun --nproc-per-node"
        )
    return init_device_mesh(device_type, (world // per_node, per_node), mesh_dim_names=HSDP_DIMS)


# The process group of one that ``single_rank_mesh`` started (torn down by ``cleanup``).
_OWN_GROUP: list[bool] = [False]


def single_rank_mesh(device: torch.device) -> Any:
    """A device mesh of one rank for FSDP2 in a single process (mixed precision without
    torchrun): a process group of one over an in-memory store, started here unless one
    exists (``cleanup`` destroys the one started here)."""
    from torch.distributed.device_mesh import init_device_mesh

    if device.type == "cuda":  # FSDP2 places the shards on the CURRENT device, not cuda:N's
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        _OWN_GROUP[0] = True
    return init_device_mesh(device.type, (1,))


def release_single_rank_group() -> None:
    """Destroy the group of one ``single_rank_mesh`` started, if it is still up (a run that
    raised before its ``cleanup``): callers' ``finally``, so that a failed run neither exits
    with a live gloo group nor leaves it to the next run in the same process."""
    if _OWN_GROUP[0]:
        _OWN_GROUP[0] = False
        if dist.is_initialized():
            dist.destroy_process_group()


def cleanup(ctx: DistContext, *closers: Callable[[], None]) -> None:
    """Leave the process group so that the process can exit cleanly.

    ``closers`` (e.g. the rollout engine's ``close``) run after the last collective and before
    the group is destroyed: an in-process vLLM engine tears down its own groups, which are
    sub-groups of this one, and then destroys the default group itself (so it may already be
    gone afterwards). Left to its exit-time finalizer, that teardown would find the groups
    destroyed and print a traceback on every rank.

    Gloo's worker threads drop each finished collective's work object a moment after the
    caller sees it complete; the last reference to a tensor that Python has seen needs the GIL
    to be released. If the interpreter is already finalising at that moment the thread is
    killed inside a destructor and the rank dies with SIGABRT ("terminate called without an
    active exception", pytorch/pytorch#115388) after its work is done, failing the torchrun
    job. Measured: 1 in ~15 two-rank CPU runs under load. The GIL-free pause after the process
    group is shut down lets those threads finish while the interpreter is still alive (0 in 60
    under the same load).
    """
    if ctx.distributed and dist.is_initialized():
        dist.barrier()
    for close in closers:
        close()
    if ctx.distributed:
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
        time.sleep(_EXIT_GRACE_S)
    elif _OWN_GROUP[0]:  # single_rank_mesh's group of one (gloo's threads: see above)
        release_single_rank_group()
        gc.collect()


#: What a collective raises when a peer process is gone: gloo's socket to it closed or reset
#: (a ``RuntimeError``, at once), NCCL's remote error; and the rendezvous store's network error.
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "ncclRemoteError",
    "remote process exited",
)


def peer_lost(e: BaseException) -> bool:
    """True when ``e`` says another rank of the job is gone (its process or its node died)
    rather than that this rank's own work failed: ``paravt.train.main`` then prints one line
    naming it, not the collective's traceback."""
    if isinstance(e, dist.DistNetworkError):
        return True
    return isinstance(e, RuntimeError) and any(s in str(e) for s in _PEER_LOST)


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def shard_list(items: list[T], ctx: DistContext) -> list[T]:
    """This rank's contiguous share of ``items`` (len must be divisible by the world size)."""
    if len(items) % ctx.world_size:
        raise ValueError(
            f"cannot split {len(items)} items over {ctx.world_size} ranks evenly; make "
            "train.prompts_per_step a multiple of the world size"
        )
    n = len(items) // ctx.world_size
    return items[ctx.rank * n : (ctx.rank + 1) * n]


def all_gather_objects(obj: T, ctx: DistContext) -> list[T]:
    """Every rank's ``obj`` in rank order (pickled over the process group)."""
    if not ctx.distributed:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: T, ctx: DistContext, src: int = 0) -> T:
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def balanced_assignment(costs: Sequence[Sequence[float]]) -> list[list[int]]:
    """Where each item should train: ``out[r][i]`` is the destination rank of item ``i`` of
    rank ``r``, given every rank's item costs (``costs[r][i]`` > 0).

    Longest-processing-time greedy: items by decreasing cost (ties: lower origin rank, then
    index), each to the least-loaded rank (ties: its own rank, then the lowest). Its largest
    load is at most 4/3 of the optimum (Graham 1969). The current placement is kept when LPT
    does not lower the largest load (nothing moves for nothing), or when some rank would be
    left without an item. Deterministic: every rank computes the same answer from the same
    gathered costs.
    """
    world = len(costs)
    stay = [[r] * len(c) for r, c in enumerate(costs)]
    before = max((sum(c) for c in costs), default=0.0)
    items = sorted(
        ((float(c), r, i) for r, cs in enumerate(costs) for i, c in enumerate(cs)),
        key=lambda x: (-x[0], x[1], x[2]),
    )
    if len(items) < world:
        return stay
    load = [0.0] * world
    count = [0] * world
    out = [[r] * len(c) for r, c in enumerate(costs)]
    for c, r, i in items:
        dest = min(range(world), key=lambda d: (load[d], d != r, d))
        out[r][i] = dest
        load[dest] += c
        count[dest] += 1
    if max(load) >= before or min(count) == 0:
        return stay
    return out


def balance_buckets(
    buckets: list[list[T]],
    cost: Callable[[T], float],
    ctx: DistContext,
    portable: Callable[[T], T] | None = None,
) -> tuple[list[list[T]], dict[str, float]]:
    """Move items between ranks so that, bucket by bucket, every rank holds about the same
    total ``cost`` (``balanced_assignment``).

    The trainer's path (``paravt.train.train_step``, ``algo.balance_ranks``): the buckets are a
    rank's minibatches of ``SequenceUnit`` (a main row and its sub-agent rows, advantages
    already computed) and the cost is their token count. Rollouts differ in length (tool
    calls, sub-agents, answers), so without this the rank with the longest rollouts sets the
    pace of every optimizer step while the others wait in FSDP's collectives. A bucket's set
    of items over all ranks is unchanged (the same global minibatch, so the same optimizer
    step: the loss is normalised globally); only where each item trains changes. Items that
    move are pickled with everything they carry (token ids, log-probs, pixels) and sent to
    their rank in one scatter per source rank, after ``portable`` (the trainer's:
    ``SequenceUnit.portable``, CPU tensors in storage of their own; pickling a view would send
    the whole batch it views); items that stay are not copied. A rank's bucket comes back
    ordered by (origin rank, origin index).

    Nothing moves when the ranks hold different numbers of buckets or an empty bucket (a rank
    whose rollouts all failed; the trainer then skips the update). Returns the new buckets
    and ``balance/*`` metrics (none on one rank): the largest rank's cost over the mean,
    before and after, and the number of items that moved (over all ranks).
    """
    if not ctx.distributed:
        return buckets, {}
    costs = [[float(cost(x)) for x in b] for b in buckets]
    every = all_gather_objects(costs, ctx)  # every[rank][bucket][item]

    def stats(after: list[float], moved: int) -> dict[str, float]:
        def imbalance(loads: list[float]) -> float:
            mean = sum(loads) / len(loads)
            return max(loads) / mean if mean > 0 else 1.0

        return {
            "balance/max_over_mean_before": imbalance(before),
            "balance/max_over_mean_after": imbalance(after),
            "balance/moved": float(moved),
        }

    before = [sum(sum(b) for b in c) for c in every]
    if len({len(c) for c in every}) != 1 or any(not b for c in every for b in c):
        return buckets, stats(before, 0)
    plans = [balanced_assignment([c[j] for c in every]) for j in range(len(buckets))]
    after = [0.0] * ctx.world_size
    for j, plan in enumerate(plans):
        for r, dests in enumerate(plan):
            for i, d in enumerate(dests):
                after[d] += every[r][j][i]
    outbox: list[list[tuple[int, int, int, T]]] = [[] for _ in range(ctx.world_size)]
    kept: list[list[tuple[int, int, T]]] = [[] for _ in buckets]
    for j, b in enumerate(buckets):
        for i, (item, d) in enumerate(zip(b, plans[j][ctx.rank])):
            if d == ctx.rank:
                kept[j].append((ctx.rank, i, item))
            else:
                outbox[d].append((j, ctx.rank, i, portable(item) if portable else item))
    moved = sum(d != r for plan in plans for r, ds in enumerate(plan) for d in ds)
    if moved:
        for src in range(ctx.world_size):
            box: list[Any] = [None]
            dist.scatter_object_list(box, outbox if ctx.rank == src else None, src=src)
            for j, r, i, item in box[0]:
                kept[j].append((r, i, item))
    out = [[item for _, _, item in sorted(k, key=lambda x: (x[0], x[1]))] for k in kept]
    return out, stats(after, moved)


def all_reduce_sum(x: float | torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum over ranks (float64 on CPU for gloo portability; returns a CPU tensor)."""
    t = torch.as_tensor(x, dtype=torch.float64).detach().clone().reshape(-1)
    if ctx.distributed:
        t = t.to(ctx.device if ctx.backend == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu()


def all_reduce_max(x: float | Sequence[float] | torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Element-wise maximum over ranks (float64; returns a CPU tensor). Every rank gets the
    same values, so a decision computed from them is the same on every rank."""
    t = torch.as_tensor(x, dtype=torch.float64).detach().clone().reshape(-1)
    if ctx.distributed:
        t = t.to(ctx.device if ctx.backend == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu()


def block_classes(model: torch.nn.Module) -> tuple[type, ...]:
    """Transformer block classes to wrap as FSDP units: HF ``_no_split_modules`` if declared,
    else the element type of every ``nn.ModuleList`` (decoder layers, vision blocks)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    classes: set[type] = set()
    for m in model.modules():
        if names and type(m).__name__ in names:
            classes.add(type(m))
        elif not names and isinstance(m, torch.nn.ModuleList):
            classes.update(type(c) for c in m)
    return tuple(classes)


def shard_model(
    model: torch.nn.Module,
    ctx: DistContext,
    precision: Precision | None = None,
    *,
    offload: bool = False,
) -> torch.nn.Module:
    """FSDP2-shard ``model`` in place (each block, then the root): on several ranks, and on
    one under mixed precision (``precision.mixed``: the model holds ``precision.master``
    parameters, each unit computes in ``precision.compute``, gradients reduce in float32;
    ``single_rank_mesh``). Otherwise (one rank, one dtype) a no-op. The trainer's and the
    SFT's policy go through here (``paravt.train.build_trainer``, ``paravt.sft.run_sft``),
    and the reference model placed ``shard`` or ``offload`` (``place_reference``).

    ``offload``: the shards live in host memory (FSDP2's ``CPUOffloadPolicy``, pinned on
    CUDA) and each unit is copied to the device when it is gathered; sharded on one rank too.

    Tied parameters (lm_head ↔ embeddings) stay in the root unit, which owns both modules.
    """
    mixed = precision is not None and precision.mixed
    if not ctx.distributed and not mixed and not offload:
        return model
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = ctx.mesh if ctx.distributed else single_rank_mesh(ctx.device)
    mp = MixedPrecisionPolicy()
    if mixed and precision is not None:  # (mixed implies it; said for the type checker)
        mp = MixedPrecisionPolicy(param_dtype=precision.compute, reduce_dtype=torch.float32)
    kw: dict[str, Any] = {"mesh": mesh, "mp_policy": mp}
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")
    classes = block_classes(model)
    for m in list(model.modules()):
        if m is not model and classes and isinstance(m, classes):
            fully_shard(m, **kw)
    fully_shard(model, **kw)
    return model


def place_reference(model: torch.nn.Module, ctx: DistContext, placement: str) -> torch.nn.Module:
    """Place the frozen reference model (``paravt.algo.reference.ReferencePolicy``, built by
    ``paravt.train.build_trainer``) as ``placement`` says, in place:

    * ``replicate``: a full copy on every rank's device (``P·b_c`` each);
    * ``shard``: FSDP2-sharded over the trainer ranks like the policy, in its one (compute)
      dtype (``P·b_c/N`` each, plus the units being run); on one rank the same as replicate;
    * ``offload``: sharded (on one rank too) with the shards in host memory; each unit is
      copied to the device while it runs (nothing resident on the device).

    The log-prob pass (``packed_logprobs``) runs a sharded model as its root unit's forward
    and reshards it after a no-grad pass (``paravt.models.forward.as_root_forward``): the
    values equal the replica's (tests/test_reference_placement.py)."""
    if placement not in REF_PLACEMENTS[1:]:
        raise ValueError(
            f"reference placement {placement!r}: expected one of {REF_PLACEMENTS[1:]} "
            "(algo.ref_placement=auto is resolved by paravt.plan.reference_placement)"
        )
    if placement == "replicate" or (placement == "shard" and not ctx.distributed):
        return model.to(ctx.device)
    return shard_model(model, ctx, None, offload=placement == "offload")


def release_device_cache(device: torch.device) -> int:
    """Return the CUDA caching allocator's cached-but-free blocks to the driver
    (``torch.cuda.empty_cache``); the bytes released. 0, and nothing done, off CUDA.

    Why: after the update PyTorch keeps its peak reserved (activations, gathered units,
    gradients: ~35 GiB at 8B) although nothing uses it, and the colocated vLLM engine's wake
    allocates outside PyTorch's allocator: the first wake after an update would OOM. Called
    between phases by ``paravt.train.train_step`` (after the rollout, once the engine sleeps;
    after the update, before the weight push) when ``train.empty_cache`` is on, and between
    the staged wake's weight load and its KV cache (``paravt.engines.vllm.VLLMEngine``)."""
    if device.type != "cuda":
        return 0
    before = torch.cuda.memory_reserved(device)
    torch.cuda.empty_cache()
    return int(before - torch.cuda.memory_reserved(device))


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``shard_model`` wrapped ``model`` (its state dict then holds DTensors)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state_dict(model: torch.nn.Module, ctx: DistContext) -> dict[str, torch.Tensor]:
    """The unsharded state dict on CPU, in the parameters' (master) dtype (complete on rank 0;
    empty on other ranks when sharded)."""
    if not is_sharded(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # (typed as any state-dict value; a model's full state dict holds tensors only)
    return cast("dict[str, torch.Tensor]", get_model_state_dict(model, options=opts))


def cast_floats(
    state: dict[str, torch.Tensor], dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """``state`` with its floating-point tensors in ``dtype`` (None: unchanged): the masters
    cast to the compute dtype for the SFT's HF export (``paravt.sft``; the trainer's
    checkpoints cast shard by shard, ``gathered_state_dict``)."""
    if dtype is None:
        return state
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


def full_weights(
    model: torch.nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's full (unsharded) state dict, one ``(name, tensor)`` at a time, on the rank's
    device: what the trainer streams into each rank's rollout engine after an update
    (``paravt.rollout_source.push_weights``, the asynchronous workers' ``RolloutPipeline.publish``).
    ``dtype``: floating-point entries cast to it (the compute dtype the engines hold, from
    float32 masters), one entry at a time, each shard before its gather (half the bytes of
    gathering fp32 masters). Under FSDP2 each sharded entry is all-gathered only
    when the consumer asks for it (``DTensor.full_tensor``), so the extra memory is one
    tensor, not a second full copy of the model; every rank must consume the stream to its
    end, in the same order (each entry is a collective). On one rank: the detached state dict
    entries.
    """
    for name, t in model.state_dict().items():
        t = t.detach()
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            # Cast before the gather: a DTensor casts its local shard, so the all-gather moves
            # compute-dtype bytes (half of fp32 masters'); the same values (a cast is per
            # element).
            t = t.to(dtype)
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        yield name, t


def full_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext
) -> dict[str, Any]:
    """The unsharded optimizer state keyed by parameter name (complete on rank 0)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=is_sharded(model))
    return get_optimizer_state_dict(model, optimizer, options=opts)


def load_full_optimizer_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    ctx: DistContext,
) -> None:
    """Load a ``full_optimizer_state`` dict (every rank passes the same full dict)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    set_optimizer_state_dict(
        model, optimizer, state, options=StateDictOptions(full_state_dict=True)
    )
    if not is_sharded(model):
        # Unsharded, AdamW keeps the given tensors as they are: those of a memory-mapped
        # trainer_state.pt (paravt.checkpoint.load_trainer_state) would stay mapped from a
        # checkpoint that keep_last later deletes. Sharded states are copied into DTensors.
        for st in optimizer.state.values():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    st[k] = v.clone()


def gathered_state_dict(
    model: torch.nn.Module, ctx: DistContext, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The full state dict on rank 0's CPU with floating-point entries in ``dtype`` (None:
    the parameters' own), empty on the other ranks (``spread_state_dict`` with every entry
    owned by rank 0): the HF export of a one-rank checkpoint
    (``paravt.checkpoint.Checkpointer.save``: the compute-dtype cast of the masters).

    Gathered one entry at a time, each cast on its shards before it is all-gathered, so that no
    rank ever holds the full model in the master dtype (under fp32 masters and bf16 compute,
    rank 0 holds the bf16 copy it exports, plus one entry in flight). Every rank must call it
    (each sharded entry is a collective). Names as ``full_state_dict``'s.
    """
    return _gather_entries(model, ctx, dtype, lambda sizes: [0] * len(sizes))[0]


@dataclass(frozen=True)
class ExportSplit:
    """Which rank writes each entry of an export spread over the ranks
    (``spread_state_dict``), each entry's bytes and the dtypes as written: the same on
    every rank."""

    owners: dict[str, int]
    nbytes: dict[str, int]
    dtypes: frozenset[torch.dtype]


def export_owners(sizes: Sequence[int], world: int) -> list[int]:
    """The rank that writes each entry of an export spread over ``world`` ranks
    (``spread_state_dict``): contiguous runs of the entries in order (so each rank's file holds
    neighbouring layers, as an HF shard does), balanced by bytes: an entry goes to the rank
    whose equal share of the total holds the entry's midpoint."""
    total, acc, out = max(sum(sizes), 1), 0, []
    for b in sizes:
        out.append(min(world - 1, int((2 * acc + b) * world // (2 * total))))
        acc += b
    return out


def spread_state_dict(
    model: torch.nn.Module, ctx: DistContext, dtype: torch.dtype | None = None
) -> tuple[dict[str, torch.Tensor], ExportSplit]:
    """The full state dict spread over the ranks for a parallel HF export (issue 61 item 4:
    ``paravt.checkpoint`` under several ranks writes one safetensors file per rank instead of
    rank 0 gathering and writing the whole model alone): ``(this rank's entries on its CPU,
    the split)``, each entry's owner from ``export_owners`` (the same on every rank: global
    shapes). Each entry is cast on its shards and all-gathered as in
    ``gathered_state_dict`` (the same collectives, bitwise the same tensors); only its owner
    keeps a CPU copy, so the device-to-host copies and the file writes are shared."""
    return _gather_entries(model, ctx, dtype, lambda sizes: export_owners(sizes, ctx.world_size))


def _gather_entries(
    model: torch.nn.Module,
    ctx: DistContext,
    dtype: torch.dtype | None,
    owners_of: Callable[[list[int]], list[int]],
) -> tuple[dict[str, torch.Tensor], ExportSplit]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    local: dict[str, Any]
    if is_sharded(model):  # tensors and DTensors (typed as any state-dict value)
        opts = StateDictOptions(full_state_dict=False)
        local = cast("dict[str, Any]", get_model_state_dict(model, options=opts))
    else:
        local = model.state_dict()

    def out_dtype(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    # Global sizes (a DTensor's shape is global).
    nbytes = {n: t.numel() * torch.empty((), dtype=out_dtype(t)).element_size()
              for n, t in local.items()}  # fmt: skip
    owners = dict(zip(local, owners_of(list(nbytes.values())), strict=True))
    out: dict[str, torch.Tensor] = {}
    for name, t in local.items():
        t = t.detach()
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)  # a DTensor casts its own shard
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        if owners[name] == ctx.rank:
            out[name] = t.cpu()
    return out, ExportSplit(owners, nbytes, frozenset(out_dtype(t) for t in local.values()))


def sharded_train_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, masters: bool
) -> dict[str, Any]:
    """This rank's shards of the training state, nothing gathered: ``{"optim": the optimizer
    state keyed by parameter name, "model": the parameters (only when ``masters``)}``, as
    ``torch.distributed.checkpoint`` saves and loads them (DTensors under FSDP2, each holding
    this rank's shard of the live tensors; plain tensors on one unsharded rank).

    The sharded checkpoint's path (``paravt.checkpoint.save_sharded`` writes it,
    ``load_sharded`` loads into it in place, then ``load_sharded_train_state``). A fresh
    optimizer gets its state created first (a step at lr 0 with zero gradients, which leaves
    the parameters bitwise unchanged), so that there is something to load into.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=False, cpu_offload=False)
    state: dict[str, Any] = {"optim": get_optimizer_state_dict(model, optimizer, options=opts)}
    if masters:
        state["model"] = get_model_state_dict(model, options=opts)
    return state


def load_sharded_train_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Put a ``sharded_train_state`` dict (read back by ``paravt.checkpoint.load_sharded``)
    into ``model`` (its ``"model"`` entry, when present: the masters) and ``optimizer`` (the
    moments, the step counts, the param groups' learning rates)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=False, strict=True)
    if "model" in state:
        set_model_state_dict(model, state["model"], options=opts)
    set_optimizer_state_dict(model, optimizer, state["optim"], options=opts)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Global grad-norm clipping; works for plain and FSDP2 (DTensor) parameters alike."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
