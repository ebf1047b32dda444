"""fp32 master weights under bf16 compute (``train.master_dtype``, ``paravt.distributed.Precision``).

At the reference recipe's lr (2e-6) an AdamW step moves a weight by about the lr, below half a
bf16 ulp of most weights (a weight of 0.02 has ulp 1.2e-4): bf16 parameters keep almost none
of their updates. The tiny model trained 20 steps at lr 2e-6 under bf16 compute must move its
(bf16-cast) weights like the same run in fp32, and follow its loss and reward; bf16 masters
(the opt-in, and the only path before masters existed) move far fewer.

Measured on the 2-core machine (frozen vision tower excluded): share of bf16-cast weights moved
after 20 steps, fp32 0.204, bf16 compute + fp32 masters 0.200, bf16 masters 0.025. The tiny
model is random (no cold start), so its reward is flat (-0.5: every 6-token answer leaves
``<think>`` open) and its loss is the advantage bias times the ratio: (b) checks that the
mixed run follows the fp32 one there, to bf16's round-off in the ratio.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_train_resume import tiny_overrides

STEPS = 20
LR = 2e-6


def _run(assets: dict[str, str], out: Path, *extra: str) -> tuple[dict, list[dict], Path]:
    from paravt.checkpoint import load_model_state
    from paravt.config import load_config
    from paravt.metrics import read_metrics
    from paravt.train import run

    cfg = load_config(
        overrides=[
            *tiny_overrides(assets, out, STEPS),
            f"algo.lr={LR}",
            "train.save_every=0",
            *extra,
        ]
    )
    run(cfg)
    rows = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    ckpt = out / "checkpoints" / f"step_{STEPS:06d}"
    return load_model_state(ckpt), rows, ckpt


def _moved_share(init: dict, final: dict) -> float:
    """Share of the trained weights whose bf16 cast changed (the frozen vision tower out)."""
    moved = total = 0
    for k, v in final.items():
        if k.startswith("model.visual.") and ".merger" not in k:
            continue  # algo.freeze_vision_tower: never trained
        a, b = init[k].to(torch.bfloat16), v.to(torch.bfloat16)
        moved += int((a != b).sum())
        total += a.numel()
    return moved / total


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory) -> dict[str, tuple[dict, list[dict], Path]]:
    from paravt.checkpoint import load_model_state

    root = tmp_path_factory.mktemp("precision")
    return {
        "init": (load_model_state(assets["model"]), [], Path(assets["model"])),
        "fp32": _run(assets, root / "fp32", "model.dtype=float32"),
        "mixed": _run(assets, root / "mixed", "model.dtype=bfloat16"),  # masters: float32
    }


def test_bf16_compute_with_fp32_masters_moves_like_fp32(runs) -> None:
    """(a) The share of bf16-cast weights that moved is within 10% of the fp32 run's."""
    init = runs["init"][0]
    fp32, mixed = (_moved_share(init, runs[k][0]) for k in ("fp32", "mixed"))
    print(f"moved: fp32 {fp32:.4f}, bf16 compute + fp32 masters {mixed:.4f}")
    assert fp32 > 0.05  # the run moves something measurable
    assert abs(mixed - fp32) <= 0.10 * fp32
    # The export is the masters' bf16 cast (what plain transformers and vLLM load), and its
    # config.json says so (plain from_pretrained would otherwise load it as float32).
    exported = {v.dtype for v in runs["mixed"][0].values() if v.is_floating_point()}
    assert exported == {torch.bfloat16}
    cfg = json.loads((runs["mixed"][2] / "config.json").read_text())
    assert cfg["dtype"] == cfg["text_config"]["dtype"] == "bfloat16"
    # ... and the run really computed in bf16 (an fp32 forward would repeat fp32's losses).
    assert [r["loss"] for r in runs["mixed"][1]] != [r["loss"] for r in runs["fp32"][1]]


def test_bf16_compute_follows_fp32_loss_and_reward(runs) -> None:
    """(b) Per step: the loss, entropy and gradient norm to bf16 round-off (the ratio of a
    bf16 forward to the bf16 engine's behaviour log-probs is 1 to ~1%; |loss| ~ 0.1), and the
    same reward. On this random tiny model the reward is flat (-0.5 every step, both runs),
    so its check only says that bf16 sampling did not change the answers' format; the loss,
    entropy and gradient-norm checks are the ones with content."""
    a, b = runs["fp32"][1], runs["mixed"][1]
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b):
        assert rb["reward/total"] == pytest.approx(ra["reward/total"], abs=1e-6)
        assert rb["loss"] == pytest.approx(ra["loss"], abs=2e-3)
        assert rb["entropy"] == pytest.approx(ra["entropy"], abs=2e-3)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=0.05)


