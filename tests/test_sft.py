"""Cold-start SFT: both data formats, what is trained (only the assistant's generations), and
a few real optimizer steps on the tiny model that lower the NLL and write an HF checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from paravt.config import load_config
from paravt.sft import read_sft_records


def _cfg(assets: dict[str, str], out: Path, **kv: object):
    base = {
        "data.synth_dir": assets["data"],
        "model.tiny_dir": assets["model"],
        "train.out_dir": str(out),
        "sft.steps": 3,
        "sft.batch_size": 2,
        "sft.lr": 3e-3,
    }
    base.update(kv)
    return load_config(overrides=[f"{k}={v}" for k, v in base.items()])


def test_paravt_messages_format_reads_like_the_synthetic_one(assets, tmp_path) -> None:
    rec = read_sft_records(Path(assets["data"]) / "sft.jsonl")[0]
    msgs = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "question"}]},
    ]
    for t in rec.turns:
        if t.role == "assistant":
            msgs.append({"role": "assistant", "content": t.content})
        else:
            msgs += [{"role": "tool", "content": c} for c in t.content]
    f = tmp_path / "paravt_sft.jsonl"
    f.write_text(
        json.dumps({"id": rec.sample_id, "num_frames": rec.num_frames, "messages": msgs}) + "\n"
    )
    assert read_sft_records(f) == [rec]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "prompt": "?"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_sft_records(bad)


def test_only_assistant_generations_are_trained(assets, tmp_path) -> None:
    from paravt.data.readers import load_samples
    from paravt.models import load_model
    from paravt.sft import encode_records

    cfg = _cfg(assets, tmp_path)
    bundle = load_model(assets["model"], device="cpu")
    # Two oracle episodes with crop calls (the oracle answers directly when the overview
    # already shows the target).
    recs = [r for r in read_sft_records(Path(assets["data"]) / "sft.jsonl") if len(r.turns) > 1]
    recs = recs[:2]
    trajs = encode_records(recs, load_samples(assets["data"]), bundle, cfg)
    mains = [t for t in trajs if t.role == "main"]
    assert len(mains) == 2
    # sft.sub_agents: one sub-agent row per oracle summary, the summary as its only target.
    summaries = [s for rec in recs for s in rec.turns[1].content]
    subs = [t for t in trajs if t.role != "main"]
    assert cfg.sft.sub_agents and len(subs) == len(summaries)
    tok = bundle.tokenizer
    for t, text in zip(subs, summaries):
        trained = tok.decode([x for x, m in zip(t.tokens, t.loss_mask) if m])
        assert trained.replace("<|im_end|>", "").strip() == text.strip()
    for t, rec in zip(mains, recs):
        trained = tok.decode([x for x, m in zip(t.tokens, t.loss_mask) if m])
        untrained = tok.decode([x for x, m in zip(t.tokens, t.loss_mask) if not m])
        # Tool responses, the prompt and the forced <think> prefix are never targets.
        assert "<tool_response>" in untrained and "<tool_response>" not in trained
        assert rec.turns[1].content[0][:30] in untrained
        assert "<|vision_start|>" in untrained and "crop_video" in untrained  # prompt + schema
        assert trained.count("<think>") == 0 and "</think>" in trained
        final = rec.turns[-1].content.split("<answer>")[1]
        assert "<answer>" + final in trained
        assert sum(t.loss_mask[: t.prompt_len]) == 0


def test_sft_steps_lower_the_nll_and_write_a_checkpoint(assets, tmp_path) -> None:
    from transformers import Qwen3VLForConditionalGeneration

    from paravt.checkpoint import load_model_state
    from paravt.sft import run_sft

    cfg = _cfg(assets, tmp_path, **{"sft.steps": 4})
    out = tmp_path / "sft"
    res = run_sft(cfg, model_dir=assets["model"], data_dir=assets["data"], out_dir=out)
    assert res["sft/loss_last"] < res["sft/loss_first"]
    before, after = load_model_state(assets["model"]), load_model_state(out)
    assert sum(not torch.equal(before[k], after[k]) for k in before) > len(before) // 2
    Qwen3VLForConditionalGeneration.from_pretrained(out, local_files_only=True)
    assert (out / "tokenizer.json").is_file() and not Path(str(out) + ".tmp").exists()


def test_frozen_vision_tower_keeps_its_blocks_and_trains_its_mergers(assets, tmp_path) -> None:
    """sft.freeze_vision_tower (on in the tiny preset): the ViT's patch embedding, position
    table and blocks stay bit-equal, its mergers (and the language model) move."""
    from paravt.checkpoint import load_model_state
    from paravt.sft import run_sft

    cfg = _cfg(assets, tmp_path, **{"sft.steps": 2, "sft.freeze_vision_tower": True})
    out = tmp_path / "sft"
    run_sft(cfg, model_dir=assets["model"], data_dir=assets["data"], out_dir=out)
    before, after = load_model_state(assets["model"]), load_model_state(out)
    vis = [k for k in before if ".visual." in f".{k}"]
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    frozen = [k for k in vis if "merger" not in k]
    assert frozen and any("blocks" in k for k in frozen) and any("patch_embed" in k for k in frozen)
    assert not moved & set(frozen)
    assert any("merger" in k for k in moved) and any(".visual." not in f".{k}" for k in moved)


@pytest.mark.parametrize("max_tokens", [None, 700])
def test_packed_sft_loss_equals_one_forward_per_sequence(assets, tmp_path, max_tokens) -> None:
    """sft_loss packs the batch (main and sub-agent rows) into micro-batches of one forward
    each: the same NLL and the same gradient of every parameter as one ``sequence_logprobs``
    forward per sequence (fp32), with one micro-batch and with a 700-token budget (several).
    One record appears twice, so its two main rows share their prompt (``algo.share_prefix``,
    encoded once)."""
    from paravt.algo.logprobs import sequence_logprobs
    from paravt.algo.packing import microbatches, pack_units
    from paravt.data.readers import load_samples
    from paravt.models import load_model
    from paravt.models.prefix import prefix_groups
    from paravt.sft import encode_records, sft_loss
    from paravt.types import SequenceUnit

    cfg = _cfg(assets, tmp_path)
    bundle = load_model(assets["model"], device="cpu")
    model = bundle.model
    recs = [r for r in read_sft_records(Path(assets["data"]) / "sft.jsonl") if len(r.turns) > 1]
    trajs = encode_records(recs[:2] + recs[:1], load_samples(assets["data"]), bundle, cfg)
    assert {t.role for t in trajs} == {"main", "sub"} and len(trajs) >= 4
    tokens = float(sum(sum(t.loss_mask) for t in trajs))
    packed = pack_units([SequenceUnit(t, [], 0.0, t.group_id) for t in trajs], share_prefix=True)
    assert [g.members for g in prefix_groups(packed, range(len(trajs)))] == [
        tuple(i for i, t in enumerate(trajs) if t.role == "main" and t.uid == trajs[0].uid)
    ]
    if max_tokens:  # the budget really splits the batch
        assert len(microbatches(packed, 700)) > 2
    assert sum(len(t.tokens) for t in trajs) <= 16384  # the default budget: one forward

    model.zero_grad(set_to_none=True)
    ref = torch.zeros(())
    for t in trajs:
        mask = torch.tensor(t.loss_mask, dtype=torch.float32)
        mm = t.extras["mm_token_type_ids"]
        lp, _ = sequence_logprobs(model, t.tokens, list(mm), t.visuals, target_mask=mask)
        ref = ref - (lp * mask).sum()
    (ref / tokens).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad(set_to_none=True)
    calls: list[int] = []
    hook = model.model.language_model.register_forward_hook(lambda *_: calls.append(1))
    try:
        nll, count = sft_loss(
            model, trajs, global_tokens=tokens, max_tokens=max_tokens, share_prefix=True
        )
    finally:
        hook.remove()
    # One language-model forward per micro-batch, not one per sequence.
    assert len(calls) == len(microbatches(packed, max_tokens or 16384)) < len(trajs)
    assert count == tokens
    assert nll == pytest.approx(float(ref.detach()), rel=1e-6)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and len(got) > 10
    for n, g in want.items():
        err = float((got[n] - g).norm() / g.norm().clamp_min(1e-12))
        assert err <= 1e-5, f"{n}: relative gradient error {err:.2e}"
