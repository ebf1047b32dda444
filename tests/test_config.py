"""Config: presets, YAML + key=value merging, validation errors that name the key."""

from __future__ import annotations

import re

import pytest

from paravt.config import PRESETS, ConfigError, load_config, to_yaml


def test_default_preset_is_tiny_cpu() -> None:
    cfg = load_config()
    assert cfg.rollout.group_size == PRESETS["tiny_cpu"]["rollout.group_size"]
    assert cfg.algo.agg == "token-mean"


def test_reference_recipe_presets() -> None:
    para = load_config("qwen3vl_8b_paragrpo", validate_=False)
    van = load_config("qwen3vl_8b_vanilla", validate_=False)
    for cfg in (para, van):
        assert cfg.rollout.group_size == 8
        assert cfg.rollout.temperature == 0.7
        assert cfg.algo.lr == 2e-6
        assert cfg.algo.clip_low == cfg.algo.clip_high == 0.2
        assert cfg.algo.kl_coef == 0.01
        assert cfg.reward.w_fmt == 1.0
        assert cfg.agent.max_turns == 3 and cfg.agent.max_parallel == 5
    assert para.reward.lambda_anchor == 0.5 and para.video.gating
    assert van.reward.lambda_anchor == 0.0 and not van.video.gating


def test_yaml_then_overrides_win(tmp_path) -> None:
    f = tmp_path / "a.yaml"
    f.write_text("algo:\n  kl_coef: 0.05\n  kl_type: k1\nvideo:\n  frame_budgets: [4, 8]\n")
    cfg = load_config(files=[str(f)], overrides=["algo.kl_coef=0.02", "algo.dual_clip=3.0"])
    assert cfg.algo.kl_coef == 0.02  # override beats file
    assert cfg.algo.kl_type == "k1"  # file beats preset
    assert cfg.video.frame_budgets == [4, 8]
    assert cfg.algo.dual_clip == 3.0
    assert "kl_coef: 0.02" in to_yaml(cfg)


def test_list_and_null_overrides() -> None:
    cfg = load_config(overrides=["video.frame_budgets=[2,4]", "algo.dual_clip=null"])
    assert cfg.video.frame_budgets == [2, 4]
    assert cfg.algo.dual_clip is None


