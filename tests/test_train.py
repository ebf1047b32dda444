"""End-to-end PARA-GRPO on the tiny model: a 2-step smoke run of the default preset, frame
gating inside real prompts, config errors before loading, metrics and the run folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from paravt.config import ConfigError, load_config
from paravt.metrics import STEP_METRICS, read_metrics


def small_overrides(assets: dict[str, str], out: Path, **extra: object) -> list[str]:
    """Tiny shapes: 2 prompts x G=2, few tokens, K in {2, 4}, one tool turn."""
    kv = {
        # Its own task folder (the default task, at these settings): the session's shared
        # assets["data"] is never regenerated under other tests.
        "data.synth_dir": str(out.parent / f"{out.name}-synth"),
        "data.synth_num_videos": 2,
        "model.tiny_dir": assets["model"],
        "train.out_dir": str(out),
        "train.prompts_per_step": 2,
        "train.steps": 2,
        "train.save_every": 1,
        "train.eval_prompts": 0,
        "train.progress": False,
        "rollout.group_size": 2,
        "rollout.max_new_tokens": 8,
        "rollout.sub_max_new_tokens": 4,
        "agent.max_turns": 1,
        "agent.max_tool_response_tokens": 8,
        "video.frame_budgets": [2, 4],
        "video.fixed_frames": 2,
        "sft.steps": 1,
        "sft.batch_size": 2,
        # An untrained model's rewards are equal within a group (advantage 0: no policy
        # gradient, correctly). A bias makes every advantage non-zero so the update is real.
        "algo.adv_bias": 0.1,
    }
    kv.update(extra)
    return [f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in kv.items()]


def test_default_preset_two_steps_updates_parameters_and_logs_every_metric(assets, tmp_path):
    from paravt.checkpoint import latest_checkpoint, load_model_state
    from paravt.train import run

    out = tmp_path / "run"
    cfg = load_config(overrides=small_overrides(assets, out))
    res = run(cfg)

    rows = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        missing = [k for k in STEP_METRICS if r.get(k) is None]
        assert not missing, f"step {r['step']} lacks {missing}"
        assert any(k.startswith("acc/K") for k in r) and any(k.startswith("tool_rate/K") for k in r)
        assert torch.isfinite(torch.tensor(r["loss"]))
        assert r["grad_norm"] > 0
        assert 0.0 <= r["format_compliance"] <= 1.0 and 0.0 <= r["tool_call_rate"] <= 1.0
        # The rollout's parts fit inside it; the packed tokens hold every generated one.
        parts = ("time/overview", "time/main_gen", "time/crops", "time/sub_gen")
        assert all(r[k] >= 0 for k in parts) and r["time/main_gen"] > 0
        assert sum(r[k] for k in parts) <= r["time/rollout"]
        assert r["packed_tokens"] > r["trained_tokens"] > 0
    assert res.last["loss"] == rows[-1]["loss"]

    # Parameters changed: the step-2 checkpoint differs from the SFT starting point.
    start = load_model_state(out / "sft")
    end = load_model_state(latest_checkpoint(out))
    assert latest_checkpoint(out).name == "step_000002"
    # The preset freezes the vision tower's blocks in RL (algo.freeze_vision_tower), not its
    # mergers.
    assert cfg.algo.freeze_vision_tower
    frozen = [k for k in start if ".visual." in f".{k}" and "merger" not in k]
    assert frozen and all(torch.equal(start[k], end[k]) for k in frozen)
    changed = [k for k in start if not torch.equal(start[k], end[k])]
    trainable = len(start) - len(frozen)
    assert len(changed) > trainable // 2, f"only {len(changed)}/{trainable} tensors moved"
    assert any(".merger." in k for k in changed)

    # The run folder.
    assert (out / "config.yaml").read_text().count("prompts_per_step: 2") == 1
    assert (out / "summary.png").stat().st_size > 1000
    assert list((out / "tb").glob("events.out.tfevents.*"))
    trajs = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
    assert {t["step"] for t in trajs} == {1, 2} and all(t["turns"] for t in trajs)
    # The checkpoint is an HF directory transformers loads directly.
    from transformers import Qwen3VLForConditionalGeneration

    Qwen3VLForConditionalGeneration.from_pretrained(latest_checkpoint(out), local_files_only=True)


def _overview_frames(traj, tpatch: int = 2) -> int:
    """Frames in the main prompt's overview clip (grid t x temporal patch)."""
    return int(traj.visuals.grid_thw[0, 0]) * tpatch


