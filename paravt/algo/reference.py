"""The frozen reference policy π_ref of the KL term.

π_ref is the policy RL starts from (after the SFT cold start). It never trains: parameters
have ``requires_grad=False``, the module stays in eval mode, and its log-probs are computed
under ``torch.no_grad`` by the packed path (``packed_logprobs``: the per-sequence path's values
to fp32 round-off), each sequence under its own sampling temperature / top-p
(``PackedBatch.temperatures``), so ``KL(π_θ || π_ref)`` is 0 (to round-off) at step 0 on main
and sub-agent rows alike.

Memory: forward-only (no gradients, no optimizer state), placed by ``algo.ref_placement``
(``paravt.distributed.place_reference``, chosen by ``paravt.plan.reference_placement``): a
full replica per rank, FSDP2-sharded over the trainer ranks like the policy (the default on
several ranks), or sharded in host memory. With ``algo.kl_coef == 0`` the trainer never builds
one.
"""

from __future__ import annotations

import copy

import torch

from paravt.algo.logprobs import packed_logprobs
from paravt.types import PackedBatch


class ReferencePolicy:
    """Wraps a frozen copy of the initial policy; ``logprobs(batch)`` → ``(N,)`` float32."""

    def __init__(self, model: torch.nn.Module) -> None:
        model.eval()
        model.requires_grad_(False)
        self.model = model

    @classmethod
    def from_policy(cls, policy: torch.nn.Module) -> ReferencePolicy:
        """A deep copy of ``policy``'s current weights (call before any update/sharding)."""
        return cls(copy.deepcopy(policy))

    @torch.no_grad()
    def logprobs(self, batch: PackedBatch, max_tokens: int | None = None) -> torch.Tensor:
        """``(N,)`` log π_ref of every trained token (``loss_mask != 0``; 0 elsewhere), each row
        under its own sampling parameters (``packed_logprobs``; packed forwards of at most
        ``max_tokens`` tokens, None: ``algo.max_tokens_per_microbatch``'s default)."""
        lp, _ = packed_logprobs(self.model, batch, max_tokens=max_tokens)
        return lp.float().cpu()
