"""A tiny Qwen3-VL-architecture checkpoint built fully offline: random weights + a small BPE.

``build_tiny_checkpoint(dir)`` writes an ordinary Hugging Face checkpoint directory
(``config.json``, ``model.safetensors``, ``tokenizer.json`` + ``tokenizer_config.json`` with a
chat template, ``preprocessor_config.json``, ``video_preprocessor_config.json``) that
``paravt.models.load_model`` then loads exactly like an 8B checkpoint. It exists so that the
embedded default run, the tests and the benchmarks exercise the real Qwen3-VL code paths
(vision tower with deepstack, M-RoPE with timestamps, KV-cache decoding) in milliseconds.

``arch="qwen2_5_vl"`` builds the Qwen2.5-VL variant (patch 14, CLIP normalisation, windowed
vision attention, ``second_per_grid_ts`` M-RoPE) with the same tokenizer and text sizes.

Sizes (``TINY_*`` below): text hidden 64, 2 layers, 4 heads of 16 (2 KV heads), vocab 4096;
vision depth 2, hidden 64, patch 16, merge 2, temporal patch 2 — about 0.8 M parameters.
Architecture rules Qwen3-VL imposes (checked in ``tiny_config``):
``sum(mrope_section) == head_dim / 2``; ``num_position_embeddings`` is a perfect square;
deepstack indexes < vision depth; vision ``out_hidden_size`` == text hidden size.

The tokenizer is a byte-level BPE (Qwen2 pre-tokenisation regex: digits split one by one)
learned from (a) a corpus generated from ``seed`` of agent prompts, ``<tool_call>`` JSON and
timestamps, so tool calls tokenize compactly, and (b) ~400 KB of Python stdlib sources for
general text — enough that the learned vocabulary fills every model id. Qwen's special tokens are appended after the learned vocabulary. Weights depend only on
``seed`` and ``vocab`` (default ``TINY_VOCAB``); the learned merges depend on the
stdlib sources of the running Python, so they are deterministic per installation.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sysconfig
from pathlib import Path
from typing import Any

import torch

from paravt.config import ConfigError
from paravt.distributed import DTYPES
from paravt.engines import ENGINES
from paravt.models.loader import load_model_from_config, quiet_progress

# Model vocabulary (embedding rows). The BPE learns up to TINY_VOCAB - len(SPECIAL_TOKENS)
# tokens; unused rows stay as never-produced ids.
TINY_VOCAB = 4096
TINY_TEXT = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128)
# vLLM's CPU attention supports head sizes >= 32 only: the tiny variant the vLLM engine uses.
TINY_VLLM_HEAD_DIM = 32
TINY_VISION = dict(depth=2, hidden=64, heads=4, intermediate=128, patch=16, merge=2, tpatch=2)
# Text rotary base. Qwen3-VL's 5e6 suits head_dim 128 (64 rotary pairs); with the tiny model's
# 8 pairs it leaves ~2 that turn by more than a radian over a few hundred tokens, too little
# positional resolution to learn to copy. Measured on the synthetic task after SFT
# (teacher-forced, 9 held-out trajectories read): at 5e6 the model miscopied the previous
# crop's end time into the next call's start time (a number ~15 tokens back) in every one,
# at 1e4 it copied them all exactly. Longer-range copies still fail at this size.
TINY_ROPE_THETA = 10_000.0
QWEN2_5_ROPE_THETA = 1_000_000.0  # the Qwen2.5-VL variant (tests only) keeps its base

# Qwen's special tokens (``special=True``: skipped by decode(skip_special_tokens=True)) ...
QWEN_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# ... and the structural tags, which (as in Qwen3) are single tokens but ordinary text: they
# survive skip_special_tokens and are visible to reward parsers.
TAG_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<answer>",
    "</answer>",
]
SPECIAL_TOKENS = QWEN_SPECIAL + TAG_TOKENS

# Qwen2/Qwen3 pre-tokenisation: contractions, letters with an optional leading non-letter,
# single digits, punctuation runs, newlines, spaces.
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# A Qwen3-VL-style chat template: tools block in the system turn, videos/images as
# <|vision_start|><|video_pad|><|vision_end|> placeholders (expanded by the processor or by
# paravt.vision.preprocess), tool results as <tool_response> in a user turn.
CHAT_TEMPLATE = r"""{%- macro render(content) -%}
{%- if content is string -%}{{- content -}}
{%- else -%}{%- for c in content -%}
{%- if c.type == 'video' or 'video' in c -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
{%- elif c.type == 'image' or 'image' in c -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
{%- elif c.type == 'text' -%}{{- c.text -}}
{%- endif -%}{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if messages[0].role == 'system' -%}{{- render(messages[0].content) + '\n\n' -}}{%- endif -%}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and '
    'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
{%- if not (tools and loop.first and m.role == 'system') -%}
{%- if m.role == 'tool' -%}
{{- '<|im_start|>user\n<tool_response>\n' + render(m.content) + '\n</tool_response><|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' + m.role + '\n' + render(m.content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"""

_WORDS = (
    "the a an of to in on at for with and or not is are was were be this that these those "
    "video frame frames clip crop window time times second seconds minute start end begin "
    "question answer options option choose select correct best describe summary summarize "
    "what when where which who why how does do did happen happens happened event events "
    "person people man woman car dog cat ball red blue green yellow white black color shape "
    "moves moving appears appear shown shows show scene background object objects count "
    "number first last before after during between overview look closer inspect detail "
    "I need to check the part around think reasoning so it must be because then now "
    "tool call response result error invalid range outside duration returned view see"
).split()
# ~600 KB of stdlib sources: enough text for the BPE to fill all TINY_VOCAB ids (an id the
# tokenizer never produces would still get probability mass from the random lm_head).
_STDLIB_FILES = (
    "textwrap.py",
    "string.py",
    "json/encoder.py",
    "json/decoder.py",
    "fractions.py",
    "argparse.py",
    "difflib.py",
    "inspect.py",
    "tarfile.py",
    "pydoc.py",
)


def _agent_corpus(seed: int, n: int = 600) -> str:
    """Deterministic text in the shape of the agent's prompts, tool calls and answers."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a = round(rng.uniform(0, 600), rng.choice([0, 1, 1, 2]))
        b = round(a + rng.uniform(1, 60), rng.choice([0, 1, 1, 2]))
        call = {"name": "crop_video", "arguments": {"start_time": a, "end_time": b}}
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16)))
        letter = rng.choice("ABCD")
        lines += [
            f"<{rng.uniform(0, 600):.1f} seconds>",
            f"{rng.choice(['system', 'user', 'assistant'])}\n{words}",
            f"<think>\n{words.capitalize()}.\n</think>",
            f"<tool_call>\n{json.dumps(call)}\n</tool_call>",
            f"<tool_response>\nFrom {a} to {b} seconds: {words}.\n</tool_response>",
            f"<answer>{letter}</answer>",
            f"Question: {words}?\nOptions:\nA. {rng.choice(_WORDS)}\nB. {rng.choice(_WORDS)}",
            json.dumps({"type": "object", "properties": {"start_time": {"type": "number"}}}),
        ]
    return "\n".join(lines)


def _stdlib_corpus(max_chars: int = 400_000) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    text = []
    for name in _STDLIB_FILES:
        p = root / name
        if p.is_file():
            text.append(p.read_text(encoding="utf-8", errors="replace"))
    return "\n".join(text)[:max_chars]


def build_tiny_tokenizer(seed: int = 0):
    """Byte-level BPE + Qwen special/tag tokens + chat template, as a PreTrainedTokenizerFast.

    Returns a tokenizer with ``eos_token='<|im_end|>'`` and ``pad_token='<|endoftext|>'`` (the
    Qwen3-VL instruct convention). Special tokens are appended after the learned vocabulary, so
    ``len(tokenizer) <= TINY_VOCAB``.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [_agent_corpus(seed), _stdlib_corpus()]
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=QWEN_SPECIAL[1:],
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(tokenizer, head_dim: int = TINY_TEXT["head_dim"]):
    from transformers import Qwen3VLConfig

    t, v = {**TINY_TEXT, "head_dim": head_dim}, TINY_VISION
    # T, H, W rotary pairs (Qwen3-VL interleaves them): [4, 2, 2] at head_dim 16, [8, 4, 4] at 32.
    mrope_section = [head_dim // 4, head_dim // 8, head_dim // 8]
    assert sum(mrope_section) == t["head_dim"] // 2
    num_pos = 64  # an 8x8 learned position grid, bilinearly interpolated to any frame size
    assert int(num_pos**0.5) ** 2 == num_pos
    deepstack = [0, 1]
    assert max(deepstack) < v["depth"]
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in QWEN_SPECIAL}
    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=TINY_VOCAB,
            hidden_size=t["hidden"],
            intermediate_size=t["intermediate"],
            num_hidden_layers=t["layers"],
            num_attention_heads=t["heads"],
            num_key_value_heads=t["kv_heads"],
            head_dim=t["head_dim"],
            max_position_embeddings=8192,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": TINY_ROPE_THETA,
                "mrope_section": mrope_section,
                "mrope_interleaved": True,
            },
            tie_word_embeddings=False,
            pad_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
        ),
        vision_config=dict(
            depth=v["depth"],
            hidden_size=v["hidden"],
            intermediate_size=v["intermediate"],
            num_heads=v["heads"],
            patch_size=v["patch"],
            spatial_merge_size=v["merge"],
            temporal_patch_size=v["tpatch"],
            out_hidden_size=t["hidden"],  # must equal the text hidden size
            num_position_embeddings=num_pos,
            deepstack_visual_indexes=deepstack,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def _tiny_config_qwen2_5(tokenizer):
    """The same sizes as a Qwen2.5-VL: patch 14, windowed vision attention, no deepstack."""
    from transformers import Qwen2_5_VLConfig

    t, v = TINY_TEXT, TINY_VISION
    assert t["hidden"] // t["heads"] == t["head_dim"]  # Qwen2.5 derives head_dim
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in QWEN_SPECIAL}
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=TINY_VOCAB,
            hidden_size=t["hidden"],
            intermediate_size=t["intermediate"],
            num_hidden_layers=t["layers"],
            num_attention_heads=t["heads"],
            num_key_value_heads=t["kv_heads"],
            max_position_embeddings=8192,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": QWEN2_5_ROPE_THETA,
                "mrope_section": [4, 2, 2],  # sums to head_dim / 2
            },
            tie_word_embeddings=False,
            pad_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            bos_token_id=ids["<|endoftext|>"],
        ),
        vision_config=dict(
            depth=v["depth"],
            hidden_size=v["hidden"],
            intermediate_size=v["intermediate"],
            num_heads=v["heads"],
            patch_size=14,
            spatial_merge_size=v["merge"],
            temporal_patch_size=v["tpatch"],
            out_hidden_size=t["hidden"],
            window_size=112,  # 4x4 merged patches per attention window
            fullatt_block_indexes=[v["depth"] - 1],
            tokens_per_second=2,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


# CLIP normalisation, which Qwen2.5-VL (and Qwen2-VL) use.
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def _processor_configs(arch: str = "qwen3_vl") -> tuple[dict, dict]:
    v = TINY_VISION
    qwen3 = arch == "qwen3_vl"
    common = {
        "patch_size": v["patch"] if qwen3 else 14,
        "temporal_patch_size": v["tpatch"],
        "merge_size": v["merge"],
        "image_mean": [0.5, 0.5, 0.5] if qwen3 else _CLIP_MEAN,
        "image_std": [0.5, 0.5, 0.5] if qwen3 else _CLIP_STD,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
    }
    image = {
        **common,
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor" if qwen3 else "Qwen2_5_VLProcessor",
        "size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 64},
    }
    video = {
        **common,
        "video_processor_type": "Qwen3VLVideoProcessor" if qwen3 else "Qwen2VLVideoProcessor",
        "processor_class": "Qwen3VLProcessor" if qwen3 else "Qwen2_5_VLProcessor",
        "size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 64 * 64},
        "fps": 1,
        "min_frames": 2,
        "max_frames": 64,
        "do_sample_frames": False,
    }
    return image, video


def build_tiny_checkpoint(
    out_dir: str | Path,
    *,
    seed: int = 0,
    overwrite: bool = False,
    arch: str = "qwen3_vl",
    vocab: int = TINY_VOCAB,
    head_dim: int = TINY_TEXT["head_dim"],
) -> Path:
    """Write (if absent) a tiny random-weight Qwen3-VL checkpoint + tokenizer to ``out_dir``.

    ``arch='qwen2_5_vl'`` writes the Qwen2.5-VL variant instead (patch 14, CLIP normalisation,
    windowed vision attention) with the same tokenizer and text sizes.

    ``vocab`` resizes the embeddings and the lm_head (default ``TINY_VOCAB`` = 4096; e.g.
    Qwen3-VL's real 151,936 to measure what the vocabulary costs the trainer). The tokenizer is
    the same: ids past it are rows that are never produced by tokenisation but are sampled and
    scored like any other id. An existing directory built with another ``vocab`` or ``arch``
    (``paravt_tiny.json``) is rebuilt, not silently reused; one with another ``seed`` is reused
    (as before: runs with different seeds share one tiny model directory).

    ``head_dim`` sets the text attention head size (Qwen3-VL only; default 16). vLLM's CPU
    attention supports head sizes >= 32 only, so the vLLM engine's tests and
    ``rollout.engine=vllm`` on the tiny model use ``head_dim=32`` (``TINY_VLLM_HEAD_DIM``):
    the same hidden size and head count, wider query/key/value projections and
    ``mrope_section`` [8, 4, 4]. Another ``head_dim`` is another model, rebuilt like ``vocab``;
    so is a directory built with another rotary base (``TINY_ROPE_THETA``, 5e6 before).

    Offline and fast (well under a second for the BPE, ~1 s for the model on 2 cores). The
    directory is complete when ``config.json`` and ``model.safetensors`` exist; an existing
    complete directory is returned untouched unless ``overwrite``. Writing goes to a sibling
    temporary directory that is renamed into place, so a crash never leaves a half checkpoint
    that a later run would load. Returns the directory path.
    """
    import transformers

    archs = {
        "qwen3_vl": (tiny_config, "Qwen3VLForConditionalGeneration"),
        "qwen2_5_vl": (_tiny_config_qwen2_5, "Qwen2_5_VLForConditionalGeneration"),
    }
    if arch not in archs:
        raise ValueError(f"build_tiny_checkpoint: arch='{arch}' is not one of {sorted(archs)}")
    make_config, cls_name = archs[arch]
    if head_dim != TINY_TEXT["head_dim"] and (arch != "qwen3_vl" or head_dim % 8):
        raise ValueError(
            f"build_tiny_checkpoint: head_dim={head_dim} needs arch='qwen3_vl' and a multiple "
            f"of 8 (got arch='{arch}'); Qwen2.5-VL derives head_dim from the hidden size"
        )
    if vocab < TINY_VOCAB:
        raise ValueError(
            f"build_tiny_checkpoint: vocab={vocab} is below the tokenizer's {TINY_VOCAB} ids; "
            f"pass vocab >= {TINY_VOCAB}"
        )
    theta = TINY_ROPE_THETA if arch == "qwen3_vl" else QWEN2_5_ROPE_THETA
    meta = {"seed": seed, "vocab": vocab, "arch": arch, "head_dim": head_dim, "rope_theta": theta}
    out = Path(out_dir)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        if not overwrite and _same_shape(_tiny_meta(out), meta):
            return out
    # A private temporary name: several processes (torchrun ranks) may build concurrently.
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)

    tokenizer = build_tiny_tokenizer(seed)
    if len(tokenizer) > TINY_VOCAB:  # cannot happen with the trainer cap; guard the invariant
        raise RuntimeError(f"tiny tokenizer has {len(tokenizer)} tokens > TINY_VOCAB={TINY_VOCAB}")
    config = make_config(tokenizer, head_dim) if arch == "qwen3_vl" else make_config(tokenizer)
    config.text_config.vocab_size = vocab
    config.dtype = "float32"
    # Weights depend only on the seed: a private RNG state, restored afterwards so building a
    # checkpoint never perturbs the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, cls_name)(config)
    model.generation_config.eos_token_id = [
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    ]
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    with quiet_progress():
        model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    image_cfg, video_cfg = _processor_configs(arch)
    (tmp / "preprocessor_config.json").write_text(json.dumps(image_cfg, indent=2))
    (tmp / "video_preprocessor_config.json").write_text(json.dumps(video_cfg, indent=2))
    (tmp / "paravt_tiny.json").write_text(json.dumps(meta))

    if (
        (out / "model.safetensors").is_file()
        and not overwrite
        and _same_shape(_tiny_meta(out), meta)
    ):
        # another process won
        shutil.rmtree(tmp)
        return out
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def _tiny_meta(out: Path) -> dict | None:
    """The ``{seed, vocab, arch, head_dim}`` a tiny checkpoint was built with (``None``: not a tiny
    checkpoint, e.g. a real model a user put there; it is never rebuilt)."""
    try:
        return json.loads((out / "paravt_tiny.json").read_text())
    except (OSError, ValueError):
        return None


def _same_shape(found: dict | None, want: dict) -> bool:
    """An existing checkpoint serves the request: not a tiny one (never rebuilt), or a tiny
    one of the same vocabulary, architecture, head size and rotary base (the seed may
    differ)."""
    if found is None:
        return True
    # Directories written before a key existed hold the then-only value (4096 ids, head 16,
    # rotary base 5e6 for Qwen3-VL; the Qwen2.5-VL variant's base never changed).
    legacy_theta = 5e6 if found.get("arch") == "qwen3_vl" else QWEN2_5_ROPE_THETA
    default = {"vocab": TINY_VOCAB, "head_dim": TINY_TEXT["head_dim"], "rope_theta": legacy_theta}
    keys = ("vocab", "arch", "head_dim", "rope_theta")
    return all(found.get(k, default.get(k)) == want[k] for k in keys)


def tiny_checkpoint_args(cfg: Any) -> tuple[str, int]:
    """``(directory, head_dim)`` of the tiny model a run with ``cfg`` (a ``paravt.config.
    Config``) uses when ``model.path`` is empty.

    ``model.tiny_head_dim = 0`` means 16, or the engine's ``min_head_dim`` when larger
    (``paravt.engines.ENGINES``: 32 = ``TINY_VLLM_HEAD_DIM`` with ``rollout.engine=vllm``,
    whose CPU attention needs head sizes >= 32). A head size other
    than 16 gets its own directory, ``model.tiny_dir + '-hd{N}'``, so that vLLM runs and HF
    runs sharing one ``tiny_dir`` never rebuild each other's model.
    """

    engine = ENGINES.get(cfg.rollout.engine)
    hd = int(cfg.model.tiny_head_dim) or max(
        TINY_TEXT["head_dim"], engine.min_head_dim if engine else 0
    )
    d = str(cfg.model.tiny_dir)
    return (d if hd == TINY_TEXT["head_dim"] else f"{d.rstrip('/')}-hd{hd}"), hd


def resolve_model(cfg: Any, path: str = "") -> Any:
    """Load ``path`` (a model or paravt checkpoint directory) with ``cfg.model``'s settings, or,
    when it is empty, the tiny offline model (built into ``model.tiny_dir`` if absent). Returns
    a ``paravt.models.ModelBundle``. Used by ``python -m paravt.episodes``."""

    if not path:
        tiny_dir, head_dim = tiny_checkpoint_args(cfg)
        path = str(
            build_tiny_checkpoint(
                tiny_dir, seed=cfg.train.seed, vocab=cfg.model.tiny_vocab, head_dim=head_dim
            )
        )
    return load_model_from_config(path, cfg.model)


def random_checkpoint_dir(cfg: Any) -> str:
    """Where ``model.init=random`` builds ``model.config``'s architecture: beside the tiny
    model, one folder per architecture and dtype (``runs/models/random-qwen3vl_8b-bfloat16``)."""
    name = Path(str(cfg.model.config)).stem
    if name == "config":  # a config.json path: name it after its folder
        name = Path(str(cfg.model.config)).parent.name
    return str(Path(cfg.model.tiny_dir).parent / f"random-{name}-{cfg.model.dtype}")


def model_dir_of(cfg: Any) -> str:
    """The checkpoint directory a run with ``cfg`` loads: ``model.path``, the random-weight
    build of ``model.config`` (``model.init=random``), or the tiny model's directory. Read by
    ``paravt.assets.prepare_model`` (which builds the last two) and ``paravt.validate``."""
    if cfg.model.path and cfg.model.init != "random":
        return str(cfg.model.path)
    if cfg.model.init == "random":
        return random_checkpoint_dir(cfg)
    return tiny_checkpoint_args(cfg)[0]


# The shipped architecture configs (dimensions only, no weights): model.config names one.
ARCH_DIR = Path(__file__).resolve().parent / "arch"


def arch_config_path(name: str) -> Path:
    """The shipped ``config.json`` of architecture ``name`` (``model.config``), or a path to one.

    Raises ``ConfigError`` naming the shipped architectures when there is none (the memory
    plan ``paravt.plan`` and ``build_random_checkpoint`` read it)."""

    p = Path(name)
    if p.suffix == ".json" and p.is_file():
        return p
    if (p / "config.json").is_file():
        return p / "config.json"
    q = ARCH_DIR / f"{name}.json"
    if q.is_file():
        return q
    known = sorted(x.stem for x in ARCH_DIR.glob("*.json"))
    raise ConfigError(
        f"model.config='{name}' is not a shipped architecture ({'|'.join(known)}) nor a "
        "config.json / checkpoint directory"
    )


def write_narrow_arch(path: str | Path, name: str = "qwen3vl_2b", vocab: int = 0) -> Path:
    """A shipped architecture narrowed to a few MB (2 layers, hidden 64; its real vocabulary,
    mrope and deepstack) at ``path``: ``model.config=PATH model.init=random`` then builds it the
    way a real size builds. For CPU runs of real-size command lines (the GPU training check's
    dry mode, ``scripts/gpu_real_size.py``; ``tests/test_plan.py``). ``vocab`` > 0 cuts the
    vocabulary to that many rows (at least the tiny tokenizer's 4096 ids): the CI dry run's
    lm_head then costs ~40x less on a CPU."""
    c = json.loads(arch_config_path(name).read_text())
    t, v = c["text_config"], c["vision_config"]
    if vocab:
        if vocab < 4096:
            raise ValueError(f"write_narrow_arch: vocab={vocab} is under the tokenizer's 4096 ids")
        t["vocab_size"] = vocab
    t.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)  # fmt: skip
    t["rope_scaling"]["mrope_section"] = [4, 2, 2]
    v.update(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
             deepstack_visual_indexes=[0, 1])  # fmt: skip
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(c, indent=1))
    return p


def build_random_checkpoint(out_dir: str | Path, config: str, *, seed: int = 0,
                            dtype: str = "bfloat16") -> Path:  # fmt: skip
    """``model.init=random``: write a checkpoint of the architecture ``config`` (a shipped name
    such as ``qwen3vl_8b``, see ``paravt/models/arch``, or a config.json path) with random
    weights, offline: the real sizes for memory and speed checks on a GPU without a download.

    The tokenizer is the tiny model's (4096 ids, Qwen's special tokens at its own ids, which
    the config's token ids are remapped to); the embedding keeps the architecture's vocabulary
    (151,936 rows: ids past 4096 are never produced by tokenisation but are scored like any
    other). Weights: transformers' initialisation under ``seed``, saved in ``dtype``. An
    existing complete directory built from the same config and seed is reused. 8B in bf16:
    ~17.5 GB of host memory and disk, a few minutes on a CPU.
    """
    import transformers

    src = arch_config_path(config)
    d = json.loads(src.read_text())
    meta = {"config": d, "seed": seed, "dtype": dtype}
    out = Path(out_dir)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        try:
            if json.loads((out / "paravt_random.json").read_text()) == meta:
                return out
        except (OSError, ValueError):
            pass
    tokenizer = build_tiny_tokenizer(seed)
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in QWEN_SPECIAL}
    d = json.loads(json.dumps(d))
    d.pop("architectures", None)
    d.pop("transformers_version", None)
    remap = {
        "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
        "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
        "vision_token_id": "<|vision_pad|>", "bos_token_id": "<|endoftext|>",
        "eos_token_id": "<|im_end|>", "pad_token_id": "<|endoftext|>",
    }  # fmt: skip
    for sec in (d, d.get("text_config", {})):
        for k, tok in remap.items():
            if k in sec:
                sec[k] = ids[tok]
    hf = transformers.AutoConfig.for_model(**d)
    arch = hf.model_type
    cls = {"qwen3_vl": "Qwen3VLForConditionalGeneration",
           "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}[arch]  # fmt: skip
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(DTYPES[dtype])  # built in the saved dtype: half the memory
        try:
            model = getattr(transformers, cls)(hf)
        finally:
            torch.set_default_dtype(prev)
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    with quiet_progress():
        model.save_pretrained(tmp, safe_serialization=True)
    del model
    tokenizer.save_pretrained(tmp)
    image_cfg, video_cfg = _processor_configs(arch)
    patch = int(hf.vision_config.patch_size)
    for c in (image_cfg, video_cfg):
        c["patch_size"] = patch
    (tmp / "preprocessor_config.json").write_text(json.dumps(image_cfg, indent=2))
    (tmp / "video_preprocessor_config.json").write_text(json.dumps(video_cfg, indent=2))
    (tmp / "paravt_random.json").write_text(json.dumps(meta))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
