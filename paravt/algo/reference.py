"""The frozen reference policy π_ref of the KL term.

π_ref is the policy RL starts from (after the SFT cold start). It never trains: parameters
have ``requires_grad=False``, the module stays in eval mode, and its log-probs are computed
under ``torch.no_grad`` with the same per-sequence path and temperature as the policy's, so
``KL(π_θ || π_ref)`` is exactly 0 at step 0.

Memory: a full replica per rank (sharded with FSDP2 too when distributed, forward-only). With
``algo.kl_coef == 0`` the trainer never builds one.
"""

from __future__ import annotations

import copy

import torch

from paravt.algo.packing import packed_logprobs
from paravt.types import PackedBatch


class ReferencePolicy:
    """Wraps a frozen copy of the initial policy; ``logprobs(batch)`` → ``(N,)`` float32."""

    def __init__(self, model: torch.nn.Module, temperature: float, top_p: float = 1.0) -> None:
        model.eval()
        model.requires_grad_(False)
        self.model = model
        self.temperature = float(temperature)
        self.top_p = float(top_p)

    @classmethod
    def from_policy(
        cls, policy: torch.nn.Module, temperature: float, top_p: float = 1.0
    ) -> ReferencePolicy:
        """A deep copy of ``policy``'s current weights (call before any update/sharding)."""
        return cls(copy.deepcopy(policy), temperature, top_p)

    @torch.no_grad()
    def logprobs(self, batch: PackedBatch) -> torch.Tensor:
        lp, _ = packed_logprobs(self.model, batch, self.temperature, top_p=self.top_p)
        return lp.float().cpu()
