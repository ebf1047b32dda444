"""The tiny offline Qwen3-VL checkpoint and load_model."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import load_file

from paravt.models import build_tiny_checkpoint, load_model
from paravt.models.tiny import SPECIAL_TOKENS, TAG_TOKENS, TINY_VOCAB
from paravt.vision.patchify import VisionSpec


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    t0 = time.perf_counter()
    d = build_tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny", seed=0)
    print(f"tiny checkpoint built in {time.perf_counter() - t0:.2f} s")
    return d


@pytest.fixture(scope="module")
def bundle(tiny_dir):
    return load_model(tiny_dir, device="cpu")


def test_checkpoint_is_an_ordinary_hf_dir(tiny_dir):
    names = {p.name for p in tiny_dir.iterdir()}
    for f in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
        "video_preprocessor_config.json",
    ):
        assert f in names, f"{f} missing from {sorted(names)}"
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_vl"
    assert [p.name for p in tiny_dir.parent.iterdir()] == [tiny_dir.name]  # no temp dirs left


def test_architecture_rules(bundle):
    cfg = bundle.model.config
    t, v = cfg.text_config, cfg.vision_config
    assert type(bundle.model).__name__ == "Qwen3VLForConditionalGeneration"
    assert sum(t.rope_parameters["mrope_section"]) == t.head_dim // 2
    assert int(v.num_position_embeddings**0.5) ** 2 == v.num_position_embeddings
    assert max(v.deepstack_visual_indexes) < v.depth
    assert v.out_hidden_size == t.hidden_size
    assert t.vocab_size == TINY_VOCAB == len(bundle.tokenizer)
    n_params = sum(p.numel() for p in bundle.model.parameters())
    assert n_params < 2_000_000, n_params
    assert not bundle.model.training
    # the model's placeholder ids are the tokenizer's
    sp = bundle.special
    assert (cfg.video_token_id, cfg.image_token_id) == (sp.video_pad, sp.image_pad)
    assert (cfg.vision_start_token_id, cfg.vision_end_token_id) == (sp.vision_start, sp.vision_end)


def test_vision_spec_from_processor_config(bundle):
    assert bundle.vision == VisionSpec(16, 2, 2, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "qwen3_vl")


def test_special_and_tool_tokens_are_single_tokens(bundle):
    tok, sp = bundle.tokenizer, bundle.special
    ids = [tok.encode(t, add_special_tokens=False) for t in SPECIAL_TOKENS]
    assert all(len(i) == 1 for i in ids)
    assert len({i[0] for i in ids}) == len(SPECIAL_TOKENS)
    assert all(getattr(sp, f) >= 0 for f in sp.__dataclass_fields__)
    assert tok.eos_token == "<|im_end|>" and sp.eos == sp.im_end
    assert tok.pad_token == "<|endoftext|>" and sp.pad == sp.endoftext
    assert set(sp.stop_ids) == {sp.im_end, sp.endoftext}
    # tags survive skip_special_tokens (reward parsers see them); <|...|> tokens do not
    text = "<|im_start|>assistant\n<think>\nok\n</think>\n<answer>B</answer><|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert (
        tok.decode(ids, skip_special_tokens=True)
        == "assistant\n<think>\nok\n</think>\n<answer>B</answer>"
    )
    for t in TAG_TOKENS:
        assert t in tok.decode(tok.encode(t, add_special_tokens=False), skip_special_tokens=True)


def test_tool_calls_tokenize_compactly_and_round_trip(bundle):
    tok = bundle.tokenizer
    call = '<tool_call>\n{"name": "crop_video", "arguments": {"start_time": 12.5, "end_time": 48}}\n</tool_call>'
    ids = tok.encode(call, add_special_tokens=False)
    assert tok.decode(ids) == call
    assert len(ids) <= 32, [tok.decode([i]) for i in ids]
    # byte-level: any text round-trips, digits are single tokens (Qwen's pre-tokenisation)
    s = "Zoë’s café — 你好 <0.5 seconds> 1234567"
    assert tok.decode(tok.encode(s, add_special_tokens=False)) == s
    assert [tok.decode([i]) for i in tok.encode("2024", add_special_tokens=False)] == list("2024")


def test_chat_template(bundle):
    tok = bundle.tokenizer
    tools = [{"type": "function", "function": {"name": "crop_video", "parameters": {}}}]
    msgs = [
        {"role": "system", "content": "You watch videos."},
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What?"}]},
    ]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou watch videos.")
    assert '"name": "crop_video"' in text and "<tools>" in text
    assert "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_same_seed_same_weights(tmp_path, tiny_dir):
    again = build_tiny_checkpoint(tmp_path / "again", seed=0)
    other = build_tiny_checkpoint(tmp_path / "other", seed=1)
    a = load_file(tiny_dir / "model.safetensors")
    b = load_file(again / "model.safetensors")
    c = load_file(other / "model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert (tiny_dir / "tokenizer.json").read_text() == (again / "tokenizer.json").read_text()


def test_existing_checkpoint_is_reused_unless_overwrite(tmp_path):
    d = build_tiny_checkpoint(tmp_path / "t", seed=0)
    w = d / "model.safetensors"
    mtime = w.stat().st_mtime_ns
    assert build_tiny_checkpoint(d, seed=3) == d
    assert w.stat().st_mtime_ns == mtime
    build_tiny_checkpoint(d, seed=3, overwrite=True)
    assert json.loads((d / "paravt_tiny.json").read_text())["seed"] == 3


def test_a_checkpoint_with_the_old_rotary_base_is_rebuilt(tmp_path):
    """Tiny checkpoints written before TINY_ROPE_THETA (rotary base 5e6, no key in
    paravt_tiny.json) are another model: rebuilt with the current base, not reused."""
    from paravt.models.tiny import TINY_ROPE_THETA

    d = build_tiny_checkpoint(tmp_path / "t", seed=0)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["text_config"]["rope_parameters"]["rope_theta"] == TINY_ROPE_THETA == 1e4
    meta = json.loads((d / "paravt_tiny.json").read_text())
    del meta["rope_theta"]
    (d / "paravt_tiny.json").write_text(json.dumps(meta))
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_checkpoint(d, seed=0) == d
    assert (d / "model.safetensors").stat().st_mtime_ns != mtime
    assert json.loads((d / "paravt_tiny.json").read_text())["rope_theta"] == TINY_ROPE_THETA
    # The Qwen2.5-VL variant kept its base: an old directory of it is reused, not rebuilt.
    q = build_tiny_checkpoint(tmp_path / "q", seed=0, arch="qwen2_5_vl")
    meta = json.loads((q / "paravt_tiny.json").read_text())
    del meta["rope_theta"]
    (q / "paravt_tiny.json").write_text(json.dumps(meta))
    mtime = (q / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_checkpoint(q, seed=0, arch="qwen2_5_vl") == q
    assert (q / "model.safetensors").stat().st_mtime_ns == mtime


def test_vocab_resizes_the_embeddings_and_a_mismatch_rebuilds(tmp_path):
    d = build_tiny_checkpoint(tmp_path / "t", seed=0)
    big = build_tiny_checkpoint(d, seed=0, vocab=TINY_VOCAB + 1000)  # not reused: other vocab
    assert json.loads((big / "paravt_tiny.json").read_text())["vocab"] == TINY_VOCAB + 1000
    bundle = load_model(str(big), dtype="float32", device="cpu")
    assert bundle.model.get_input_embeddings().weight.shape[0] == TINY_VOCAB + 1000
    assert bundle.model.get_output_embeddings().weight.shape[0] == TINY_VOCAB + 1000
    with pytest.raises(ValueError, match="vocab=100 is below"):
        build_tiny_checkpoint(tmp_path / "u", vocab=100)


def test_build_does_not_touch_global_rng(tmp_path):
    torch.manual_seed(123)
    expect = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_checkpoint(tmp_path / "t", seed=0)
    assert torch.equal(torch.rand(3), expect)


def test_load_dtype(tiny_dir):
    b = load_model(tiny_dir, device="cpu", dtype="bfloat16")
    assert next(b.model.parameters()).dtype == torch.bfloat16


def test_load_model_errors(tmp_path, tiny_dir):
    with pytest.raises(ValueError, match="is not a directory"):
        load_model(tmp_path / "nope")
    with pytest.raises(ValueError, match="has no config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="holds a 'llama' model"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="dtype='fp8'"):
        load_model(tiny_dir, dtype="fp8")


def test_tiny_qwen2_5_vl_variant(tmp_path):
    d = build_tiny_checkpoint(tmp_path / "t25", arch="qwen2_5_vl")
    b = load_model(d, device="cpu")
    assert type(b.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert b.vision.patch_size == 14 and b.vision.model_type == "qwen2_5_vl"
    assert b.vision.mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    assert b.model.config.video_token_id == b.special.video_pad
    with pytest.raises(ValueError, match="arch='llava'"):
        build_tiny_checkpoint(tmp_path / "x", arch="llava")


def test_head_dim_32_variant_for_vllm(tmp_path, tiny_dir):
    """vLLM's CPU attention needs head_dim >= 32: the variant keeps every other size, its
    M-RoPE sections sum to head_dim / 2, it is rebuilt (not reused) over a head-16 directory,
    and the default model's config is unchanged (head 16, sections [4, 2, 2])."""
    from paravt.config import load_config
    from paravt.models.tiny import TINY_VLLM_HEAD_DIM, tiny_checkpoint_args

    base = json.loads((tiny_dir / "config.json").read_text())["text_config"]
    assert base["head_dim"] == 16 and base["rope_parameters"]["mrope_section"] == [4, 2, 2]
    d = build_tiny_checkpoint(tmp_path / "t", seed=0)
    assert build_tiny_checkpoint(d, seed=0, head_dim=TINY_VLLM_HEAD_DIM) == d
    text = json.loads((d / "config.json").read_text())["text_config"]
    assert text["head_dim"] == 32 and text["rope_parameters"]["mrope_section"] == [8, 4, 4]
    assert text["hidden_size"] == base["hidden_size"]
    assert json.loads((d / "paravt_tiny.json").read_text())["head_dim"] == 32
    b = load_model(d, device="cpu")
    assert b.model.model.language_model.layers[0].self_attn.q_proj.weight.shape == (4 * 32, 64)
    with pytest.raises(ValueError, match="head_dim=32 needs arch='qwen3_vl'"):
        build_tiny_checkpoint(tmp_path / "q", arch="qwen2_5_vl", head_dim=32)
    # Runs pick the variant (in its own directory) for rollout.engine=vllm only.
    cfg = load_config("tiny_cpu", [], ["model.tiny_dir=/x/tiny"])
    assert tiny_checkpoint_args(cfg) == ("/x/tiny", 16)
    cfg = load_config("tiny_cpu", [], ["model.tiny_dir=/x/tiny", "rollout.engine=vllm"])
    assert tiny_checkpoint_args(cfg) == ("/x/tiny-hd32", 32)
    cfg = load_config("tiny_cpu", [], ["model.tiny_dir=/x/tiny", "model.tiny_head_dim=64"])
    assert tiny_checkpoint_args(cfg) == ("/x/tiny-hd64", 64)
