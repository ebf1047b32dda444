"""The arms of the PARA-GRPO experiments, shared by the ablation (``paravt.experiments``) and
the collapse experiment (``paravt.collapse``), and the test that says a run of one is done.

Both experiments run every arm × seed as its own training run; an arm is PARA-GRPO (the config
as given) with some of its parts switched off by ``key=value`` overrides:

- ``vanilla``: no anchoring, no gating (every prompt sees the largest budget);
- ``anchoring``: anchoring only (no gating);
- ``gating``: gating only (no anchoring);
- ``paragrpo``: both (the config as given);
- ``paragrpo_no_rtool``: both, without the tool reward R_tool (``reward.tool_bonus=0``).

This module sits below both experiment modules (it imports only ``paravt.config`` and
``paravt.metrics``), so neither has to import the other for them.
"""

from __future__ import annotations

from pathlib import Path

from paravt.config import Config, ConfigError
from paravt.metrics import read_metrics

#: Arm name -> one-line description (``ablation.json`` carries it).
ARMS: dict[str, str] = {
    "vanilla": "GRPO: no anchoring, no gating",
    "anchoring": "anchoring only",
    "gating": "gating only",
    "paragrpo": "PARA-GRPO (anchoring + gating)",
    "paragrpo_no_rtool": "PARA-GRPO without R_tool",
}


def arm_overrides(arm: str, cfg: Config) -> list[str]:
    """The ``key=value`` overrides that turn ``cfg`` (PARA-GRPO) into ``arm``."""
    k_max = max(cfg.video.frame_budgets)
    no_anchor = ["reward.lambda_anchor=0.0"]
    no_gating = ["video.gating=false", f"video.fixed_frames={k_max}"]
    table = {
        "vanilla": no_anchor + no_gating,
        "anchoring": no_gating,
        "gating": no_anchor,
        "paragrpo": [],
        "paragrpo_no_rtool": ["reward.tool_bonus=0.0"],
    }
    if arm not in table:
        raise ConfigError(f"--arms: unknown arm {arm!r} (known: {', '.join(ARMS)})")
    return table[arm]


def run_finished(run_dir: Path) -> bool:
    """Whether the run in ``run_dir`` got to its final evaluation (resumed experiments skip it)."""
    return any(r.get("kind") == "eval_after" for r in read_metrics(run_dir / "metrics.jsonl"))
