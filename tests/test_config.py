"""Config: presets, YAML + key=value merging, validation errors that name the key."""

from __future__ import annotations

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
