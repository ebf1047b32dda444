"""``python -m paravt.plan``: the per-rank memory plan, its arithmetic, its CLI and train's check.

The arithmetic is checked term by term against numbers worked out by hand for a made-up
shape (round parameter counts, so every product is visible); the meta-device shapes against
real instantiations and the published parameter counts; the CLI on the 8B preset (a table,
exit 0 on 8 x H100, exit 1 with named fixes on a device too small, in under 30 s).
"""

from __future__ import annotations

import dataclasses
import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from paravt.config import ConfigError, load_config
from paravt.plan import (
    ARCH_DIR,
    GIB,
    Layout,
    ModelShape,
    _text_layer_bytes,
    _vision_layer_bytes,
    check_run,
    format_plan,
    model_shape,
    plan_memory,
)

ROOT = Path(__file__).resolve().parents[1]

# A made-up model: 1000 parameters, 800 trainable, root 200 (all trainable), decoder blocks of
# 100 and vision blocks of 50 parameters; the text dimensions are the tiny model's.
SHAPE = ModelShape(
    source="test", model_type="qwen3_vl", params=1000, trainable=800, root_params=200,
    root_trainable=200, text_block=100, vision_block=50, layers=2, hidden=64, heads=4,
    kv_heads=2, head_dim=16, intermediate=128, vocab=4096, qk_norm=True, v_depth=2,
    v_hidden=64, v_intermediate=128, v_trainable_blocks=True, patch=16, merge=2, tpatch=2,
)  # fmt: skip


def _cfg(*overrides: str):
    return load_config("tiny_cpu", overrides=list(overrides))


def test_layer_bytes_by_hand():
    # bf16 (b = 2), h 64, q = 4 x 16 = 64, kv = 2 x 16 = 32, I 128:
    # norms 2 (4*64 + 2*64) = 768; q/k norms (4 + 2)(64 + 32) = 576;
    # attention 2 (64 + 32) + 2*32 + 2*2*64 = 512; SwiGLU 4*2*128 = 1024.
    assert _text_layer_bytes(SHAPE, 2) == 768 + 576 + 512 + 1024
    # fp32: norms 2 (256 + 256) = 1024; 8 * 96 = 768; 4*96 + 4*32 + 8*64 = 1024; 16*128 = 2048.
    assert _text_layer_bytes(SHAPE, 4) == 1024 + 768 + 1024 + 2048
    # Qwen2.5-VL has no q/k norms.
    assert _text_layer_bytes(dataclasses.replace(SHAPE, qk_norm=False), 2) == 768 + 512 + 1024
    # Vision block, bf16: 2 (9*64 + 2*128).
    assert _vision_layer_bytes(SHAPE, 2) == 2 * (9 * 64 + 2 * 128)


def test_sharded_mixed_precision_terms_by_hand():
    """4 ranks, bf16 compute, fp32 masters, KL on, HF engine, CPU chunk sizes."""
    cfg = _cfg("model.dtype=bfloat16", "algo.kl_coef=0.01")
    pl = plan_memory(cfg, Layout(nproc_per_node=4, device_bytes=1 << 40, gpu=False), SHAPE)
    t = {x.name: x for x in pl.terms}
    assert pl.ranks == 4
    assert t["policy parameters (masters)"].update == 1000 * 4 / 4
    assert t["policy parameters (masters)"].rollout == 1000.0
    assert t["compute copies (unsharded)"].update == (200 + 2 * 100) * 2
    assert t["compute copies (unsharded)"].rollout == 0
    assert t["gradients, sharded"].update == 800 * 4 / 4
    # root + 2 blocks of bf16 gradients, and the fp32 reduce-scatter input of the root (200).
    assert t["gradients, unsharded + reduce-scatter"].update == (200 + 200) * 2 + 200 * 4
    assert t["AdamW moments"].update == t["AdamW moments"].rollout == 2 * 800 * 4 / 4
    # The reference: sharded like the policy on several ranks (auto), 1/4 of its bf16 bytes.
    assert t["reference model"].update == t["reference model"].sync == 1000 * 2 / 4
    assert pl.reference == "shard"
    assert t["HF engine replica"].rollout == 1000 * 2  # sharded policy: the engine's replica
    # KV cache: 2 (k, v) x 2 layers x 2 heads x 16 x 2 B = 256 B per token.
    kv = t["HF engine KV cache + sampling"]
    assert kv.update == 0 and kv.rollout > 0
    assert (kv.rollout - 3 * 80 * 4096 * 4) % 256 == 0  # 80 sub-agent rows' sampling buffers
    # The peak is the larger phase; the sum of the terms.
    assert pl.update == pytest.approx(sum(x.update for x in pl.terms))
    assert pl.peak == max(pl.rollout, pl.update)
    # The push: the largest tensor (4096 x 64) gathered in fp32 and cast to bf16, or cast and
    # checksummed (an int64 copy of its int32 words, 2 x 2 B): 6 B an element either way.
    assert t["weight push transient"].sync == 4096 * 64 * 6


