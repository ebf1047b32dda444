"""torchrun + FSDP2 plumbing: process group, sharding, rollout splitting, collectives.

``python -m paravt.train`` runs single-process; ``torchrun --nproc-per-node N -m paravt.train``
(and multi-node with the usual ``--nnodes/--rdzv-endpoint`` rendezvous) runs N ranks:

* backend: NCCL on CUDA, gloo on CPU (the CPU path is what the tests exercise);
* the policy is sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``): each decoder /
  vision block is its own FSDP unit, then the root; gradients are reduce-scattered and
  *averaged* over ranks, so a rank's local loss must be scaled by ``world * local/global``
  normalisers to equal the single-process loss (see ``paravt.algo.loss``);
* prompts of a step are split across ranks (``shard_list``) — each rank rolls out its own
  prompts' groups (a group never straddles ranks, so group-relative advantages stay local);
* metrics are reduced on rank 0 from gathered per-trajectory records.

Single-process runs use the same code with ``world_size == 1`` and no process group.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

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


def init_distributed(device: str = "auto") -> DistContext:
    """Join the torchrun process group if launched by torchrun; otherwise a 1-rank context."""
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
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(torch.device(dev).type, (dist.get_world_size(),))
    return DistContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=torch.device(dev),
        backend=backend,
        mesh=mesh,
    )


def cleanup(ctx: DistContext) -> None:
    """Leave the process group so that the process can exit cleanly.

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
        dist.destroy_process_group()
        gc.collect()
        time.sleep(_EXIT_GRACE_S)


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


def all_reduce_sum(x: float | torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum over ranks (float64 on CPU for gloo portability; returns a CPU tensor)."""
    t = torch.as_tensor(x, dtype=torch.float64).detach().clone().reshape(-1)
    if ctx.distributed:
        t = t.to(ctx.device if ctx.backend == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu()


def _block_classes(model: torch.nn.Module) -> tuple[type, ...]:
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


def shard_model(model: torch.nn.Module, ctx: DistContext) -> torch.nn.Module:
    """FSDP2-shard ``model`` in place (each block, then the root). No-op on one rank.

    Tied parameters (lm_head ↔ embeddings) stay in the root unit, which owns both modules.
    """
    if not ctx.distributed:
        return model
    from torch.distributed.fsdp import fully_shard

    classes = _block_classes(model)
    for m in list(model.modules()):
        if m is not model and classes and isinstance(m, classes):
            fully_shard(m, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    return model


def full_state_dict(model: torch.nn.Module, ctx: DistContext) -> dict[str, torch.Tensor]:
    """The unsharded state dict on CPU (complete on rank 0; empty on other ranks when sharded)."""
    if not ctx.distributed:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts)


def full_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext
) -> dict[str, Any]:
    """The unsharded optimizer state keyed by parameter name (complete on rank 0)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=ctx.distributed)
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


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Global grad-norm clipping; works for plain and FSDP2 (DTensor) parameters alike."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
