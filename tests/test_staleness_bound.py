"""Issue 34 item 14: ``rollout.max_staleness`` is bounded, and the staleness histogram logs the
observed staleness values only (a row's size does not grow with η)."""

from __future__ import annotations

import json

import pytest

from paravt.config import MAX_STALENESS, ConfigError, load_config
from paravt.types import Group, Sample, Trajectory
from paravt.workers.pipeline import staleness_metrics


def _group(versions: list[int]) -> Group:
    n = len(versions)
    t = Trajectory("u", "main", "s", 0, [1] * n, [1] * n, [0.0] * n, 0, versions=versions)
    return Group(Sample("s", "v.mp4", "q", "A"), 0, 4, [t])


def test_huge_staleness_is_a_config_error_naming_the_bound() -> None:
    for eta in (MAX_STALENESS + 1, 1_000_000_000):
        with pytest.raises(ConfigError, match=rf"rollout.max_staleness={eta} is above "):
            load_config(overrides=["rollout.workers=1", f"rollout.max_staleness={eta}"])
    cfg = load_config(overrides=["rollout.workers=1", f"rollout.max_staleness={MAX_STALENESS}"])
    assert cfg.rollout.max_staleness == MAX_STALENESS


def test_histogram_has_only_observed_values() -> None:
    """Tokens 0 and 3 versions stale: two histogram keys, not one per value 0 .. η."""
    m = staleness_metrics([_group([5, 5, 2, -1])], version=5)
    hist = {k: v for k, v in m.items() if k.startswith("async/staleness_") and k[16:].isdigit()}
    assert hist == {"async/staleness_0": pytest.approx(2 / 3), "async/staleness_3": 1 / 3}
    assert m["async/staleness_max"] == 3.0 and m["async/versions_in_batch"] == 2.0
    assert len(json.dumps(m)) < 400
    assert staleness_metrics([], version=5) == {
        "async/staleness_max": 0.0,
        "async/staleness_mean": 0.0,
        "async/versions_in_batch": 0.0,
    }


def test_viewer_draws_only_observed_staleness(tmp_path) -> None:
    """An older run logged every value 0 .. η at each step (zeros included): the histogram
    panel draws the values some step observed, not η + 1 flat lines."""
    from paravt.view import write_report

    rows = []
    for step in (1, 2):
        r = {"step": step, "kind": "train", "async/staleness_max": 1.0}
        r |= {f"async/staleness_{d}": 0.0 for d in range(2000)}
        r |= {"async/staleness_0": 0.75, "async/staleness_1": 0.25}
        rows.append(r)
    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = write_report(d).read_text()
    assert "async/staleness_1" in page
    assert "async/staleness_2" not in page and "async/staleness_1999" not in page
    assert len(page) < 200_000
