"""The engine protocol: batched generation with per-token behaviour log-probs.

An engine turns prompt token ids (+ visual inputs) into new token ids and the log-prob of each
under the *sampling* distribution (after temperature / top-p), which is what the PPO ratio's
behaviour term needs. Implementations: ``paravt.engines.hf.HFEngine`` (transformers, CPU/GPU)
and ``paravt.engines.vllm.VLLMEngine`` (an in-process vLLM engine; ``paravt.engines.make_engine``
picks one by ``rollout.engine``). Requests are independent; an engine may
reorder internally but returns results in request order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from paravt.types import VisualInputs


def unwrap_module(model: Any) -> Any:
    """``model`` without its DDP / ``torch.compile`` wrappers (anything else as given): what an
    engine's ``sync_weights`` reads weights from."""
    for attr in ("module", "_orig_mod"):
        while hasattr(model, attr) and isinstance(getattr(model, attr), torch.nn.Module):
            model = getattr(model, attr)
    return model


def row_seed(engine_seed: int, call: int, row: int, salt: str = "") -> int:
    """A stable 63-bit seed for an unseeded request from (engine seed, call counter, row),
    the same in every process; ``salt`` keeps two engines' streams apart."""
    h = hashlib.blake2b(f"{salt}{engine_seed}:{call}:{row}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 1.0
    max_new_tokens: int = 256
    # Generation stops after any of these token ids (the stop token is included in the output).
    stop_token_ids: tuple[int, ...] = ()
    # Generation stops once the decoded new text ends with one of these (included in output).
    stop_strings: tuple[str, ...] = ()
    # Per-request seed for reproducible sampling (None = engine's generator).
    seed: int | None = None


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    sampling: SamplingParams
    visuals: VisualInputs | None = None
    # Extra per-token model inputs aligned with prompt_ids (e.g. mm_token_type_ids).
    extras: dict = field(default_factory=dict)
    request_id: str = ""


@dataclass
class GenerationResult:
    token_ids: list[int]
    logprobs: list[float]  # behaviour log-prob of each new token, same length as token_ids
    finish_reason: str  # 'stop' (stop token/string/EOS) | 'length'
    request_id: str = ""
    text: str = ""


def context_limit(engine: object) -> int:
    """The most tokens one request may span, prompt plus ``max_new_tokens`` (0: unknown).

    An engine states it as an optional ``max_model_len`` attribute: ``VLLMEngine`` fails a
    request past its ``max_model_len`` (an exception out of ``LLM.generate``), and
    ``HFEngine``'s model has no positions past its ``max_position_embeddings``. The agent loop
    keeps every request within it (``paravt.agent.loop``)."""
    n = getattr(engine, "max_model_len", 0)
    return int(n) if isinstance(n, int) and n > 0 else 0


@runtime_checkable
class Engine(Protocol):
    """What the agent loop and the rollout sources call on an engine. ``generate`` and
    ``sync_weights`` are each engine's own; ``sleep`` and ``close`` are optional, no-ops here:
    the engines inherit this class (``HFEngine``, ``VLLMEngine``, ``OracleMainEngine``) and
    override what they do, and callers call them directly."""

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Generate for every request (batched); results in request order."""
        ...

    def sync_weights(self, model: object) -> None:
        """Make subsequent generations use ``model``'s current weights."""
        ...

    def sleep(self) -> None:
        """Free the device for the update until the next ``sync_weights`` (vLLM on a GPU);
        the default does nothing."""
        return None

    def close(self) -> None:
        """Release what the engine holds now (idempotent); the default does nothing."""
        return None
