"""The sampling distribution ``log_softmax(top_p(logits / T))``: one definition for the
engine that samples from it and the trainer passes that score tokens under it.

``paravt.engines.hf.HFEngine`` draws tokens from it (its log-probs are the behaviour
log-probs of the PPO ratio); ``paravt.algo.logprobs`` uses it for ``top_p < 1`` rows (whose
nucleus needs the sorted ``(n, V)`` logits) and ``paravt.algo.naive`` for every row. It sits
below both stages so that neither imports the other.
"""

from __future__ import annotations

import torch


def top_p_filter(logits: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the tokens outside the nucleus, HF ``TopPLogitsWarper``'s rule.

    ``logits`` ``(..., V)``; ``top_p`` a float or ``(...,)`` tensor. Tokens are sorted by
    ascending logit and removed while the cumulative probability is ``<= 1 - top_p``; the most
    likely token is always kept. Differentiable through the kept entries.
    """
    if isinstance(top_p, torch.Tensor) and top_p.numel() and bool((top_p >= 1.0).all()):
        return logits  # (a device sync; the engine passes a float when no row filters)
    if not isinstance(top_p, torch.Tensor) and top_p >= 1.0:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    p = top_p if isinstance(top_p, float) else top_p.unsqueeze(-1)
    remove_sorted = cum <= (1 - p)
    remove_sorted[..., -1:] = False
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def sampling_logprobs(
    logits: torch.Tensor, temperature: float | torch.Tensor, top_p: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """``log_softmax(top_p(logits / T))`` in float32; ``T <= 0`` (greedy) means ``T = 1``.

    ``logits`` ``(..., V)``; returns ``(..., V)``. This is the distribution the engine samples
    from, so it is also the behaviour distribution of the PPO ratio.
    """
    x = logits.float()
    if isinstance(temperature, torch.Tensor):
        t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
        x = x / t.to(x).unsqueeze(-1)
    elif temperature > 0 and temperature != 1.0:
        x = x / temperature
    x = top_p_filter(x, top_p)
    return torch.log_softmax(x, dim=-1)