@pytest.mark.parametrize(
    "override, needle",
    [
        ("algo.no_such_key=1", "algo.no_such_key"),
        ("algo.kl_coef=abc", "algo.kl_coef"),
        ("algo.kl_type=k9", "algo.kl_type"),
        ("algo.agg=mean", "algo.agg"),
        ("algo.dual_clip=0.5", "algo.dual_clip"),
        ("video.crop_min_frames=1", "video.crop_min_frames"),
        ("video.backend=ffmpeg", "video.backend"),
        ("model.path=/does/not/exist", "model.path"),
        ("algo.minibatches=3", "algo.minibatches"),
        ("algo.kl_mode=both", "algo.kl_mode"),
        ("agent.crop_mode=pixels", "agent.crop_mode"),
        ("rollout.sub_temperature=-0.1", "rollout.sub_temperature"),
        # Removed: it never reached the loss (see paravt.rewards.format).
        ("reward.token_level_format=true", "reward.token_level_format"),
    ],
)
def test_bad_values_name_the_key(override: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(overrides=[override])


def test_malformed_override_and_unknown_preset(tmp_path) -> None:
    with pytest.raises(ConfigError, match="key=value"):
        load_config(overrides=["algo.kl_coef"])
    with pytest.raises(ConfigError, match="unknown preset"):
        load_config("nope")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(files=[str(tmp_path / "missing.yaml")])


def test_paper_presets_put_k1_kl_in_the_reward() -> None:
    # The reference (AReaL kl_ctl=0.01) applies k1 as a per-token reward penalty; as a loss
    # term k1 has zero expected gradient. The dataclass default stays 'loss'.
    for preset in ("qwen3vl_8b_paragrpo", "qwen3vl_8b_vanilla"):
        cfg = load_config(preset, validate_=False)
        assert (cfg.algo.kl_mode, cfg.algo.kl_type, cfg.algo.kl_coef) == ("reward", "k1", 0.01)
    assert load_config().algo.kl_mode == "loss"


@pytest.mark.parametrize(
    "override, allowed",
    [
        # The ones that used to pass validation and crash after the model loaded.
        ("agent.max_tool_response_tokens=0", ">= 1"),
        ("agent.max_tool_response_tokens=-5", ">= 1"),
        ("rollout.max_batch_size=-1", ">= 0"),
        ("rollout.max_new_tokens=0", ">= 1"),
        ("rollout.sub_max_new_tokens=0", ">= 1"),
        ("video.overview_max_pixels=0", ">= 1"),
        ("video.overview_min_pixels=0", ">= 1"),
        ("video.crop_max_pixels=-1", ">= 1"),
        ("video.cache_frames=-1", ">= 0"),
        ("data.synth_num_videos=0", ">= 1"),
        ("data.max_samples=-1", ">= 0"),
        ("rollout.vllm_max_model_len=-1", ">= 0"),
        ("rollout.vllm_max_num_seqs=0", ">= 1"),
        ("rollout.vllm_kv_cache_gib=0", "> 0"),
        ("rollout.vllm_gpu_memory_utilization=1.5", "in (0, 1]"),
        ("rollout.vllm_tensor_parallel=0", ">= 1"),
        ("reward.w_fmt=-1", ">= 0"),
        ("reward.lambda_anchor=-0.5", ">= 0"),
        ("reward.tool_bonus=-0.2", ">= 0"),
        ("reward.tool_error_penalty=-0.05", ">= 0"),
        ("reward.tool_correct_threshold=1.5", "in [0, 1]"),
        ("algo.lr=0", "> 0"),
        ("algo.weight_decay=-0.1", ">= 0"),
        ("algo.clip_low=0", "in (0, 1]"),
        ("algo.clip_low=1.5", "in (0, 1]"),
        ("algo.clip_high=-0.2", "> 0"),
        ("algo.kl_coef=-0.01", ">= 0"),
        ("algo.adv_scale=0", "> 0"),
        ("algo.adv_eps=-1e-6", ">= 0"),
        ("algo.warmup_steps=-1", ">= 0"),
        ("algo.ppo_epochs=0", ">= 1"),
        ("algo.max_grad_norm=0", "> 0"),
        ("sft.steps=-1", ">= 0"),
        ("sft.lr=0", "> 0"),
        ("sft.batch_size=0", ">= 1"),
        ("sft.vision_lr=-1e-5", ">= 0"),
        ("train.steps=-1", ">= 0"),
        ("train.prompts_per_step=0", ">= 1"),
        ("train.save_every=-1", ">= 0"),
        ("train.keep_last=-1", ">= 0"),
        ("train.log_trajectories=-1", ">= 0"),
        ("train.eval_prompts=-1", ">= 0"),
        ("train.eval_samples=0", ">= 1"),
        ("train.eval_frames=-4", ">= 0"),
    ],
)
def test_out_of_range_numbers_name_key_value_and_range(override: str, allowed: str) -> None:
    key, value = override.split("=")
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    m = re.search(rf"^  - {re.escape(key)}=(\S+) (.*)$", str(e.value), re.M)
    assert m is not None, str(e.value)
    assert float(m.group(1)) == float(value)  # the value as given
    assert f"must be {allowed}" in m.group(2), m.group(0)


@pytest.mark.parametrize("key", ["algo.lr", "reward.w_fmt", "video.crop_fps", "algo.dual_clip"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_floats_are_rejected(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(key) + r"=-?(nan|inf) is not a finite"):
        load_config(overrides=[f"{key}={value}"])


def test_cross_field_ranges() -> None:
    with pytest.raises(ConfigError, match=r"video\.overview_min_pixels=4096 is above "):
        load_config(overrides=["video.overview_min_pixels=4096", "video.overview_max_pixels=1024"])
    with pytest.raises(ConfigError, match=r"video\.crop_min_pixels=4096 is above "):
        load_config(overrides=["video.crop_min_pixels=4096", "video.crop_max_pixels=1024"])
    # adv_eps = 0 divides 0 by 0 for a group of equal rewards, unless std is not used.
    with pytest.raises(ConfigError, match=r"algo\.adv_eps=0"):
        load_config(overrides=["algo.adv_eps=0"])
    assert load_config(overrides=["algo.adv_eps=0", "algo.normalize_std=false"]).algo.adv_eps == 0
    with pytest.raises(ConfigError, match=r"model\.attn_implementation='flash'.*sdpa"):
        load_config(overrides=["model.attn_implementation=flash"])


def test_every_preset_passes_the_range_checks() -> None:
    for name in PRESETS:
        load_config(name, overrides=["model.path="])  # model.path: checked by the trainer


@pytest.mark.parametrize(
    "override, said",
    [
        ("rollout.group_size=1", "rollout.group_size=1: GRPO's baseline is the group's mean"),
        ("train.out_dir=", "train.out_dir is empty"),
        ("train.out_dir=' '", "train.out_dir is empty"),
    ],
)
def test_train_refuses_a_run_that_would_train_on_nothing_or_write_here(
    tmp_path, monkeypatch, capsys, override, said
) -> None:
    """One rollout per prompt has advantage r - mean(r) = 0: a run of nothing, refused as
    greedy sampling is; an empty train.out_dir would put the run into the current folder."""
    import paravt.run as R
    import paravt.train as T

    def started(*a, **k):
        raise AssertionError("the run started: it should have been refused before")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(R, "_run", started)
    assert T.main([override]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing written, here or anywhere in the cwd


def test_train_wandb_without_wandb_is_refused_before_anything_loads(
    tmp_path, monkeypatch, capsys
) -> None:
    """train.wandb=true with no wandb package: exit 2 naming both fixes, before the run
    starts (it used to fail with a traceback once the model had loaded); with the package
    present (a stand-in module here) the check lets the run through."""
    import importlib.machinery
    import sys
    import types

    import paravt.run as R
    import paravt.train as T

    def started(*a, **k):
        raise AssertionError("the run started: it should have been refused before")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(R, "_run", started)
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails, as if uninstalled
    assert T.main(["train.wandb=true"]) == 2
    err = capsys.readouterr().err
    assert "train.wandb=true, but the wandb package is not installed" in err, err
    assert "pip install wandb" in err and "train.wandb=false" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with pytest.raises(AssertionError, match="the run started"):
        T.main(["train.wandb=true"])


def test_eval_takes_overrides_on_both_sides_of_a_flag() -> None:
    from paravt.eval.__main__ import parse_args

    a = parse_args(["agent.max_turns=2", "--benchmark", "synth", "--limit", "3", "seed=1"])
    assert a.overrides == ["agent.max_turns=2", "seed=1"] and a.benchmark == "synth"
    assert a.limit == 3


@pytest.mark.parametrize(
    "command", ["paravt.train", "paravt.eval", "paravt.plan", "paravt.experiments", "collapse"]
)
def test_help_shows_the_presets_the_common_keys_and_their_defaults(command, capsys) -> None:
    """``--help`` of every config-taking command (issue 46 item 4): each preset with its line,
    each of ``COMMON_KEYS`` with its default under tiny_cpu and under the 8B preset as
    ``load_config`` resolves them (read here independently), and where every key lives."""
    import importlib

    from omegaconf import OmegaConf

    from paravt.config import COMMON_KEYS, PRESET_NOTES

    module = {"collapse": "paravt.experiments.collapse"}.get(command, command)
    mod = importlib.import_module(module + (".__main__" if command == "paravt.eval" else ""))
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert set(PRESET_NOTES) == set(PRESETS)  # a new preset gets its line
    for name, note in PRESET_NOTES.items():
        assert re.search(rf"^  {name} +{re.escape(note)}$", text, re.M), name
    tiny = OmegaConf.structured(load_config("tiny_cpu"))
    big = OmegaConf.structured(load_config("qwen3vl_8b_paragrpo", validate_=False))

    def shown(cfg, key: str) -> str:
        v = OmegaConf.select(cfg, key, throw_on_missing=True)
        return "[" + ",".join(map(str, v)) + "]" if OmegaConf.is_list(v) else (str(v) or "''")

    for key in COMMON_KEYS:
        row = re.search(rf"^  {re.escape(key)} +(\S+) +(\S+) +", text, re.M)
        assert row, key
        assert row.group(1) == shown(tiny, key), key
        want = "(required)" if key == "model.path" else shown(big, key)
        assert row.group(2) == want, key
    assert "paravt/config.py" in text and "RUN/config.yaml" in text
