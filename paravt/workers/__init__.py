"""Asynchronous PARA-GRPO: rollout workers generate while the trainers update.

``torchrun --nproc-per-node N -m paravt.train rollout.workers=W rollout.max_staleness=η``:
ranks ``0 .. N-W-1`` train (FSDP2 among themselves), ranks ``N-W .. N-1`` are rollout workers,
each with its own engine (``rollout.engine``: HF or vLLM). Everything travels over
torch.distributed: prompts, weights (tagged with a policy version: bucketed over a weights
group, NCCL on GPUs, overlapped with the next step, or one tensor at a time through host memory
with ``rollout.weight_sync=host``; checksummed either way, ``paravt.weight_sync``) and
finished rollouts. ``roles`` builds the process groups, ``worker`` is a worker's loop,
``pipeline`` the trainer's end (admission, staleness filter, ``async/*`` metrics).
``rollout.workers=0`` (the default) is the synchronous, colocated loop, unchanged.
"""

from paravt.workers.pipeline import RolloutPipeline, WorkerFailed, staleness_metrics
from paravt.workers.roles import AsyncRoles, init_async
from paravt.workers.worker import TrainerGone, run_worker

__all__ = [
    "AsyncRoles",
    "RolloutPipeline",
    "TrainerGone",
    "WorkerFailed",
    "init_async",
    "run_worker",
    "staleness_metrics",
]