@pytest.mark.parametrize("gating", [True, False])
def test_frame_budget_reaches_the_prompt(assets, tmp_path, gating: bool) -> None:
    """K drawn per prompt is what the model sees (overview frames == K), the same for the
    whole group; with gating off every prompt sees video.fixed_frames."""
    from paravt.agent.loop import AgentRunner
    from paravt.algo.gating import frame_budget
    from paravt.data.readers import load_samples
    from paravt.engines.hf import HFEngine
    from paravt.models import load_model

    cfg = load_config(
        overrides=small_overrides(
            assets, tmp_path, **{"video.gating": gating, "video.frame_budgets": [2, 4, 6]}
        )
    )
    samples = load_samples(assets["data"])
    bundle = load_model(assets["model"], device="cpu")
    runner = AgentRunner(HFEngine(bundle), bundle, cfg)
    ks = [
        frame_budget(s.id, seed=0, epoch=0, budgets=cfg.video.frame_budgets, gating=gating,
                     fixed=cfg.video.fixed_frames)
        for s in samples
    ]  # fmt: skip
    if gating:
        assert len(set(ks)) > 1  # K varies across the prompts of this dataset
    else:
        assert set(ks) == {cfg.video.fixed_frames}
    groups = runner.rollout(samples, ks, group_size=2, seed=0).groups
    assert len(groups) == len(samples)
    for g, k in zip(groups, ks):
        assert g.num_frames == k
        for t in g.trajectories:
            assert t.num_frames == k
            assert _overview_frames(t) == k


def test_config_errors_are_reported_before_loading(tmp_path) -> None:
    from paravt.validate import validate_run

    cfg = load_config(overrides=[f"train.out_dir={tmp_path}", "train.prompts_per_step=3"])
    with pytest.raises(ConfigError, match="not divisible by the world size 2"):
        validate_run(cfg, world_size=2)
    cfg = load_config(overrides=[f"sft.data={tmp_path}/missing.jsonl"])
    with pytest.raises(ConfigError, match="sft.data"):
        validate_run(cfg, world_size=1)
    # Own data (issue 50 item 11): the default's cold start needs SFT records; say so first.
    own = tmp_path / "own"
    own.mkdir()
    cfg = load_config(overrides=[f"data.path={own}"])
    with pytest.raises(ConfigError, match=r"sft.steps=4000: .* has no sft.jsonl. Either give") as e:
        validate_run(cfg, world_size=1)
    assert "sft.data=FILE.jsonl" in str(e.value) and "sft.steps=0" in str(e.value)
    validate_run(load_config(overrides=[f"data.path={own}", "sft.steps=0"]), world_size=1)
    cfg = load_config(overrides=["train.resume=true", f"train.out_dir={tmp_path}/nope"])
    with pytest.raises(ConfigError, match="nothing to resume"):
        validate_run(cfg, world_size=1)


def test_k_too_large_for_the_model_context(assets, tmp_path) -> None:
    from paravt.validate import validate_run

    cfg = load_config(
        overrides=[
            f"model.path={assets['model']}",
            "video.frame_budgets=[4,4096]",
            "video.overview_max_pixels=65536",
        ]
    )
    with pytest.raises(ConfigError, match="K=4096"):
        validate_run(cfg, world_size=1)


def test_k_too_large_for_the_vllm_context(assets) -> None:
    """vLLM serves at most rollout.vllm_max_model_len tokens (0: the model's, capped): a budget
    the model itself could hold must still fit that, checked before anything loads."""
    from paravt.validate import validate_run

    fits = [f"model.path={assets['model']}", "video.frame_budgets=[4,64]"]
    validate_run(load_config(overrides=fits), world_size=1)  # the HF engine: fits
    cfg = load_config(overrides=[*fits, "rollout.engine=vllm", "rollout.vllm_max_model_len=1024"])
    with pytest.raises(ConfigError, match=r"K=64 .*rollout.vllm_max_model_len -> 1024"):
        validate_run(cfg, world_size=1)


def test_cli_rejects_bad_config_before_loading(tmp_path, monkeypatch, capsys) -> None:
    from paravt.train import main

    out = tmp_path / "never"
    assert main([f"train.out_dir={out}", "algo.kl_type=k9"]) == 2
    assert "algo.kl_type" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun would set it
    assert main([f"train.out_dir={out}", "train.prompts_per_step=3"]) == 2
    assert "world size 2" in capsys.readouterr().err
    assert not out.exists()  # nothing was created, generated or loaded


