"""Frames -> the token span and visual inputs of one video clip, in Qwen3-VL's layout.

Qwen3-VL layout (pinned; equal to transformers 5.19's ``Qwen3VLProcessor.replace_video_token``):
for each temporal patch ``k`` of the clip (``tp`` = temporal_patch_size consecutive frames)::

    <{ts_k:.1f} seconds><|vision_start|><|video_pad|> * (h*w / merge^2)<|vision_end|>

where ``ts_k`` is the mean of the first and last frame time of the patch (the processor's
``_calculate_timestamps`` rule, pairs padded by repeating the last frame) — computed here from
the *real* sampled timestamps, never from an assumed fps. There is deliberately **no** outer
``<|vision_start|>…<|vision_end|>`` pair around the whole clip: transformers 5.x's processor
emits one when the chat template's ``<|vision_start|><|video_pad|><|vision_end|>`` is
expanded, but Qwen's own processor (transformers 4.57, qwen-vl-utils) strips it, and that is
the format Qwen3-VL checkpoints were trained on. Tests pin this layout against the processor's
expansion of a bare ``<|video_pad|>``.

Qwen2.5-VL checkpoints get their own layout (see ``_encode_qwen2_5``): one
``<|vision_start|>…<|vision_end|>`` pair, no timestamp text, ``second_per_grid_ts`` instead.

Each timestamp text is tokenized on its own, which equals the processor's tokenization of the
whole prompt whenever the clip follows a special token or a newline (it always does in the
agent's prompts: the pre-tokeniser splits there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from paravt.types import VisualInputs
from paravt.vision.pack import Impl, pack_pixels
from paravt.vision.patchify import VisionSpec, patchify_frames

MM_TEXT, MM_IMAGE, MM_VIDEO = 0, 1, 2


@dataclass
class EncodedClip:
    """One clip, ready to be appended to a prompt.

    ``token_ids`` and ``mm_token_type_ids`` have the same length; ``visuals.pixel_values`` is
    ``(t*h*w, 3*tp*p*p)`` float32 and ``visuals.grid_thw`` is ``(1, 3)`` int64 ``[t, h, w]``
    in patches, so the span holds ``t*h*w / merge^2`` video tokens.
    """

    token_ids: list[int]
    mm_token_type_ids: list[int]
    visuals: VisualInputs
    patch_timestamps: list[float]  # seconds, one per temporal patch (the printed values)

    @property
    def num_video_tokens(self) -> int:
        return sum(1 for m in self.mm_token_type_ids if m == MM_VIDEO)


def patch_timestamps(timestamps: Sequence[float], temporal_patch_size: int) -> list[float]:
    """Per-temporal-patch time: ``(ts[i] + ts[i + tp - 1]) / 2`` for ``i = 0, tp, 2tp, …``.

    A count that is not a multiple of ``tp`` is padded by repeating the last timestamp, as the
    frames are padded by repeating the last frame.
    """
    ts = [float(t) for t in timestamps]
    if not ts:
        raise ValueError("patch_timestamps: no timestamps")
    tp = temporal_patch_size
    ts += [ts[-1]] * (-len(ts) % tp)
    return [(ts[i] + ts[i + tp - 1]) / 2 for i in range(0, len(ts), tp)]


def _token_id(tokenizer: Any, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"tokenizer has no single token for {text!r} (got {ids}); not Qwen-VL")
    return int(ids[0])


def _resolve(spec: VisionSpec | Any, tokenizer: Any, who: str) -> tuple[VisionSpec, Any]:
    if not isinstance(spec, VisionSpec) and hasattr(spec, "vision"):  # a ModelBundle
        tokenizer = tokenizer if tokenizer is not None else spec.tokenizer
        spec = spec.vision
    if tokenizer is None:
        raise ValueError(f"{who}: pass the model's tokenizer (or a ModelBundle as spec)")
    if spec.model_type not in ("qwen3_vl", "qwen2_5_vl"):
        raise NotImplementedError(
            f"{who}: no video layout for model_type '{spec.model_type}' (qwen3_vl and "
            "qwen2_5_vl are supported)"
        )
    return spec, tokenizer


def _check_times(frames: torch.Tensor, timestamps: Sequence[float], who: str) -> list[float]:
    if isinstance(timestamps, torch.Tensor):
        timestamps = timestamps.tolist()
    if frames.dim() != 4 or len(timestamps) != frames.shape[0]:
        raise ValueError(
            f"{who}: {len(timestamps)} timestamps for frames of shape "
            f"{tuple(frames.shape)}; pass one timestamp per frame"
        )
    return [float(t) for t in timestamps]


def encode_clip(
    frames: torch.Tensor,
    timestamps: Sequence[float] | torch.Tensor,
    spec: VisionSpec | Any,
    tokenizer: Any = None,
) -> EncodedClip:
    """Encode one clip into its placeholder token span and patch tensor, in the layout of
    ``spec.model_type`` (Qwen3-VL: timestamped per temporal patch; Qwen2.5-VL: one span).

    This is the pure-torch reference (``patchify_frames``); :func:`encode_clips` encodes many
    clips with ONE native pixel pack and returns the same values.

    Args:
        frames: ``(T, H, W, 3)`` uint8 RGB, ``H`` and ``W`` multiples of ``spec.factor``
            (``paravt.vision.resize.smart_resize`` chooses such sizes).
        timestamps: ``T`` seconds, the times the frames were sampled at.
        spec: patch geometry and normalisation (``bundle.vision``), or a ``ModelBundle``
            (then ``tokenizer`` may be omitted: the bundle's is used).
        tokenizer: the model's tokenizer (``bundle.tokenizer``).
    Returns:
        ``EncodedClip`` with ``grid_thw = [[ceil(T/tp), H/p, W/p]]``.
    """
    spec, tokenizer = _resolve(spec, tokenizer, "encode_clip")
    timestamps = _check_times(frames, timestamps, "encode_clip")
    pixel_values, grid = patchify_frames(frames, spec)
    return _layout(pixel_values, grid, timestamps, spec, tokenizer, frames)


def encode_clips(
    clips: Sequence[tuple[torch.Tensor, Sequence[float] | torch.Tensor]],
    spec: VisionSpec | Any,
    tokenizer: Any = None,
    *,
    impl: Impl = "auto",
) -> list[EncodedClip]:
    """:func:`encode_clip` for every ``(frames, timestamps)`` of ``clips``, with the pixels of
    all of them normalised and patchified in ONE ``paravt._C`` call (multithreaded; the torch
    reference when the extension is not built). Same values as ``encode_clip`` per clip; each
    clip's ``pixel_values`` is a view of the shared packed tensor.
    """
    spec, tokenizer = _resolve(spec, tokenizer, "encode_clips")
    if not clips:
        return []
    times = [_check_times(f, t, f"encode_clips (clip {i})") for i, (f, t) in enumerate(clips)]
    # pack_pixels checks every clip's dtype, shape and size (naming the clip's index).
    pixels, grid = pack_pixels([f for f, _ in clips], spec, impl=impl)
    parts = torch.split(pixels, [t * h * w for t, h, w in grid])
    return [
        _layout(pv, torch.tensor(g, dtype=torch.int64), ts, spec, tokenizer, f)
        for pv, g, ts, (f, _) in zip(parts, grid, times, clips)
    ]


def _layout(
    pixel_values: torch.Tensor,
    grid: torch.Tensor,
    timestamps: list[float],
    spec: VisionSpec,
    tokenizer: Any,
    frames: torch.Tensor | None = None,
) -> EncodedClip:
    """The token span of one clip around its patchified pixels (``grid`` = ``(t, h, w)``).

    ``frames`` (uint8, what was patchified) and ``timestamps`` are kept on the visuals for
    engines that preprocess themselves (``paravt.engines.vllm``)."""
    t, h, w = (int(x) for x in grid)
    per_patch = h * w // spec.merge_size**2
    vs = _token_id(tokenizer, "<|vision_start|>")
    ve = _token_id(tokenizer, "<|vision_end|>")
    vp = _token_id(tokenizer, "<|video_pad|>")
    stamps = patch_timestamps(timestamps, spec.temporal_patch_size)
    assert len(stamps) == t
    src = ([frames], [list(timestamps)]) if frames is not None else (None, None)
    if spec.model_type == "qwen2_5_vl":
        enc = _encode_qwen2_5(pixel_values, grid, timestamps, stamps, spec, (vs, vp, ve))
        enc.visuals.frames, enc.visuals.timestamps = src
        return enc
    ids: list[int] = []
    mm: list[int] = []
    for ts in stamps:
        text = tokenizer.encode(f"<{ts:.1f} seconds>", add_special_tokens=False)
        ids += text + [vs] + [vp] * per_patch + [ve]
        mm += [MM_TEXT] * (len(text) + 1) + [MM_VIDEO] * per_patch + [MM_TEXT]
    visuals = VisualInputs(pixel_values, grid.view(1, 3), "video", None, *src)
    return EncodedClip(ids, mm, visuals, stamps)


def _encode_qwen2_5(
    pixel_values: torch.Tensor,
    grid: torch.Tensor,
    timestamps: Sequence[float],
    stamps: list[float],
    spec: VisionSpec,
    ids3: tuple[int, int, int],
) -> EncodedClip:
    """Qwen2.5-VL layout: ``<|vision_start|>`` + ``<|video_pad|>`` * (t*h*w / merge^2) +
    ``<|vision_end|>`` (no timestamp text; the processor's expansion of the chat template's
    ``<|vision_start|><|video_pad|><|vision_end|>``). Time enters through the M-RoPE instead:
    ``second_per_grid_ts = tp / fps``, with the sampling fps measured from the real timestamps
    (mean frame interval); a single frame gets 1.0 (one temporal patch: the value is unused).
    """
    vs, vp, ve = ids3
    t, h, w = (int(x) for x in grid)
    n = t * h * w // spec.merge_size**2
    span = float(timestamps[-1]) - float(timestamps[0])
    step = span / (len(timestamps) - 1) if len(timestamps) > 1 and span > 0 else None
    spg = spec.temporal_patch_size * step if step is not None else 1.0
    visuals = VisualInputs(
        pixel_values, grid.view(1, 3), "video", torch.tensor([spg], dtype=torch.float32)
    )
    return EncodedClip(
        [vs] + [vp] * n + [ve], [MM_TEXT] + [MM_VIDEO] * n + [MM_TEXT], visuals, stamps
    )


def check_visual_tokens(
    mm_token_type_ids: Sequence[int], visuals: VisualInputs | None, merge_size: int
) -> None:
    """Raise if the number of visual placeholder tokens does not match the patch grids."""
    kind_id = MM_VIDEO if visuals is None or visuals.kind == "video" else MM_IMAGE
    n_tokens = sum(1 for m in mm_token_type_ids if m == kind_id)
    n_other = sum(1 for m in mm_token_type_ids if m not in (MM_TEXT, kind_id))
    expected = 0 if visuals is None else int(visuals.grid_thw.prod(-1).sum()) // merge_size**2
    if n_tokens != expected or n_other:
        raise ValueError(
            f"sequence has {n_tokens} visual placeholder tokens (+{n_other} of another kind) but "
            f"its visual inputs (grid_thw={None if visuals is None else visuals.grid_thw.tolist()})"
            f" need {expected}; build the tokens and visuals together (encode_clip)"
        )


def mm_token_types(
    mm_token_type_ids: Sequence[int] | torch.Tensor | None,
    token_ids: Sequence[int],
    special: Any = None,
    *,
    who: str,
) -> list[int]:
    """The ``mm_token_type_ids`` of ``token_ids``, one per token (``MM_TEXT``, ``MM_IMAGE``,
    ``MM_VIDEO``), as a list of ints.

    The given ones when there are (a list or a tensor); else derived from the placeholder
    tokens of ``special`` (a ``paravt.models.SpecialTokens``: ``video_pad`` is ``MM_VIDEO``,
    ``image_pad`` ``MM_IMAGE``), or all ``MM_TEXT`` without it. ``ValueError`` naming ``who``
    when the given ones are not one per token. The one place they are read from a request or a
    trajectory: ``HFEngine`` and ``VLLMEngine`` (a request's ``extras``, ``special``: the
    model's) and ``paravt.algo.packing.pack_units`` (a trajectory's ``extras``).
    """
    mm = mm_token_type_ids
    if mm is None:
        if special is None:
            return [MM_TEXT] * len(token_ids)
        return [
            MM_VIDEO if t == special.video_pad else MM_IMAGE if t == special.image_pad else MM_TEXT
            for t in token_ids
        ]
    mm = list(mm.tolist() if torch.is_tensor(mm) else mm)
    if len(mm) != len(token_ids):
        raise ValueError(
            f"{who}: mm_token_type_ids ({len(mm)}) and token ids ({len(token_ids)}) differ in "
            "length; the rollout must keep them aligned"
        )
    return mm


def build_model_inputs(
    token_ids: Sequence[int],
    mm_token_type_ids: Sequence[int],
    visuals: VisualInputs | None,
    device: torch.device | str = "cpu",
    *,
    merge_size: int = 2,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Keyword arguments of ``model.forward`` / ``model.generate`` for ONE unpadded sequence.

    Returns ``input_ids``, ``attention_mask``, ``mm_token_type_ids`` (each ``(1, L)``) and, with
    visuals, ``pixel_values_videos`` ``(N, D)`` + ``video_grid_thw`` ``(S, 3)`` (or the
    ``pixel_values``/``image_grid_thw`` pair for images). ``dtype`` casts the pixels (use the
    model's parameter dtype). Checks that the placeholder count matches the grids.
    """
    if len(token_ids) != len(mm_token_type_ids):
        raise ValueError(
            f"token_ids ({len(token_ids)}) and mm_token_type_ids ({len(mm_token_type_ids)}) "
            "differ in length"
        )
    check_visual_tokens(mm_token_type_ids, visuals, merge_size)
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
    out = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": torch.tensor([list(mm_token_type_ids)], dtype=torch.int32).to(device),
    }
    if visuals is not None:
        pv = visuals.pixel_values.to(device=device, dtype=dtype or visuals.pixel_values.dtype)
        key = "video" if visuals.kind == "video" else "image"
        out["pixel_values_videos" if key == "video" else "pixel_values"] = pv
        out[f"{key}_grid_thw"] = visuals.grid_thw.to(device)
        if visuals.second_per_grid_ts is not None:  # Qwen2.5-VL video
            out["second_per_grid_ts"] = visuals.second_per_grid_ts.to(device)
    return out