def test_async_push_and_worker_terms_by_hand():
    """Rollout workers: trainer rank 0's bucketed push (bf16 model 2000 B, largest tensor 100
    elements) and the worker's checksum term; the entry's transient (6 B an element) runs
    before its 200 B join the bucket on a CPU, and apart from the bucket on a GPU."""
    s = dataclasses.replace(SHAPE, largest_tensor=100)
    lay = Layout(nproc_per_node=4, device_bytes=1 << 40, gpu=False)
    for over, rollout in ((True, 2000), (False, 0)):
        cfg = _cfg("model.dtype=bfloat16", "rollout.workers=1",
                   f"rollout.weight_sync_overlap={over}")  # fmt: skip
        t = {x.name: x for x in plan_memory(cfg, lay, s).terms}
        # CPU: the overlapped snapshot is the whole model (the 256 MiB bucket is larger than
        # it: one bucket of 2000 B); without overlap one bucket, during the push only.
        assert t["weight push bucket (rank 0)"].sync == 2000
        assert t["weight push bucket (rank 0)"].update == rollout
        assert t["weight push transient"].sync == 100 * 6 - 100 * 2
    # GPU, overlapped: packed into host memory, the device bucket comes after the transient.
    cfg = _cfg("model.dtype=bfloat16", "rollout.workers=1")
    gpu = plan_memory(cfg, dataclasses.replace(lay, gpu=True), s)
    assert gpu.term("weight push transient").sync == max(0, 600 - 2000)
    assert gpu.term("weight push bucket (rank 0)").sync == 2000
    w = {x.name: x.rollout for x in gpu.worker_terms}
    assert w["weight check transient"] == 100 * 2 * 2
    assert w["staged weights (next version)"] == 1000 * 2


def test_single_process_same_dtype_terms_by_hand():
    """One process, fp32 compute = fp32 masters: no FSDP, no compute copies, the engine shares
    the policy; the reference counts only when algo.kl_coef > 0."""
    cfg = _cfg("algo.kl_coef=0")
    pl = plan_memory(cfg, Layout(device_bytes=1 << 40, gpu=False), SHAPE)
    t = {x.name: x for x in pl.terms}
    assert t["policy parameters"].update == 1000 * 4
    assert t["gradients"].update == 800 * 4
    assert t["AdamW moments"].update == 2 * 800 * 4
    assert t["HF engine replica"].rollout == 0
    assert "reference model" not in t and "compute copies (unsharded)" not in t
    # bf16 masters by opt-in (today's path): moments in the parameter dtype, 2 B each.
    bf = _cfg("model.dtype=bfloat16", "algo.kl_coef=0")
    if hasattr(bf.train, "master_dtype"):
        bf.train.master_dtype = "bfloat16"
        t = {x.name: x for x in plan_memory(bf, Layout(device_bytes=1, gpu=False), SHAPE).terms}
        assert t["AdamW moments"].update == 2 * 800 * 2


