"""Rollout engines (see ``engine.py`` for the protocol)."""

from paravt.rollout.engine import Engine, GenerationRequest, GenerationResult, SamplingParams

__all__ = ["Engine", "GenerationRequest", "GenerationResult", "SamplingParams"]
