"""The engine and benchmark registries: a new engine or benchmark is its module plus one entry
(``paravt.engines.ENGINES``, ``paravt.eval.benchmarks.BENCHMARK_SPECS``), and every stage that
names engines or benchmarks reads the entry, not a spelled-out name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from paravt.config import ConfigError, load_config
from paravt.engines import ENGINES, Engine, EngineSpec, engine_missing, make_engine
from paravt.eval.__main__ import parse_args
from paravt.eval.benchmarks import BENCHMARK_SPECS, Benchmark, benchmark_headline, load_benchmark
from paravt.eval.runner import settings_metric
from paravt.eval.scoring import summarize
from paravt.models.tiny import tiny_checkpoint_args
from paravt.types import Sample


class ShowArgs(Engine):
    """An engine factory that keeps its arguments (``make_engine(cfg, bundle)``)."""

    def __init__(self, cfg: Any, bundle: Any) -> None:
        self.start, self.stop = cfg, bundle

    def generate(self, requests: list[Any]) -> list[Any]:
        return []

    def sync_weights(self, model: Any) -> None:
        return None


def test_a_registered_engine_is_accepted_everywhere_the_names_are_read(monkeypatch) -> None:
    with pytest.raises(ConfigError, match=r"rollout.engine='fake' is not one of hf\|vllm$"):
        load_config(overrides=["rollout.engine=fake"])
    spec = EngineSpec(
        "fake",
        "paravt.engines.hf:from_config",
        "Fake",
        missing="paravt.engines.no_such_module:missing",
        min_head_dim=48,
    )
    monkeypatch.setitem(ENGINES, "fake", spec)
    cfg = load_config(overrides=["rollout.engine=fake"])
    assert tiny_checkpoint_args(cfg)[1] == 48
    assert parse_args(["--benchmark", "synth", "--engine", "fake"]).engine == "fake"
    with pytest.raises(ModuleNotFoundError, match="no_such_module"):  # its availability check
        engine_missing("fake")
    # A factory that shows its arguments (an Engine: sleep / close inherited).
    monkeypatch.setitem(ENGINES, "fake", EngineSpec("fake", "test_registries:ShowArgs", "Fake"))
    assert engine_missing("fake") is None
    built = make_engine(cfg, "bundle")
    assert (built.start, built.stop) == (cfg, "bundle")
    built.sleep()
    built.close()
    # One that builds something else (no sleep / close, which the callers call directly) is
    # refused where it is built, naming what it lacks.
    monkeypatch.setitem(ENGINES, "fake", EngineSpec("fake", "builtins:slice", "Fake"))
    with pytest.raises(TypeError, match=r"built a slice, which has no generate, sync_weights, "
                       r"sleep, close; subclass paravt.engines.engine.Engine"):  # fmt: skip
        make_engine(cfg, "bundle")
    with pytest.raises(ConfigError, match=r"is not one of hf\|vllm\|fake"):
        load_config(overrides=["rollout.engine=other"])


def test_a_registered_benchmark_is_loaded_scored_and_offered(monkeypatch, tmp_path: Path) -> None:
    def adapter(root: Path, bench: str) -> list[Sample]:
        return [
            Sample(f"{bench}-{i}", str(root / "v.mp4"), "q", "1.0-2.0", "tvg") for i in range(3)
        ]

    assert benchmark_headline("fake_tvg") == ""
    monkeypatch.setitem(
        BENCHMARK_SPECS, "fake_tvg", Benchmark("fake_tvg", adapter, "nowhere", headline="mIoU")
    )
    assert [s.id for s in load_benchmark("fake_tvg", tmp_path, limit=2)] == [
        "fake_tvg-0",
        "fake_tvg-1",
    ]
    assert summarize("fake_tvg", [])["metric"] == "mIoU"
    assert settings_metric("fake_tvg") == "mIoU"
    assert parse_args(["--benchmark", "fake_tvg"]).benchmark == "fake_tvg"
    with pytest.raises(ValueError, match="expected one of .*'fake_tvg'"):
        load_benchmark("nope", tmp_path)


def test_headline_spellings() -> None:
    """Other spellings of a registered benchmark get its headline, as before the registry."""
    for name in ("mlvu", "MLVU", "mlvu-dev", "mlvu_test"):
        assert benchmark_headline(name) == "m_avg"
    for name in ("charades_sta", "Charades", "charades-sta"):
        assert benchmark_headline(name) == "mIoU"
    for name in ("videomme", "videomme_sub", "lvbench", "longvideobench", "mmvu", "synth", "b"):
        assert benchmark_headline(name) == ""
    assert settings_metric("mlvu") == "acc" and settings_metric("charades_sta") == "mIoU"