def test_activations_with_and_without_checkpointing_by_hand():
    tok = 1000
    cfg = _cfg("algo.max_tokens_per_microbatch=1000")
    lay = Layout(device_bytes=1 << 40, gpu=False)
    full = plan_memory(cfg, lay, SHAPE, tokens=tok, visual_share=0.0)
    per_layer = _text_layer_bytes(SHAPE, 4) * tok
    rest = (4 + 4) * 64 * tok + 4 * 64 * tok + 8 * 16 * tok
    assert full.term("activations (1 micro-batch)").update == 2 * per_layer + rest + per_layer
    ck = plan_memory(
        _cfg("algo.max_tokens_per_microbatch=1000", "model.gradient_checkpointing=true"),
        lay, SHAPE, tokens=tok, visual_share=0.0,
    )  # fmt: skip
    # One input per layer, one layer recomputed, the rest, one layer of backward temporaries.
    want = 2 * 4 * 64 * tok + per_layer + rest + per_layer
    assert ck.term("activations (1 micro-batch)").update == want
    assert ck.activations_other == full.term("activations (1 micro-batch)").update
    # Vision patches: share x tokens x merge^2 patches through each of 2 trainable blocks.
    vis = plan_memory(cfg, lay, SHAPE, tokens=tok, visual_share=0.5)
    v_layer = _vision_layer_bytes(SHAPE, 4) * 0.5 * tok * 4
    assert v_layer > per_layer  # so the backward temporaries are a vision layer's now
    want = 2 * per_layer + 2 * v_layer + rest + v_layer
    assert vis.term("activations (1 micro-batch)").update == pytest.approx(want)


def test_meta_shape_matches_a_real_instantiation_of_the_tiny_model():
    import transformers

    from paravt.models.loader import freeze_vit
    from paravt.plan import hf_config

    cfg = _cfg("algo.freeze_vision_tower=false")
    s = model_shape(cfg)
    real = transformers.Qwen3VLForConditionalGeneration(hf_config(cfg, None))
    n = sum(p.numel() for p in real.parameters())
    assert s.params == s.trainable == n
    layer = real.model.language_model.layers[0]
    assert s.text_block == sum(p.numel() for p in layer.parameters())
    vblock = real.model.visual.blocks[0]
    assert s.vision_block == sum(p.numel() for p in vblock.parameters())
    assert s.root_params == n - 2 * s.text_block - 2 * s.vision_block
    frozen = model_shape(_cfg("algo.freeze_vision_tower=true"))  # the tiny preset's setting
    freeze_vit(real)
    assert frozen.params == n and not frozen.v_trainable_blocks
    assert frozen.trainable == sum(p.numel() for p in real.parameters() if p.requires_grad) < n


@pytest.mark.parametrize(
    "name, billions, layers, hidden, vocab",
    [
        # The model cards' counts: 2.13 B, 4.44 B, 8.77 B, 8.29 B.
        ("qwen3vl_2b", 2.13, 28, 2048, 151936),
        ("qwen3vl_4b", 4.44, 36, 2560, 151936),
        ("qwen3vl_8b", 8.77, 36, 4096, 151936),
        ("qwen2_5vl_7b", 8.29, 28, 3584, 152064),
    ],
)
def test_shipped_architectures_have_the_published_sizes(name, billions, layers, hidden, vocab):
    s = model_shape(_cfg(f"model.config={name}"))
    assert round(s.params / 1e9, 2) == billions
    assert (s.layers, s.hidden, s.vocab) == (layers, hidden, vocab)
    c = json.loads((ARCH_DIR / f"{name}.json").read_text())
    assert "weight" not in json.dumps(c)  # dimensions only


def test_unknown_architecture_names_the_shipped_ones():
    with pytest.raises(ConfigError, match="qwen3vl_8b"):
        model_shape(_cfg("model.config=qwen3vl_80b"))


