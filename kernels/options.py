"""The policy-loss records: the options (``PolicyLossOptions``) and the per-token inputs
(``PolicyTokens``), defined once and passed through every layer of ``policy_loss`` and
``linear_policy_loss`` (``api`` -> ``ops`` -> ``*_reference`` / ``*_triton``).

A new loss knob is one field here plus its use in the maths
(``policy_loss_reference.policy_token_terms``, the Triton kernel): the public functions take
the fields by keyword (``clip_low=0.2``), and the registered ops' schemas list them from
``PolicyLossOptions.SCHEMA`` (a ``torch.library`` schema holds only plain scalars, so the
record crosses the op boundary as its fields, in field order, and is rebuilt on the other
side with ``from_schema_args``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

__all__ = ["AGG_MODES", "KL_TYPES", "PolicyLossOptions", "PolicyTokens"]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_TYPES = ("k1", "k2", "k3")
# torch.library schema type of each field annotation of PolicyLossOptions
_SCHEMA_TYPES = {"float": "float", "float | None": "float?", "str": "str"}


@dataclass(frozen=True)
class PolicyLossOptions:
    """The scalar options of the PPO/GRPO policy loss (formulas in ``api.policy_loss``).

    Values are normalised on construction (``float`` for numbers) and checked: an invalid
    record cannot exist. The checks that involve the inputs (``kl_coef`` needs a reference,
    ``behav_cap`` a proximal log-prob, the seq modes ``cu_seqlens``) are in ``api``.
    """

    clip_low: float = 0.2  # trust region below: ratio clipped at 1 - clip_low
    clip_high: float = 0.2  # ... and above at 1 + clip_high (DAPO's clip-higher: 0.28)
    dual_clip: float | None = None  # > 1: where A < 0 the loss is capped at -A * dual_clip
    behav_cap: float | None = None  # decoupled objective: drop tokens with exp(prox-old) > cap
    kl_coef: float = 0.0  # weight of the KL-to-reference term (0: no KL term)
    kl_type: str = "k3"  # KL estimator: k1 | k2 | k3 (k3 = verl's low_var_kl, clamped)
    agg: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum

    SCHEMA: ClassVar[str]  # "float clip_low, ..., str agg": the fields in a torch.library schema
    # field names (all, the numeric ones), set below: dataclasses.fields(cls) is not traceable
    # by torch.compile, a tuple of names is
    FIELDS: ClassVar[tuple[str, ...]]
    _NUMBERS: ClassVar[tuple[str, ...]]

    def __post_init__(self) -> None:
        # checked before the numbers are normalised, so messages show the values as given
        if self.kl_type not in KL_TYPES:
            raise ValueError(f"kl_type='{self.kl_type}' is not one of {'|'.join(KL_TYPES)}")
        if self.agg not in AGG_MODES:
            raise ValueError(f"agg='{self.agg}' is not one of {'|'.join(AGG_MODES)}")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip={self.dual_clip} must be > 1 (or None to disable)")
        if self.behav_cap is not None and not self.behav_cap > 0:
            raise ValueError(f"behav_cap={self.behav_cap} must be > 0 (or None to disable)")
        for name in self._NUMBERS:
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, float(v))

    @classmethod
    def build(
        cls, fn: str, options: PolicyLossOptions | None, knobs: dict[str, Any]
    ) -> PolicyLossOptions:
        """The record of a public call ``fn(..., options=..., **knobs)``: ``options`` (default:
        all defaults) with the fields named in ``knobs`` replaced."""
        unknown = sorted(k for k in knobs if k not in cls.FIELDS)
        if unknown:
            raise TypeError(
                f"{fn}() got unexpected keyword argument(s) {', '.join(unknown)}: the loss "
                f"options are {', '.join(cls.FIELDS)}"
            )
        if options is None:
            return cls(**knobs)
        return dataclasses.replace(options, **knobs) if knobs else options

    def schema_args(self) -> tuple[float | str | None, ...]:
        """The fields in order: the arguments an op declared with ``SCHEMA`` takes."""
        return tuple(getattr(self, name) for name in self.FIELDS)

    @classmethod
    def from_schema_args(cls, args: tuple | list) -> PolicyLossOptions:
        """Inverse of ``schema_args``."""
        return cls(*args)

    @classmethod
    def n_schema_args(cls) -> int:
        return len(cls.FIELDS)


PolicyLossOptions.FIELDS = tuple(f.name for f in dataclasses.fields(PolicyLossOptions))
PolicyLossOptions._NUMBERS = tuple(
    f.name for f in dataclasses.fields(PolicyLossOptions) if f.type != "str"
)
PolicyLossOptions.SCHEMA = ", ".join(
    f"{_SCHEMA_TYPES[str(f.type)]} {f.name}" for f in dataclasses.fields(PolicyLossOptions)
)


@dataclass(frozen=True)
class PolicyTokens:
    """The per-token inputs of the policy loss besides the new log-prob, all packed ``(N,)``.

    ``loss_mask`` is a float weight (bool masks are converted by the public functions);
    ``ref_logprob`` is needed for a KL term, ``prox_logprob`` for the decoupled objective
    (clip against it, behaviour weight ``exp(prox - old)``). Masked tokens may hold any value.
    """

    old_logprob: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    ref_logprob: torch.Tensor | None = None
    prox_logprob: torch.Tensor | None = None

    def rows(self, a: int, b: int) -> PolicyTokens:
        """Tokens ``a:b`` of every input (views)."""
        cut = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return PolicyTokens(**{k: None if t is None else t[a:b] for k, t in cut.items()})
