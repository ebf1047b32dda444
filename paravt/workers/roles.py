"""Who is who in an asynchronous run, and the process groups between them.

``torchrun --nproc-per-node N -m paravt.train rollout.workers=W ...`` starts N processes; the
first ``N - W`` ranks are trainers (FSDP2 among themselves, their own process group: a step's
collectives never wait on a worker), the last ``W`` ranks are rollout workers. Groups, created
in the same order by every process:

* ``trainer_group``: the trainer ranks (the trainers' ``DistContext.group`` and mesh);
* ``ctrl_group`` (gloo): trainer rank 0 and every worker: ONE ordered stream of messages from
  the trainer (hello, prompt assignments, weight headers, stop), each a broadcast;
* ``weights_group``: the same ranks, over the job's backend (NCCL on GPU: tensors on the
  device; on CPU the gloo ``ctrl_group`` itself): each weight tensor is one broadcast that
  follows its header on ``ctrl_group``;
* ``result_groups[w]`` (gloo): trainer rank 0 and worker ``w``: that worker's finished
  rollouts, point to point. One group per worker, so each of the trainer's receiving threads
  owns its group.

The gloo groups get a long timeout (``CTRL_TIMEOUT``): a worker waits on ``ctrl_group``
through the trainer's SFT cold start and evaluations; a peer that dies closes its sockets,
which fails the waiting operation at once (the fault path, not the timeout).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from paravt.distributed import DistContext, resolve_device, world_size_from_env

#: Timeout of the message groups (a worker may wait hours for a long SFT or evaluation).
CTRL_TIMEOUT = timedelta(days=7)


@dataclass
class AsyncRoles:
    """This process's place in an asynchronous run (``init_async``)."""

    rank: int  # global rank
    trainers: list[int]  # global ranks of the trainers (0 .. N-W-1)
    workers: list[int]  # global ranks of the rollout workers (N-W .. N-1)
    ctrl_group: Any = None
    weights_group: Any = None
    result_groups: dict[int, Any] = field(default_factory=dict)

    @property
    def is_worker(self) -> bool:
        return self.rank in self.workers

    @property
    def worker_index(self) -> int:
        """This worker's index among the workers (its share of a step's prompts)."""
        return self.workers.index(self.rank)


def init_async(device: str, workers: int) -> tuple[DistContext, AsyncRoles]:
    """Join the torchrun job as a trainer or a rollout worker (``rollout.workers`` = W).

    Returns this process's ``DistContext`` (a trainer's spans the trainer ranks: rank,
    world size, group and FSDP2 mesh are theirs; a worker's is a one-rank context on its
    device) and its ``AsyncRoles``. ``paravt.validate.validate_run`` has checked that at least
    one trainer rank is left."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(resolve_device(device, local_rank))
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != world_size_from_env() or world <= workers:
        raise RuntimeError(f"init_async: {world} processes cannot hold {workers} worker(s)")
    n_train = world - workers
    trainers, worker_ranks = list(range(n_train)), list(range(n_train, world))
    # Every process creates every group, in this order (torch.distributed's rule).
    trainer_group = dist.new_group(trainers)
    ctrl = dist.new_group([0, *worker_ranks], backend="gloo", timeout=CTRL_TIMEOUT)
    weights = ctrl if backend == "gloo" else dist.new_group([0, *worker_ranks])
    results = {
        w: dist.new_group([0, w], backend="gloo", timeout=CTRL_TIMEOUT) for w in worker_ranks
    }
    roles = AsyncRoles(rank, trainers, worker_ranks, ctrl, weights, results)
    if rank >= n_train:
        return DistContext(rank=rank, local_rank=local_rank, device=dev, backend=backend), roles
    mesh = None
    if n_train > 1:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(trainer_group, dev.type)
    ctx = DistContext(
        rank=rank,
        world_size=n_train,
        local_rank=local_rank,
        device=dev,
        backend=backend,
        mesh=mesh,
        group=trainer_group,
    )
    return ctx, roles


def send_obj(obj: Any, dst: int, group: Any) -> None:
    """Pickle ``obj`` to global rank ``dst`` over ``group`` (point to point)."""
    dist.send_object_list([obj], dst=dst, group=group)


def recv_obj(src: int, group: Any) -> Any:
    """The next object global rank ``src`` sent over ``group`` (blocks)."""
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=group)
    return box[0]


def bcast_obj(obj: Any, group: Any, src: int = 0) -> Any:
    """Broadcast ``obj`` from global rank ``src`` to every member of ``group``."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
