"""Qwen-VL vision preprocessing: smart_resize, patchify, clip encoding (token span + patches)."""

from paravt.vision.patchify import VisionSpec, patchify_frames
from paravt.vision.preprocess import EncodedClip, build_model_inputs, encode_clip, encode_clips
from paravt.vision.resize import smart_resize

__all__ = [
    "EncodedClip",
    "VisionSpec",
    "build_model_inputs",
    "encode_clip",
    "encode_clips",
    "patchify_frames",
    "smart_resize",
]