def test_check_run_decides_on_a_made_up_device_size():
    cfg = _cfg("model.config=qwen3vl_8b", "model.dtype=bfloat16", "rollout.engine=vllm",
               "model.gradient_checkpointing=true")  # fmt: skip
    assert check_run(cfg, 8, int(141 * GIB)) == ""
    msg = check_run(cfg, 8, int(40 * GIB))
    assert msg.startswith("memory plan (python -m paravt.plan): the ")
    assert "largest: " in msg and "It would fit with" in msg
    assert "--nnodes" in msg  # more ranks is one of the fixes at 60 GiB


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "paravt.plan", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_cli_8b_preset_on_8_h100_prints_a_table_in_under_30_s():
    # CPU seconds of the child (user + system), not wall time: the machine is shared, and the
    # bound is about the work the command does (about 6 s alone on 2 cores).
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = _plan("--preset", "qwen3vl_8b_paragrpo", "--nproc-per-node", "8", "--gpu", "h100-80gb")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    took = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "qwen3vl_8b.json" in out and "8.767 B parameters" in out
    rows = {line[:42].strip(): line[42:].split() for line in out.splitlines()}
    # 8.767 B fp32 masters over 8 ranks: 4.08 GiB in both phases; moments twice that.
    # Columns: rollout, update, sync (the weight push).
    assert rows["policy parameters (masters)"][:3] == ["4.08", "4.08", "4.08"]
    assert rows["AdamW moments"][:3] == ["8.17", "8.17", "8.17"]
    # The reference model, sharded over the 8 ranks like the policy (auto): 16.33 / 8.
    assert rows["reference model"][:3] == ["2.04", "2.04", "2.04"]
    assert "reference model: shard (auto: 8 trainer ranks)" in out
    # 0.5 x 79.65 GiB, asleep in the update; the push wakes its weights alone (8.767 B x 2 B).
    assert rows["vLLM engine reserve"][:3] == ["39.82", "0.00", "16.33"]
    # The push gathers the largest tensor (the 151936 x 4096 embedding) in fp32 and casts it to
    # bf16, then checksums the cast (an int64 copy of its words): 6 B an element either way
    # (3.48 GiB), while vLLM's layer-wise reload holds one decoder layer (0.36 GiB).
    assert rows["weight push transient"][:3] == ["0.00", "0.00", "3.84"]
    assert "with checkpointing" in out and "without gradient checkpointing would be" in out
    assert ": fits (" in out
    assert took < 30, took


def _plan_here(capsys, *args: str) -> tuple[int, str, str]:
    """``python -m paravt.plan ARGS`` in this process (the 8B test above runs the command
    itself): its exit code, stdout and stderr."""
    from paravt.plan import main

    try:
        rc = main(list(args))
    except SystemExit as e:  # argparse's own errors
        rc = int(e.code or 0)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_too_small_device_exits_1_naming_terms_and_fixes(capsys):
    # A replicated reference model (16.3 GiB a rank) does not fit 70 GiB; the sharded one does.
    rc, out, err = _plan_here(capsys, "--preset", "qwen3vl_8b_paragrpo", "--nproc-per-node", "8",
                              "--device-memory-gib", "70", "algo.ref_placement=replicate")  # fmt: skip
    assert rc == 1
    assert ": does not fit (" in out
    assert "largest: activations (1 micro-batch) 17.3 GiB, reference model 16.3 GiB" in err
    assert "more ranks: --nnodes 2 (16 ranks" in err
    assert "the reference model sharded over the ranks: algo.ref_placement=shard" in err
    rc, out, err = _plan_here(capsys, "--preset", "qwen3vl_8b_paragrpo", "--nproc-per-node", "8",
                              "--device-memory-gib", "70")  # fmt: skip
    assert rc == 0 and ": fits (" in out
    rc, out, err = _plan_here(capsys, "--preset", "tiny_cpu", "--cpu", "--device-memory-gib", "0.3")
    assert rc == 1
    assert "gradient checkpointing: model.gradient_checkpointing=true" in err
    assert "a smaller micro-batch: algo.max_tokens_per_microbatch=8192" in err


