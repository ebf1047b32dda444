"""The arms of the PARA-GRPO experiments, shared by the ablation (``paravt.experiments``) and
the collapse experiment (``paravt.collapse``), the test that says a run of one is done, and
the shared SFT checkpoint every arm starts from (made once, reused by a rerun).

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

import json
from pathlib import Path
from typing import Any

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


def reused_checkpoint(
    dst: Path, tag: str, stamp: Path | None = None, made: dict[str, Any] | None = None
) -> bool:
    """Whether ``dst`` already holds the experiment's SFT checkpoint (a rerun reuses it).

    With ``stamp``: the settings ``made`` it was trained with are recorded there
    (:func:`train_checkpoint`); a checkpoint made with other settings raises ``ConfigError``
    rather than being mixed into a new experiment."""
    if not (dst / "config.json").is_file():
        return False
    unchecked = ""
    if stamp is not None:
        old = json.loads(stamp.read_text()) if stamp.is_file() else None
        if old is not None and old != json.loads(json.dumps(made)):
            raise ConfigError(
                f"{dst} was trained with other cold-start settings ({stamp}: {old}); use "
                f"another --out or delete {dst} to train the new one"
            )
        if old is None:
            unchecked = f" (no {stamp.name}: its settings are unchecked)"
    print(f"[{tag}] SFT checkpoint {dst} exists: reused{unchecked}", flush=True)
    return True


def train_checkpoint(
    cfg: Config,
    dst: Path,
    tag: str,
    what: str,
    *,
    dirs: tuple[str, str] | None = None,
    stamp: Path | None = None,
    made: dict[str, Any] | None = None,
) -> Path:
    """``paravt.sft.run_sft`` of ``cfg`` into ``dst``, one line of its loss printed as
    ``[tag] what: nll/token ...``; ``dirs``: the (data, model) directories when the caller
    prepared them already (else ``paravt.assets.prepare_assets``). ``made`` is recorded in
    ``stamp`` once the checkpoint is written (:func:`reused_checkpoint` reads it)."""
    from paravt.assets import prepare_assets
    from paravt.distributed import DistContext
    from paravt.sft import run_sft

    ctx = DistContext()
    data_dir, model_dir = dirs if dirs is not None else prepare_assets(cfg, ctx)
    res = run_sft(cfg, model_dir=model_dir, data_dir=data_dir, out_dir=dst, ctx=ctx)
    if stamp is not None:
        stamp.write_text(json.dumps(made, indent=1) + "\n")
    print(
        f"[{tag}] {what}: nll/token {res['sft/loss_first']:.3f} -> {res['sft/loss_last']:.3f} "
        f"({res['sft/seconds']:.0f} s) -> {dst}",
        flush=True,
    )
    return dst
