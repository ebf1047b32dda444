"""paravt_kernels: fused ops for the PARA-GRPO loss (group advantage, lm-head log-prob, PPO loss).

Public API (all importable without Triton; ``PARAVT_IMPL=auto|torch|triton`` picks the
implementation per call, see ``dispatch.py``, the dispatch point of every paravt fast op;
the loss options are one record, ``PolicyLossOptions``, see ``options.py``)::

    from paravt_kernels import group_advantage, broadcast_to_tokens, linear_logprob, policy_loss

    adv_seq = group_advantage(rewards, group_index)                  # (B,)
    adv_tok = broadcast_to_tokens(adv_seq, cu_seqlens)               # (N,)
    logp = linear_logprob(hidden, lm_head.weight, targets, temperature=0.7)   # (N,), no logits
    loss, stats = policy_loss(logp, old_logp, adv_tok, mask, cu_seqlens=cu_seqlens,
                              agg="seq-mean-token-mean")
    loss.backward()

    # or in one op from the hidden rows (gradients formed in the forward, no (N, V) logits):
    loss, stats, logp, entropy = linear_policy_loss(hidden, lm_head.weight, targets, old_logp,
                                                    adv_tok, mask, temperature=0.7)

Every op is registered as ``paravt::<op>`` (``torch.ops.paravt``) with a fake kernel and
autograd, so ``torch.compile`` can trace it.
"""

# The source folder is named ``kernels``: run from the repository root (``python -m ...`` puts
# the working directory on sys.path) it is importable as a bare ``kernels``, and transformers
# imports that name when it probes for PyPI's ``kernels`` package. Executing this package a
# second time under that name would register every ``paravt::`` op twice, which leaves the
# dispatcher in a broken state (seen: a segfault in the next ``policy_loss`` call after a model
# load, depending on test order). So under any other name hand back the installed package (it
# has no ``__version__``, so transformers reports its ``kernels`` as unavailable).
if __name__ == "paravt_kernels":
    from .api import *  # noqa: F403  (the public API is api.__all__)
    from .api import __all__  # noqa: F401
else:
    import importlib as _importlib
    import sys as _sys

    try:
        _sys.modules[__name__] = _importlib.import_module("paravt_kernels")
    except ImportError:  # not installed: stay an empty namespace
        pass