def test_cli_errors_name_the_fix(capsys):
    rc, _, err = _plan_here(capsys, "--preset", "tiny_cpu")  # no --gpu / memory, no CUDA here
    assert rc == 2 and "--gpu" in err
    rc, _, err = _plan_here(capsys, "--preset", "tiny_cpu", "--gpu", "h900")
    assert rc == 2 and "h100-80gb" in err


def test_tiny_plan_matches_the_measured_cpu_peak_within_15_percent():
    """scripts/plan_check.py tiny: the update of one 4096-token micro-batch on the tiny model
    (two AdamW steps), measured as resident tensors + the second step's RSS rise."""
    r = subprocess.run(
        [sys.executable, "scripts/plan_check.py", "tiny"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    ratio = float(r.stdout.strip().splitlines()[-1].rsplit(" ", 1)[1])
    assert 0.85 <= ratio <= 1.15, r.stdout


def test_reference_placement_matches_the_rss_of_two_gloo_ranks():
    """scripts/plan_check.py reference on the tiny model (with Qwen's 151936-token vocabulary:
    76 MiB of weights, above the allocator's few MiB of noise; no log-prob pass): the RSS each
    of two gloo ranks holds for the reference, replicated and then sharded by FSDP2, against
    the plan's term; sharded, each rank holds about half."""
    cmd = ["reference", "--model", "tiny", "--tiny-vocab", "151936", "--no-pass"]
    r = subprocess.run(
        [sys.executable, "scripts/plan_check.py", *cmd],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr + r.stdout
    lines = r.stdout.strip().splitlines()
    half = float(next(x for x in lines if x.startswith("shard / replicate")).rsplit(" ", 1)[1])
    *_, replicate, _, shard = lines[-1].split()  # "... replicate R shard S"
    assert 0.5 <= float(replicate) <= 2 and 0.5 <= float(shard) <= 2, r.stdout
    assert half < 0.75, r.stdout


def test_random_init_builds_an_architecture_offline(tmp_path):
    """model.init=random: model.config's architecture (here Qwen3-VL-2B's config narrowed to a
    few MB, real vocabulary) with random weights and the tiny tokenizer, loadable by
    load_model; the token ids of the config are the tokenizer's."""
    from paravt.assets import prepare_model
    from paravt.distributed import DistContext
    from paravt.models import load_model
    from paravt.models.tiny import build_random_checkpoint, model_dir_of, write_narrow_arch

    arch = write_narrow_arch(tmp_path / "small.json")
    cfg = _cfg("model.init=random", f"model.config={arch}", f"model.tiny_dir={tmp_path}/tiny")
    d = prepare_model(cfg, DistContext())
    assert d == model_dir_of(cfg) == str(tmp_path / "random-small-float32")
    b = load_model(d)
    assert b.model.config.text_config.vocab_size == 151936
    assert b.model.config.video_token_id == b.special.video_pad < 4096
    # Qwen3-VL-2B ties lm_head to the embedding: one (151936, 64) matrix.
    assert b.model.config.tie_word_embeddings
    assert b.model.lm_head.weight.data_ptr() == b.model.get_input_embeddings().weight.data_ptr()
    assert 151936 * 64 < sum(p.numel() for p in b.model.parameters()) < 2 * 151936 * 64
    stamp = (Path(d) / "model.safetensors").stat().st_mtime_ns
    assert build_random_checkpoint(d, str(arch), dtype="float32") == Path(d)  # reused
    assert (Path(d) / "model.safetensors").stat().st_mtime_ns == stamp


def test_random_init_needs_no_checkpoint_path_on_the_8b_preset():
    from paravt.config import preset_errors

    cfg = load_config("qwen3vl_8b_paragrpo", overrides=["model.init=random"])
    assert preset_errors("qwen3vl_8b_paragrpo", cfg) == []
    assert preset_errors("qwen3vl_8b_paragrpo", load_config("qwen3vl_8b_paragrpo"))
    with pytest.raises(ConfigError, match="model.init=random needs model.config"):
        _cfg("model.init=random")


def test_train_stops_before_loading_when_the_plan_does_not_fit_the_cuda_device(
    tmp_path, monkeypatch, capsys
):
    """``python -m paravt.train`` on a (made-up) 256 MiB CUDA device: exit 2 with the plan's
    message before any data or model is built; ``train.memory_check=false`` skips the check."""
    import types

    import torch

    import paravt.run
    from paravt import train

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=1 << 28)
    )
    built = []
    monkeypatch.setattr(train, "build_trainer", lambda *a: built.append(a) or 1 / 0)
    monkeypatch.setattr(paravt.run, "init_distributed", lambda *a, **k: built.append(a) or 1 / 0)
    args = ["model.device=cuda", f"train.out_dir={tmp_path}/run", f"data.synth_dir={tmp_path}/d"]
    assert train.main(args) == 2
    err = capsys.readouterr().err
    assert "memory plan (python -m paravt.plan): the update needs" in err
    assert "device has 0.2 GiB" in err and "train.memory_check=false" in err
    assert not built and not (tmp_path / "d").exists()
    with pytest.raises(ZeroDivisionError):  # past the check: the next stage starts
        train.main([*args, "train.memory_check=false"])


@pytest.mark.parametrize(
    "args, said",
    [
        (("--nproc-per-node", "0"), "--nproc-per-node 0 must be >= 1"),
        (("--nproc-per-node", "-2"), "--nproc-per-node -2 must be >= 1"),
        (("--nnodes", "0"), "--nnodes 0 must be >= 1"),
        (("--nnodes", "-1"), "--nnodes -1 must be >= 1"),
        (("--device-memory-gib", "nan"), "--device-memory-gib nan is not a positive number"),
        (("--device-memory-gib", "inf"), "--device-memory-gib inf is not a positive number"),
        (("--device-memory-gib", "-8"), "--device-memory-gib -8 is not a positive number"),
    ],
)
def test_cli_refuses_impossible_layouts_in_one_line(capsys, args, said):
    rc, out, err = _plan_here(capsys, "--preset", "tiny_cpu", "--cpu", *args)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert said in err and "Traceback" not in err


def test_the_engine_terms_come_from_the_engine_registry(monkeypatch) -> None:
    """What an engine holds is asked of its registry entry (issue 52 item 6), not of its name:
    an engine registered under another name with a device-share key gets the reserve term on a
    GPU (given back in the update when its sleep key is on) and its own weights + KV cache on a
    CPU; one without gets the HF replica terms."""
    from paravt.engines import ENGINES, EngineSpec

    spec = EngineSpec(
        "other", "paravt.engines.hf:from_config", "Other", own_weights=True,
        device_share_key="vllm_gpu_memory_utilization", sleep_key="vllm_sleep",
        cpu_kv_cache_key="vllm_kv_cache_gib",
    )  # fmt: skip
    monkeypatch.setitem(ENGINES, "other", spec)
    cfg = dataclasses.replace(_cfg(), rollout=dataclasses.replace(_cfg().rollout, engine="other"))
    gpu = {t.name: t for t in plan_memory(cfg, Layout(device_bytes=100 * GIB), SHAPE).terms}
    reserve = gpu["Other engine reserve"]
    frac = cfg.rollout.vllm_gpu_memory_utilization
    assert reserve.rollout == pytest.approx(frac * 100 * GIB)
    assert reserve.update == (0 if cfg.rollout.vllm_sleep else reserve.rollout)
    assert not any(n.startswith("HF engine") for n in gpu)
    cpu = {t.name for t in plan_memory(cfg, Layout(device_bytes=GIB, gpu=False), SHAPE).terms}
    assert "Other engine (CPU)" in cpu
    hf = {t.name for t in plan_memory(_cfg(), Layout(device_bytes=100 * GIB), SHAPE).terms}
    assert "HF engine replica" in hf and not any("reserve" in n for n in hf)


def test_phases_placement_cache_and_workers_on_the_8b_recipe():
    """Issue 51 items 3 and 7 on the 8B preset (8 x 80 GB): the reference sharded over the
    ranks by default and offloaded on one rank; the cache kept without train.empty_cache (vLLM
    allocates outside PyTorch), named as the fix; the async worker rank's own table."""
    from paravt.plan import fixes, format_plan, model_shape

    cfg = load_config("qwen3vl_8b_paragrpo")
    s = model_shape(cfg)
    assert s.largest_tensor == 151936 * 4096  # the embedding: what the push gathers
    lay = Layout(nproc_per_node=8, device_bytes=int(79.65 * GIB))
    pl = plan_memory(cfg, lay, s)
    t = {x.name: x for x in pl.terms}
    assert pl.reference == "shard" and t["reference model"].rollout == s.params * 2 / 8
    assert t["cached, free (the update's transients)"].rollout == 0
    assert t["vLLM engine reserve"].sync == s.params * 2  # the staged wake: weights only
    # The sync phase holds no gradient, activation or gathered unit.
    for name in ("gradients, sharded", "activations (1 micro-batch)", "compute copies (unsharded)"):
        assert t[name].sync == 0
    kept = plan_memory(_with_train(cfg, empty_cache=False), lay, s)
    k = kept.term("cached, free (the update's transients)")
    transient = sum(x.update for x in pl.terms if x.rollout == 0)
    assert k.rollout == k.sync == transient > 30 * GIB and not kept.fits
    assert "release PyTorch's cache between phases: train.empty_cache=true" in fixes(kept)
    one = plan_memory(cfg, Layout(nproc_per_node=1, device_bytes=int(79.65 * GIB)), s)
    assert one.reference == "offload" and one.term("reference model").rollout == 0
    # Async: 6 trainer ranks, 2 workers; rank 0's push bucket; a vLLM worker keeps the HF
    # model on the host and stages the next version on its device.
    cfg_a = load_config("qwen3vl_8b_paragrpo", overrides=["rollout.workers=2"])
    pa = plan_memory(cfg_a, lay, s)
    # The 1187 MiB bf16 embedding exceeds the 256 MiB bucket: it is sent alone in its own.
    assert pa.term("weight push bucket (rank 0)").update == s.largest_tensor * 2
    w = {x.name: x.rollout for x in pa.worker_terms}
    assert w["HF model (compute dtype)"] == 0 and w["staged weights (next version)"] == s.params * 2
    assert w["vLLM engine reserve"] == 0.5 * lay.device_bytes
    out = format_plan(pa)
    assert (
        "per rollout worker rank" in out and "reference model: shard (auto: 6 trainer ranks)" in out
    )
    # A trainer rank builds an engine only to evaluate: with train.eval_prompts=0 it holds none.
    assert cfg_a.train.eval_prompts > 0 and pa.term("vLLM engine reserve").rollout > 0
    bare = plan_memory(_with_train(cfg_a, eval_prompts=0), lay, s)
    names = {x.name for x in bare.terms}
    assert not {"vLLM engine reserve", "HF engine replica"} & names
    rollout = lambda p: sum(x.rollout for x in p.terms)  # noqa: E731
    assert rollout(bare) < rollout(pa) - 30 * GIB  # (the update phase sets both peaks)


def _with_train(cfg, **kw):
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **kw))


