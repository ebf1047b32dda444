"""The torch references of the paravt_kernels ops, under their historical name (a face).

Each op's pure-torch path (the CPU path and the test oracle) lives beside its Triton file:

* ``group_advantage_reference.py`` — ``group_advantage_torch``
* ``linear_logprob_reference.py`` — ``linear_logprob_torch`` and its forward/backward
* ``policy_loss_reference.py`` — ``policy_loss_torch``, the fused forward/gradient, KL
* ``linear_policy_loss_reference.py`` — ``linear_policy_loss_torch`` and the orchestration
  shared with the Triton path (``linear_policy_loss_fused``)
* ``packing.py`` — ``seq_ids_from_cu_seqlens``, ``broadcast_to_tokens`` (``cu_seqlens`` helpers)

This module re-exports their public names, so ``paravt_kernels.reference.<name>`` (used by
``paravt.plan``, ``paravt.algo.advantages``, the tests and the benchmarks) keeps working.
Setting one of these names here (``monkeypatch.setattr(reference, "LPL_CHUNK_BYTES_CPU", n)``)
also sets it on the module that owns it, which is where the code reads it at call time, so a
patch of the face behaves as it did when everything lived in this one file. New code should
import from the owning module.
"""

from __future__ import annotations

import sys
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


class _Face(types.ModuleType):
    """This module's type: setting a re-exported name sets it on its owner too (see above)."""

    def __setattr__(self, name: str, value: object) -> None:
        owner = OWNERS.get(name)
        if owner is not None:
            setattr(owner, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Face