def test_bf16_masters_are_an_opt_in_that_warns_and_moves_far_less(
    runs, assets, tmp_path, capsys
) -> None:
    """bf16 masters (``train.master_dtype=bfloat16``: the trainer before masters existed)
    keep few of the updates, and the run says so at start."""
    final, _, _ = _run(
        assets, tmp_path / "bf16", "model.dtype=bfloat16", "train.master_dtype=bfloat16"
    )
    err = capsys.readouterr().err
    assert "train.master_dtype=bfloat16" in err and "rounds away" in err
    init = runs["init"][0]
    fp32, bf16 = _moved_share(init, runs["fp32"][0]), _moved_share(init, final)
    print(f"moved: fp32 {fp32:.4f}, bf16 masters {bf16:.4f}")
    assert bf16 < 0.5 * fp32


def test_master_dtype_is_checked() -> None:
    from paravt.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="train.master_dtype=float16 with model.dtype=bfloat16"):
        load_config(overrides=["model.dtype=bfloat16", "train.master_dtype=float16"])
    with pytest.raises(ConfigError, match="model.dtype=float16 under float32 masters needs loss"):
        load_config(overrides=["model.dtype=float16"])
    with pytest.raises(ConfigError, match="train.master_dtype='fp8'"):
        load_config(overrides=["train.master_dtype=fp8"])


def test_mixed_precision_computes_in_bf16_and_steps_fp32_masters(assets) -> None:
    """The mechanism itself, one process: FSDP2 over a group of one, every Linear sees bf16
    weights and inputs in the forward, the sharded parameters' gradients and AdamW's moments
    are float32, and ``cleanup`` takes the group down."""
    import torch.distributed as dist

    from paravt.distributed import DistContext, Precision, cleanup, shard_model
    from paravt.models import load_model

    model = load_model(assets["model"], dtype="float32", device="cpu").model
    ctx = DistContext()
    shard_model(model, ctx, Precision(torch.float32, torch.bfloat16))
    try:
        assert dist.is_initialized() and dist.get_world_size() == 1
        seen: list[tuple[torch.dtype, torch.dtype]] = []

        def hook(mod, args):
            seen.append((mod.weight.dtype, args[0].dtype))

        lin = model.model.language_model.layers[0].self_attn.q_proj
        handle = lin.register_forward_pre_hook(hook)
        ids = torch.randint(0, 1000, (1, 12))
        model(input_ids=ids).logits.float().sum().backward()
        handle.remove()
        assert seen == [(torch.bfloat16, torch.bfloat16)]
        grads = {p.grad.dtype for p in model.parameters() if p.grad is not None}
        assert grads == {torch.float32}
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        opt.step()
        moments = {v.dtype for s in opt.state.values() for k, v in s.items() if k != "step"}
        assert moments == {torch.float32}
        assert {p.dtype for p in model.parameters()} == {torch.float32}
    finally:
        cleanup(ctx)
    assert not dist.is_initialized()


def test_sft_under_mixed_precision_exports_bf16_and_releases_its_group(assets, tmp_path) -> None:
    """One-process SFT with float32 masters under bf16 compute (the cold start of the 8B
    recipe's shape): it trains, exports the bf16 cast with a bf16 config.json, and leaves no
    process group behind."""
    import torch.distributed as dist

    from paravt.checkpoint import load_model_state
    from paravt.config import load_config
    from paravt.sft import run_sft

    cfg = load_config(
        overrides=[
            *tiny_overrides(assets, tmp_path / "run", 1),
            "model.dtype=bfloat16",
            "sft.steps=3",
            "sft.batch_size=2",
        ]
    )
    res = run_sft(cfg, model_dir=assets["model"], data_dir=assets["data"], out_dir=tmp_path / "sft")
    assert res["sft/loss_last"] < res["sft/loss_first"]
    w = load_model_state(tmp_path / "sft")
    assert {v.dtype for v in w.values() if v.is_floating_point()} == {torch.bfloat16}
    assert json.loads((tmp_path / "sft" / "config.json").read_text())["dtype"] == "bfloat16"
    assert not dist.is_initialized()
