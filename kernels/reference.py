"""The torch references of the paravt_kernels ops, under their historical name (a face).

Each op's pure-torch path (the CPU path and the test oracle) lives beside its Triton file:

* ``group_advantage_reference.py`` — ``group_advantage_torch``
* ``linear_logprob_reference.py`` — ``linear_logprob_torch`` and its forward/backward
* ``policy_loss_reference.py`` — ``policy_loss_torch``, the fused forward/gradient, KL
* ``linear_policy_loss_reference.py`` — ``linear_policy_loss_torch`` and the orchestration
  shared with the Triton path (``linear_policy_loss_fused``)
* ``packing.py`` — ``seq_ids_from_cu_seqlens``, ``broadcast_to_tokens`` (``cu_seqlens`` helpers)

This module re-exports their public names (the same objects), so
``paravt_kernels.reference.<name>`` keeps working for code written against the one-file
module. It is a plain module: paravt itself imports each name from its owner, and a call-time
constant (``LPL_CHUNK_BYTES_CPU``, ``TORCH_VOCAB_TILE``, ``POLICY_TOKEN_CHUNK``) is read where
it is defined, so patch it there (``OWNERS[name]`` names the module), not here.
"""

from __future__ import annotations

import types

from . import (
    group_advantage_reference,
    linear_logprob_reference,
    linear_policy_loss_reference,
    options,
    packing,
    policy_loss_reference,
)
from .group_advantage_reference import *  # noqa: F403
from .linear_logprob_reference import *  # noqa: F403
from .linear_policy_loss_reference import *  # noqa: F403
from .options import *  # noqa: F403
from .packing import *  # noqa: F403
from .policy_loss_reference import *  # noqa: F403

#: Which module owns (defines, and reads at call time) each name re-exported here.
OWNERS: dict[str, types.ModuleType] = {
    name: module
    for module in (
        options,
        packing,
        group_advantage_reference,
        linear_logprob_reference,
        policy_loss_reference,
        linear_policy_loss_reference,
    )
    for name in module.__all__
}

__all__ = sorted(OWNERS)