def test_the_vllm_graph_pool_is_a_term_kept_through_the_update_and_push():
    """Issue 61 item 3: with CUDA graphs (``rollout.vllm_enforce_eager=false``, the default)
    the plan counts vLLM's graph pool: inside the engine's share while it generates, held on
    its own through the update and the push by an asleep engine; none when eager. By hand at
    ``vllm_max_num_seqs=64`` on the 8B recipe (hidden 4096, bf16)."""
    from paravt.plan import GRAPH_ACTIVATIONS, GRAPH_FIXED_BYTES, graph_capture_sizes

    cfg = load_config("qwen3vl_8b_paragrpo", overrides=["rollout.vllm_max_num_seqs=64"])
    s = model_shape(cfg)
    assert cfg.rollout.vllm_enforce_eager is False and cfg.rollout.vllm_sleep
    sizes = graph_capture_sizes(64)
    assert sizes == [1, 2, 4, *range(8, 129, 8)]  # capped at 2 x 64 = 128 tokens
    assert graph_capture_sizes(1024)[-1] == 512 and len(graph_capture_sizes(1024)) == 51
    full = [n for n in sizes if n <= 64]
    expect = sum(GRAPH_ACTIVATIONS * n * 4096 * 2 + GRAPH_FIXED_BYTES for n in sizes + full)
    lay = Layout(nproc_per_node=8, device_bytes=int(79.65 * GIB))
    pl = plan_memory(cfg, lay, s)
    g = pl.term("vLLM CUDA graph pool")
    assert (g.rollout, g.update, g.sync) == (0, pytest.approx(expect), pytest.approx(expect))
    eager = plan_memory(
        load_config("qwen3vl_8b_paragrpo", overrides=["rollout.vllm_enforce_eager=true"]), lay, s
    )
    assert "vLLM CUDA graph pool" not in {t.name for t in eager.terms}
    assert pl.update - eager.update == pytest.approx(expect * 1.05)  # with its 5% slack
    # An engine that stays awake holds its whole share in the update: no second count.
    awake = plan_memory(load_config("qwen3vl_8b_paragrpo", overrides=["rollout.vllm_sleep=false"]),
                        lay, s)  # fmt: skip
    assert awake.term("vLLM CUDA graph pool").update == 0


