"""encode_clip vs transformers' Qwen3-VL processor on real decoded H.264 frames.

What is compared:
- always: pixels against HF's numpy ``rescale``/``normalize`` + ``Qwen3VLVideoProcessor.patchify``
  (runs even where torchvision is absent), and
  the token layout against ``Qwen3VLProcessor``'s own text-expansion path
  (``replace_video_token`` -> ``get_text_with_replacements`` -> tokenizer ->
  ``create_mm_token_type_ids``) with the real frame indices/fps as metadata;
- when torchvision imports (``make install`` installs it; ``paravt._compat`` makes PyPI's CUDA
  build importable on CPU torch): the full ``Qwen3VLProcessor.__call__`` (pixels, grid, ids,
  types).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from unittest import mock

import av
import numpy as np
import pytest
import torch

from paravt.models import build_tiny_checkpoint, load_model
from paravt.vision.preprocess import (
    MM_TEXT,
    MM_VIDEO,
    build_model_inputs,
    encode_clip,
    patch_timestamps,
)

FPS = 24
N_FRAMES = 20
H, W = 64, 96  # multiples of patch*merge = 32: no resize, so pixels compare exactly
INDICES = [0, 3, 7, 10, 15]  # odd count: the last temporal patch is padded


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    d = build_tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny")
    return load_model(d, device="cpu")


@pytest.fixture(scope="module")
def real_frames(tmp_path_factory) -> tuple[torch.Tensor, list[float]]:
    """Write a real H.264 clip with PyAV, decode it, keep INDICES (and their true times)."""
    path = Path(tmp_path_factory.mktemp("v")) / "clip.mp4"
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=FPS)
        s.width, s.height, s.pix_fmt = W, H, "yuv420p"
        yy, xx = np.mgrid[0:H, 0:W]
        for i in range(N_FRAMES):
            img = np.stack([(xx * 2 + i * 9) % 256, (yy * 3 + i * 5) % 256, (xx + yy) % 256], -1)
            for pkt in s.encode(av.VideoFrame.from_ndarray(img.astype(np.uint8), format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    frames, times = [], []
    with av.open(str(path)) as c:
        for i, f in enumerate(c.decode(video=0)):
            if i in INDICES:
                frames.append(torch.from_numpy(f.to_ndarray(format="rgb24")))
                times.append(float(f.time))
    assert len(frames) == len(INDICES)
    return torch.stack(frames), times


def test_patch_timestamps_rule():
    # pairs averaged; an odd tail is paired with itself
    assert patch_timestamps([0.0, 1.0, 2.0, 4.0, 5.0], 2) == [0.5, 3.0, 5.0]
    assert patch_timestamps([3.0], 2) == [3.0]


def test_layout_is_pinned(bundle, real_frames):
    frames, times = real_frames
    tok, sp = bundle.tokenizer, bundle.special
    clip = encode_clip(frames, times, bundle.vision, tok)
    t, h, w = clip.visuals.grid_thw[0].tolist()
    assert (t, h, w) == (3, H // 16, W // 16)
    per = h * w // 4
    # per temporal patch: "<x.y seconds>" <|vision_start|> pad*per <|vision_end|>; no outer pair
    text = tok.decode(clip.token_ids)
    expect = "".join(
        f"<{ts:.1f} seconds><|vision_start|>" + "<|video_pad|>" * per + "<|vision_end|>"
        for ts in clip.patch_timestamps
    )
    assert text == expect
    assert clip.token_ids.count(sp.vision_start) == t and clip.token_ids[0] != sp.vision_start
    assert clip.num_video_tokens == t * per
    assert all(
        (m == MM_VIDEO) == (i == sp.video_pad)
        for i, m in zip(clip.token_ids, clip.mm_token_type_ids)
    )
    # timestamps come from the decoded frame times, not an assumed fps
    assert encode_clip(frames, times, bundle).token_ids == clip.token_ids  # bundle form
    assert clip.patch_timestamps == pytest.approx(
        [(times[0] + times[1]) / 2, (times[2] + times[3]) / 2, times[4]]
    )


def _hf_processor(bundle):
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.processing_utils import ProcessorMixin

    spec = bundle.vision
    geo = dict(
        patch_size=spec.patch_size,
        temporal_patch_size=spec.temporal_patch_size,
        merge_size=spec.merge_size,
        image_mean=list(spec.mean),
        image_std=list(spec.std),
    )
    # ProcessorMixin's argument class check resolves the auto video-processor mapping, which
    # fails to import without torchvision; the check only validates types, so skip it. The
    # processor's own __init__ (token ids) and text-expansion methods run unchanged.
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda *a: None):
        return Qwen3VLProcessor(
            image_processor=Qwen2VLImageProcessorPil(**geo),
            tokenizer=bundle.tokenizer,
            video_processor=Qwen3VLVideoProcessor(**geo),
        )


def test_pixels_match_hf_normalize_and_patchify(bundle, real_frames):
    from transformers.image_transforms import normalize, rescale
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    frames, times = real_frames
    spec = bundle.vision
    clip = encode_clip(frames, times, spec, bundle.tokenizer)
    x = frames.numpy().astype(np.float32)  # (T, H, W, C)
    x = np.stack(
        [
            normalize(rescale(f, 1 / 255), spec.mean, spec.std, input_data_format="channels_last")
            for f in x
        ]
    )
    vids = torch.from_numpy(x).permute(0, 3, 1, 2).unsqueeze(0).contiguous()  # (1, T, C, H, W)
    vp = Qwen3VLVideoProcessor(
        patch_size=spec.patch_size,
        temporal_patch_size=spec.temporal_patch_size,
        merge_size=spec.merge_size,
    )
    ref, gt, gh, gw = vp.patchify(vids, spec.patch_size, spec.merge_size, spec.temporal_patch_size)
    assert clip.visuals.grid_thw.tolist() == [[gt, gh, gw]]
    torch.testing.assert_close(clip.visuals.pixel_values, ref[0], rtol=0, atol=1e-6)


def test_tokens_match_hf_processor_text_expansion(bundle, real_frames):
    from transformers.video_utils import VideoMetadata

    frames, times = real_frames
    tok = bundle.tokenizer
    proc = _hf_processor(bundle)
    clip = encode_clip(frames, [i / FPS for i in INDICES], bundle.vision, tok)
    meta = VideoMetadata(total_num_frames=N_FRAMES, fps=FPS, frames_indices=list(INDICES))
    video_inputs = {"video_grid_thw": clip.visuals.grid_thw, "video_metadata": [meta]}
    repl = proc.replace_video_token(video_inputs, video_idx=0)
    prefix, suffix = "<|im_start|>user\n", "What happens?<|im_end|>\n"
    text, _ = proc.get_text_with_replacements([prefix + "<|video_pad|>" + suffix], [], [repl])
    hf_ids = tok(text)["input_ids"][0]
    hf_mm = proc.create_mm_token_type_ids([hf_ids])[0]
    pre = tok.encode(prefix, add_special_tokens=False)
    suf = tok.encode(suffix, add_special_tokens=False)
    assert hf_ids == pre + clip.token_ids + suf
    assert list(hf_mm) == [MM_TEXT] * len(pre) + clip.mm_token_type_ids + [MM_TEXT] * len(suf)


def _import_torchvision() -> bool:
    # ``import paravt`` (conftest) already made a CUDA torchvision importable on CPU torch.
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _import_torchvision(), reason="torchvision (HF video processor) absent")
def test_full_hf_processor_call(bundle, real_frames):
    from transformers.video_utils import VideoMetadata

    frames, _ = real_frames
    proc = _hf_processor(bundle)
    meta = VideoMetadata(total_num_frames=N_FRAMES, fps=FPS, frames_indices=list(INDICES))
    text = "<|im_start|>user\n<|video_pad|>What happens?<|im_end|>\n"
    out = proc(
        text=[text],
        videos=[frames.numpy()],
        video_metadata=[meta],
        do_sample_frames=False,
        do_resize=False,
        cap_pixels_per_frame=False,
        return_tensors="pt",
    )
    clip = encode_clip(frames, [i / FPS for i in INDICES], bundle.vision, bundle.tokenizer)
    tok = bundle.tokenizer
    pre = tok.encode("<|im_start|>user\n", add_special_tokens=False)
    suf = tok.encode("What happens?<|im_end|>\n", add_special_tokens=False)
    assert out["input_ids"][0].tolist() == pre + clip.token_ids + suf
    assert out["mm_token_type_ids"][0].tolist()[len(pre) : len(pre) + len(clip.token_ids)] == (
        clip.mm_token_type_ids
    )
    assert out["video_grid_thw"].tolist() == clip.visuals.grid_thw.tolist()
    # Bit-identical: patchify_frames replays the processor's fused rescale+normalise.
    assert torch.equal(out["pixel_values_videos"], clip.visuals.pixel_values)


def test_build_model_inputs_checks_counts(bundle, real_frames):
    frames, times = real_frames
    clip = encode_clip(frames, times, bundle.vision, bundle.tokenizer)
    kw = build_model_inputs(clip.token_ids, clip.mm_token_type_ids, clip.visuals)
    assert kw["input_ids"].shape == (1, len(clip.token_ids))
    assert kw["pixel_values_videos"].shape == clip.visuals.pixel_values.shape
    assert kw["video_grid_thw"].tolist() == clip.visuals.grid_thw.tolist()
    with pytest.raises(ValueError, match="visual placeholder tokens"):
        build_model_inputs(clip.token_ids[:-2], clip.mm_token_type_ids[:-2], clip.visuals)
    with pytest.raises(ValueError, match="one timestamp per frame"):
        encode_clip(frames, times[:-1], bundle.vision, bundle.tokenizer)
    # the model accepts the inputs: one forward, logits for every position
    with torch.no_grad():
        logits = bundle.model(**kw).logits
    assert logits.shape == (1, len(clip.token_ids), bundle.model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.fixture(scope="module")
def bundle25(tmp_path_factory):
    d = build_tiny_checkpoint(tmp_path_factory.mktemp("m25") / "tiny25", arch="qwen2_5_vl")
    return load_model(d, device="cpu")


def test_qwen2_5_layout_pixels_and_time_scale(bundle25, real_frames):
    """Qwen2.5-VL: one vision_start/end pair, no timestamp text, CLIP-normalised 14-px
    patches, and second_per_grid_ts = tp / sampled fps (the processor's rule)."""
    from transformers import Qwen2_5_VLProcessor
    from transformers.image_transforms import normalize, rescale
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.processing_utils import ProcessorMixin
    from transformers.video_utils import VideoMetadata

    # Qwen2VLVideoProcessor's module imports torchvision at import time; its patchify is the
    # same function as Qwen3VLVideoProcessor's (which stands in for it, geometry 14/2/2).
    Qwen2VLVideoProcessor = Qwen3VLVideoProcessor
    spec, tok = bundle25.vision, bundle25.tokenizer
    assert (spec.patch_size, spec.model_type) == (14, "qwen2_5_vl")
    frames = real_frames[0][:4, :56, :84].contiguous()  # real decoded frames, 28-multiples
    idx = [0, 4, 8, 12]  # uniform: 4 of the first 16 frames
    clip = encode_clip(frames, [i / FPS for i in idx], bundle25)
    assert clip.visuals.grid_thw.tolist() == [[2, 4, 6]]
    geo = dict(patch_size=14, temporal_patch_size=2, merge_size=2)
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda *a: None):
        proc = Qwen2_5_VLProcessor(
            image_processor=Qwen2VLImageProcessorPil(**geo),
            tokenizer=tok,
            video_processor=Qwen2VLVideoProcessor(**geo),
        )
    repl = proc.replace_video_token({"video_grid_thw": clip.visuals.grid_thw}, video_idx=0)
    text = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What?<|im_end|>\n"
    text, _ = proc.get_text_with_replacements([text], [], [repl])
    hf_ids = tok(text)["input_ids"][0]
    pre = tok.encode("<|im_start|>user\n", add_special_tokens=False)
    suf = tok.encode("What?<|im_end|>\n", add_special_tokens=False)
    assert hf_ids == pre + clip.token_ids + suf
    assert proc.create_mm_token_type_ids([hf_ids])[0][len(pre) : -len(suf)] == (
        clip.mm_token_type_ids
    )
    meta = VideoMetadata(total_num_frames=16, fps=FPS, frames_indices=idx)
    assert clip.visuals.second_per_grid_ts.tolist() == pytest.approx([2 / meta.sampled_fps])

    x = np.stack(
        [
            normalize(rescale(f, 1 / 255), spec.mean, spec.std, input_data_format="channels_last")
            for f in frames.numpy().astype(np.float32)
        ]
    )
    vids = torch.from_numpy(x).permute(0, 3, 1, 2).unsqueeze(0).contiguous()
    ref, *grid = Qwen2VLVideoProcessor(**geo).patchify(vids, 14, 2, 2)
    assert clip.visuals.grid_thw.tolist() == [grid]
    torch.testing.assert_close(clip.visuals.pixel_values, ref[0], rtol=0, atol=1e-6)
    kw = build_model_inputs(clip.token_ids, clip.mm_token_type_ids, clip.visuals)
    assert kw["second_per_grid_ts"].tolist() == clip.visuals.second_per_grid_ts.tolist()


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("impl", ["native", "torch"])
def test_encode_clips_one_pack_equals_encode_clip_per_clip(bundle, bundle25, arch, impl):
    """The batched encode (ONE pixel pack for every clip of a turn) returns, clip by clip,
    exactly what the pure-torch encode_clip returns: tokens, types, grid, pixels, times."""
    from paravt.vision import pack as pk
    from paravt.vision.preprocess import encode_clips

    if impl == "native" and not pk.native_available():
        pytest.skip("paravt._C not built")
    b = bundle if arch == "qwen3_vl" else bundle25
    f = b.vision.factor
    g = torch.Generator().manual_seed(3)
    clips = [
        (
            torch.randint(0, 256, (t, hh * f, ww * f, 3), dtype=torch.uint8, generator=g),
            [0.4 * i + 1.0 for i in range(t)],
        )
        for t, hh, ww in [(5, 2, 3), (2, 1, 1), (1, 3, 2), (8, 2, 2)]
    ]
    got = encode_clips(clips, b.vision, b.tokenizer, impl=impl)
    assert len(got) == len(clips)
    for (frames, ts), enc in zip(clips, got):
        ref = encode_clip(frames, ts, b.vision, b.tokenizer)
        assert enc.token_ids == ref.token_ids
        assert enc.mm_token_type_ids == ref.mm_token_type_ids
        assert enc.patch_timestamps == ref.patch_timestamps
        assert torch.equal(enc.visuals.grid_thw, ref.visuals.grid_thw)
        assert torch.equal(enc.visuals.pixel_values, ref.visuals.pixel_values)
        if ref.visuals.second_per_grid_ts is not None:
            assert torch.equal(enc.visuals.second_per_grid_ts, ref.visuals.second_per_grid_ts)
    assert encode_clips([], b.vision, b.tokenizer) == []
    with pytest.raises(ValueError, match="crop 1 has frame size"):
        encode_clips([clips[0], (clips[1][0][:, :-1], clips[1][1])], b.vision, b.tokenizer)
