"""PARA-GRPO: frame-budget gating, group advantages, packing, log-probs, policy objectives,
reference.

The maths of advantages and losses lives in ``paravt_kernels``; this package decides what is
fed to it (which trajectories, which weights, which log-probs) — see each module's docstring.
"""

from paravt.algo.advantages import build_units, group_advantages
from paravt.algo.gating import frame_budget
from paravt.algo.logprobs import packed_logprobs
from paravt.algo.loss import (
    OBJECTIVES,
    DecoupledPPO,
    PolicyObjective,
    PPOClip,
    agg_denominator,
    make_objective,
    minibatch_backward,
)
from paravt.algo.packing import concat_packed, pack_units, split_units
from paravt.algo.reference import ReferencePolicy

__all__ = [
    "OBJECTIVES",
    "DecoupledPPO",
    "PPOClip",
    "PolicyObjective",
    "ReferencePolicy",
    "agg_denominator",
    "build_units",
    "concat_packed",
    "frame_budget",
    "group_advantages",
    "make_objective",
    "minibatch_backward",
    "pack_units",
    "packed_logprobs",
    "split_units",
]
