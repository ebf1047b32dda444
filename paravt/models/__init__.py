"""Model loading (``load_model``) and the tiny offline Qwen3-VL factory."""

from paravt.models.loader import (
    ModelBundle,
    SpecialTokens,
    load_model,
    load_model_from_config,
    vision_spec_from_dir,
)
from paravt.models.tiny import (
    build_tiny_checkpoint,
    build_tiny_tokenizer,
    resolve_model,
    tiny_checkpoint_args,
)

__all__ = [
    "ModelBundle",
    "SpecialTokens",
    "build_tiny_checkpoint",
    "build_tiny_tokenizer",
    "load_model",
    "load_model_from_config",
    "resolve_model",
    "tiny_checkpoint_args",
    "vision_spec_from_dir",
]