def _forbid_building(monkeypatch) -> None:
    """Make every way of building or loading a model (or generating data) fail the test."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a model was built or loaded before the input was validated")

    monkeypatch.setattr("paravt.assets.build_tiny_checkpoint", forbidden)
    monkeypatch.setattr("paravt.assets.generate_from_config", forbidden)
    monkeypatch.setattr("paravt.train.load_model_from_config", forbidden)
    monkeypatch.setattr("paravt.train.run_sft", forbidden)


@pytest.mark.parametrize("split", ["train", "val"])
def test_bad_data_row_is_reported_before_any_model_loads(
    tmp_path, monkeypatch, capsys, split: str
) -> None:
    """A malformed row (here ``options: 5``) is read and reported before the policy, the
    reference or the engine is built: file, row and field, no traceback, exit status 2."""
    from paravt.train import main

    _forbid_building(monkeypatch)
    monkeypatch.chdir(tmp_path)  # the tiny model's default folder, were it built
    data = tmp_path / "data"
    data.mkdir()
    (data / "v.mp4").write_bytes(b"")  # present (rows with a missing video are dropped)
    good = {"id": "a", "video": "v.mp4", "question": "q", "answer": "A", "question_type": "oe"}
    bad = {**good, "id": "b", "options": 5}
    rows = {"train": [good, good | {"id": "c"}], "val": [good]}
    rows[split].append(bad)
    for name, rs in rows.items():
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
    out = tmp_path / "out"
    argv = [f"data.path={data}", f"train.out_dir={out}", "train.progress=false", "sft.steps=0"]
    rc = main(argv)
    cap = capsys.readouterr()
    err = cap.err
    assert rc == 2, err
    # The console gets a one-screen summary; every setting is in the run folder's config.yaml.
    assert f"[train] run folder {out}" in cap.out and "viewer_thumb_px" not in cap.out
    assert "viewer_thumb_px" in (out / "config.yaml").read_text()
    line = len(rows[split])
    assert f"{data / f'{split}.jsonl'}:{line}: 'options' is int 5" in err, err
    assert "data.path" in err  # the fix names the setting that points at the file
    assert "Traceback" not in err


def test_paper_preset_without_model_path_fails_before_anything_is_built(
    tmp_path, monkeypatch, capsys
) -> None:
    """The Qwen3-VL-8B recipe with no ``model.path`` used to generate the synthetic task and
    build the tiny model, then die in transformers' FlashAttention2 import."""
    from paravt.train import main

    _forbid_building(monkeypatch)
    monkeypatch.chdir(tmp_path)  # a fresh folder
    for preset in ("qwen3vl_8b_paragrpo", "qwen3vl_8b_vanilla"):
        assert main(["--preset", preset]) == 2
        err = capsys.readouterr().err
        assert f"preset '{preset}'" in err and "model.path" in err, err
        assert "model.path=" in err  # how to set it
        assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing generated, built or written


def test_flash_attention_needs_cuda_and_the_flash_attn_package(tmp_path, monkeypatch) -> None:
    import importlib.util

    from paravt.validate import validate_run

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    base = [f"model.path={ckpt}", f"train.out_dir={tmp_path / 'out'}", "rollout.engine=hf",
            "model.attn_implementation=flash_attention_2"]  # fmt: skip
    cfg = load_config("qwen3vl_8b_paragrpo", overrides=[*base, "model.device=cpu"])
    with pytest.raises(ConfigError) as e:
        validate_run(cfg, world_size=1)
    msg = str(e.value)
    assert "model.attn_implementation='flash_attention_2' needs CUDA" in msg, msg
    assert "model.attn_implementation=sdpa" in msg, msg
    # A CUDA device without the flash-attn package: say which package and the way out.
    real = importlib.util.find_spec
    installed = {"flash_attn": False}

    def find_spec(name: str, *args):
        if name in installed:
            return object() if installed[name] else None
        return real(name, *args)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    cfg = load_config("qwen3vl_8b_paragrpo", overrides=[*base, "model.device=cuda"])
    with pytest.raises(ConfigError) as e:
        validate_run(cfg, world_size=1)
    msg = str(e.value)
    assert "needs the flash-attn package" in msg and "pip install flash-attn" in msg, msg
    assert "model.attn_implementation=sdpa" in msg and "needs CUDA" not in msg, msg
    installed["flash_attn"] = True  # CUDA and the package: accepted
    validate_run(cfg, world_size=1)
    # sdpa needs neither.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    installed["flash_attn"] = False
    sdpa = ["model.device=cpu", "model.attn_implementation=sdpa"]
    validate_run(load_config("qwen3vl_8b_paragrpo", overrides=[*base, *sdpa]), world_size=1)