def test_two_nodes_plan_hsdp_per_node_shards_and_the_cross_node_bytes():
    """Issue 61 item 6: over 2 nodes x 8 ranks the plan shards the states over a node's 8
    ranks (HSDP, replicated across the nodes, as ``distributed.train_mesh``) and counts the
    bytes a rank moves across nodes a micro-batch: the gradient shard's all-reduce (~4 GB at
    8B, fp32) instead of the 1-D mesh's all-gathers and reduce-scatter over all 16 ranks
    (~60 GB, train.hsdp=false). On main the plan had neither (16-way shards, no such term)."""
    cfg = _cfg("model.config=qwen3vl_8b", "model.dtype=bfloat16", "rollout.engine=vllm",
               "model.gradient_checkpointing=true")  # fmt: skip
    two = Layout(nproc_per_node=8, nnodes=2, device_bytes=int(80 * GIB))
    h = plan_memory(cfg, two)
    f = plan_memory(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, hsdp=False)), two)
    one = plan_memory(cfg, Layout(nproc_per_node=8, nnodes=1, device_bytes=int(80 * GIB)))
    assert h.hsdp and (h.shard, f.shard, one.shard) == (8, 16, 8) and not f.hsdp
    # Per rank, HSDP holds what one node of 8 holds; FSDP over 16 half of its masters.
    assert h.term("AdamW moments").update == one.term("AdamW moments").update
    assert f.term("AdamW moments").update == pytest.approx(h.term("AdamW moments").update / 2)
    p, t = h.shape.params, h.shape.trainable
    assert one.cross_node_bytes == 0
    assert f.cross_node_bytes == pytest.approx((2 * 2 + 4) * p * 15 / 16)  # bf16 x2 + fp32
    assert h.cross_node_bytes == pytest.approx(2 * (1 / 2) * t * 4 / 8)
    assert f.cross_node_bytes > 10 * h.cross_node_bytes
    assert "8 rank(s) shard the policy (HSDP: replicated across the nodes)" in format_plan(h)