def test_vllm_engine_without_vllm_fails_before_loading(tmp_path, monkeypatch) -> None:
    """rollout.engine=vllm (the paper presets') is checked before the policy and the
    reference load, not by the engine factory after them."""
    from paravt.validate import validate_run

    why = "ModuleNotFoundError: No module named 'vllm'"
    monkeypatch.setattr("paravt.engines.vllm.vllm_available", lambda: (False, why))
    cfg = load_config(overrides=["rollout.engine=vllm", f"train.out_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"rollout\.engine=vllm needs vLLM.*rollout\.engine=hf"):
        validate_run(cfg, world_size=1)


def test_vanilla_preset_differs_only_in_anchoring_and_gating() -> None:
    from paravt.config import to_dict

    para, van = to_dict(load_config("tiny_cpu")), to_dict(load_config("tiny_cpu_vanilla"))
    diff = {f"{sec}.{k}" for sec in para for k in para[sec] if para[sec][k] != van[sec][k]}
    assert diff == {
        "reward.lambda_anchor",
        "video.gating",
        "video.fixed_frames",
        "train.out_dir",
    }
    assert van["train"]["eval_conditions"] == para["train"]["eval_conditions"]  # same eval
    assert van["reward"]["lambda_anchor"] == 0.0 and not van["video"]["gating"]
    assert van["video"]["fixed_frames"] == max(para["video"]["frame_budgets"])


def test_evaluation_conditions_report_intervals_and_forbid_tools(assets, tmp_path, capsys):
    """``train.eval_conditions``: every condition is scored before and after RL with its 95%
    interval; a ``notools`` condition forces the answer in the first turn (no tool call at all,
    even from a model that calls tools), and the final table carries one row per condition."""
    from paravt.train import run

    out = tmp_path / "run"
    cfg = load_config(
        overrides=small_overrides(
            assets,
            out,
            **{
                "train.steps": 1,
                # 10 videos: 2 held out, one question each in the default (spot) task.
                "data.synth_num_videos": 10,
                "train.eval_prompts": 2,
                "train.eval_samples": 2,
                "train.eval_conditions": ["2:tools", "4:notools", "2:tools:greedy"],
            },
        )
    )
    res = run(cfg)
    for phase in ("before", "after"):
        m = getattr(res, phase)
        # Split by need (the spot rows record need_K2): the two parts cover the prompts.
        parts = [m.get(f"K2_tools/{p}/prompts", 0.0) for p in ("need", "seen")]
        assert sum(parts) == 2.0 and m["K2_tools_greedy/prompts"] == 2.0
        for name in ("K2_tools", "K4_notools", "K2_tools_greedy"):
            for key in ("accuracy", "accuracy_ci95", "format_compliance", "tool_call_rate"):
                assert f"{name}/{key}" in m, f"{phase} lacks {name}/{key}"
            assert m[f"{name}/prompts"] == 2.0
            assert 0.0 <= m[f"{name}/accuracy"] <= 1.0 and m[f"{name}/accuracy_ci95"] >= 0.0
        assert m["K4_notools/tool_calls_per_rollout"] == 0.0
        assert m["accuracy"] == m["K2_tools/accuracy"]  # the first condition, unprefixed
    evals = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "eval_before"]
    assert evals and "K4_notools/accuracy" in evals[-1]
    # A greedy condition rolls out one sample a prompt, the others eval_samples.
    held = [r for r in read_metrics(out / "heldout.jsonl") if r["kind"] == "eval_before"]
    assert {r["condition"]: r["samples"] for r in held} == {
        "K2_tools": 2, "K4_notools": 2, "K2_tools_greedy": 1
    }  # fmt: skip
    table = capsys.readouterr().out
    assert "K=2 tools greedy" in table and "difference" in table  # the paired table
    assert "accuracy K2_tools" in table and "accuracy K4_notools" in table
    assert "summary accuracy K2_tools" in table and "summary accuracy K4_notools" not in table
