"""One run per run folder: what a ``python -m paravt.train`` run may find in ``train.out_dir``.

``paravt.train.run`` calls :func:`check_run_folder` before anything is written or loaded, and
:func:`record_run` once the folder is its own:

* **A new run (no ``--resume``) into a folder that holds a run is refused** (``ConfigError``,
  exit 2), naming the two ways out: ``--resume`` to continue it, or another (or deleted)
  ``train.out_dir`` to start over. A second run there would append its steps to the old
  ``metrics.jsonl`` (every step twice), let ``keep_last`` prune its own checkpoint against the
  old ones, and leave the next ``--resume`` continuing whichever run saved last. A folder
  "holds a run" when it has metric rows, a checkpoint, a finished or interrupted cold-start
  SFT (:func:`run_evidence`); files a driver writes before starting the run (the experiments'
  ``train.log``) or a run that died before any of these do not count.
* **``--resume`` with other settings is refused** the same way, naming every key that differs
  (old -> new). ``run.json`` records what a run is: the whole resolved configuration and a
  fingerprint of the starting model's files (``paravt.checkpoint.weights_fingerprint``, as the
  evaluation's ``run.json`` does). A resume with another ``model.path``, lr, group size, seed or
  reward weight would otherwise run under the old optimizer state, reference model and data
  order with the new values, and rewrite ``config.yaml`` as if it had always been so. Only
  :data:`RESUME_MAY_CHANGE` may differ: the run's length (``train.steps``, to extend a run),
  and logistics that change no number of the run — logging, checkpoint cadence, the preemption
  grace, the device and memory knobs. The evaluation settings may *not* change: the table
  compares the kept ``eval_before`` row with the new ``eval_after``, which must be one protocol.
  A folder of an older paravt (no ``run.json``) is checked against its ``config.yaml``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from paravt.checkpoint import weights_fingerprint
from paravt.config import Config, ConfigError, to_dict
from paravt.distributed import DistContext, broadcast_object
from paravt.files import write_atomic
from paravt.metrics import read_metrics
from paravt.models.tiny import tiny_checkpoint_args

RUN_FILE = "run.json"
CONFIG_FILE = "config.yaml"

#: Keys a ``--resume`` may change (dotted, as ``key=value`` overrides name them), and why.
RESUME_MAY_CHANGE: dict[str, str] = {
    "train.steps": "the run's length: a resume may extend it",
    "train.resume": "the resume itself",
    "train.resume_fallback": "which intact checkpoint the resume starts from",
    "train.out_dir": "the folder (moved or linked) the run is in",
    "train.progress": "the progress bar",
    "train.wandb": "logging",
    "train.log_trajectories": "logging",
    "train.viewer_max_mb": "the viewer's thumbnails",
    "train.viewer_thumb_px": "the viewer's thumbnails",
    "train.dump_batches": "debug output",
    "train.save_every": "checkpoint cadence",
    "sft.save_every": "the cold-start SFT's state cadence",
    "train.keep_last": "checkpoint retention",
    "train.on_save_error": "checkpoint failure policy",
    "train.async_save": "checkpoint writing in the background: the same checkpoint",
    "train.preempt_grace_s": "the scheduler's notice",
    "train.alarm_window": "alarms (read the metrics, replayed on resume)",
    "train.alarm_tool_frac": "alarms",
    "train.alarm_closure_frac": "alarms",
    "train.alarm_parse_rise": "alarms",
    "train.memory_check": "a check before anything loads (paravt.plan)",
    "model.device": "another machine: same weights and optimizer state",
    "model.gradient_checkpointing": "memory only: the same maths",
    "algo.max_tokens_per_microbatch": "memory only: the same sums, split otherwise",
    "algo.share_prefix": "speed and memory only: the same values, a prompt encoded once",
    "rollout.share_prefix": "prefill speed only: the same tokens and log-probs",
    "train.summary_plot": "a picture of the metrics",
    "video.decode_timeout_s": "decoding logistics",
    "video.cache_frames": "decoding logistics",
    "rollout.vllm_gpu_memory_utilization": "vLLM memory",
    "rollout.vllm_kv_cache_gib": "vLLM memory",
}

_UNRECORDED = object()


def sft_resume_dir(sft_dir: str | Path) -> Path:
    """Where ``paravt.sft.run_sft`` keeps the state of a cold-start SFT stopped by a
    preemption or saved every ``sft.save_every`` steps: the folder ``<run>/sft.resume`` for
    ``<run>/sft`` (``paravt.checkpoint.save_sft_state``: each rank's shards and a small
    ``state.pt``; an older paravt wrote one file, ``<run>/sft.resume.pt``, still read). The
    resumed run continues it."""
    return Path(str(sft_dir) + ".resume")


def base_model_dir(cfg: Config) -> str:
    """The model a run starts from (before its SFT): ``model.path`` or the tiny model's
    directory (``paravt.assets.prepare_model``)."""

    return cfg.model.path or tiny_checkpoint_args(cfg)[0]


def run_record(cfg: Config) -> dict[str, Any]:
    """What ``run.json`` holds: the resolved configuration, the starting model's directory and
    its files' fingerprint ("" while the tiny model is not built yet)."""

    model = base_model_dir(cfg)
    weights = weights_fingerprint(model) if (Path(model) / "config.json").is_file() else ""
    return {
        "model": str(model),
        "weights": weights,
        "config": json.loads(json.dumps(to_dict(cfg))),
    }


def run_evidence(out: str | Path) -> list[str]:
    """What in ``out`` shows that a run trained there ([] for a fresh or empty folder)."""
    out = Path(out)
    found = []
    rows = read_metrics(out / "metrics.jsonl")
    if rows:
        steps = [
            r["step"] for r in rows if r.get("kind") == "train" and isinstance(r.get("step"), int)
        ]
        last = f", steps up to {max(steps)}" if steps else ""
        found.append(f"metrics.jsonl with {len(rows)} rows{last}")
    ckpts = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    if ckpts:
        found.append(f"checkpoints/{ckpts[-1]}")
    if (out / "sft" / "config.json").is_file():
        found.append("sft/ (its cold-start SFT)")
    state = sft_resume_dir(out / "sft")
    for p in (state, Path(str(state) + ".pt")):
        if p.exists():
            found.append(f"{p.name} (an interrupted cold-start SFT)")
    return found


def _record(out: Path) -> dict[str, Any]:
    """``out/run.json`` as a dict ({} when absent, not JSON or no object)."""
    try:
        rec = json.loads((out / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


def training_run_in(out: str | Path) -> str:
    """What in ``out`` shows a training run ("" for none): :func:`run_evidence`, or a
    training ``run.json`` (a run that has just started). ``paravt.eval`` refuses such a folder
    as its ``--out``: its own ``run.json`` would replace the run's, which ``--resume`` needs."""
    out = Path(out)
    found = run_evidence(out)
    rec = _record(out)
    if "config" in rec and "benchmark" not in rec:
        found.append(f"{RUN_FILE} of a training run")
    return "; ".join(found)


def evaluation_in(out: str | Path) -> str:
    """What in ``out`` shows an evaluation (``python -m paravt.eval --out``; "" for none): its
    results or its ``run.json`` (one with a ``benchmark``)."""
    out = Path(out)
    found = [p.name for p in sorted(out.glob("results*.jsonl"))]
    if "benchmark" in _record(out):
        found.append(f"{RUN_FILE} of an evaluation of {_record(out)['benchmark']!r}")
    return "; ".join(found)


def _flat(d: dict[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _saved(out: Path) -> tuple[dict[str, Any] | None, str]:
    """The recorded ``run.json`` of ``out`` (or its ``config.yaml``, from an older paravt), and
    where it came from; ``(None, "")`` when neither exists."""
    f = out / RUN_FILE
    if f.is_file():
        try:
            return json.loads(f.read_text()), str(f)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"{f} is not valid JSON ({e}): the settings of the run in {out} are unknown, so "
                f"--resume cannot check them. Start a new run with another train.out_dir, or "
                f"delete {out}"
            ) from e
    if (out / CONFIG_FILE).is_file():
        from omegaconf import OmegaConf

        conf = OmegaConf.to_container(OmegaConf.load(out / CONFIG_FILE))
        return {"config": conf}, f"{out / CONFIG_FILE} (no {RUN_FILE}: an older paravt)"
    return None, ""


def resume_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``key: old -> new`` for each key of two ``run.json`` records that a resume must keep
    (every key but :data:`RESUME_MAY_CHANGE`; a key the saved record lacks, added by a later
    paravt, is not compared; the fingerprints only when both are known)."""
    old = dict(_flat(saved.get("config") or {}))
    new = dict(_flat(now["config"]))
    lines = []
    for k in new:
        a = old.get(k, _UNRECORDED)
        if k in RESUME_MAY_CHANGE or a is _UNRECORDED or a == new[k]:
            continue
        lines.append(f"  {k}: {a!r} -> {new[k]!r}")
    if saved.get("weights") and now["weights"] and saved["weights"] != now["weights"]:
        lines.append(
            f"  weights of {now['model']}: {saved['weights']} -> {now['weights']} (the starting "
            "model's files changed: other weights, or a copy or rebuild of the same ones)"
        )
    return lines


def check_run_folder(cfg: Config) -> None:
    """Refuse (``ConfigError``) a new run into a folder that holds a run, and a ``--resume``
    with settings other than the run's (module docstring). Reads only: call it before the run
    writes anything (``paravt.train.run``, on every rank, before they connect)."""
    t = cfg.train
    out = Path(t.out_dir)
    if ev := evaluation_in(out):
        raise ConfigError(
            f"{out} holds an evaluation ({ev}), not a training run: a run there would replace "
            "its run.json and mix metric rows with its results. Pass another train.out_dir "
            f"(e.g. train.out_dir={out}-train)"
        )
    if not t.resume:
        found = run_evidence(out)
        if found:
            raise ConfigError(
                f"{out} already holds a training run ({'; '.join(found)}): a new run there "
                "would log its steps after the old ones and mix the two runs' checkpoints. "
                "Either continue that run: rerun with --resume (make train ARGS=--resume), or "
                f"start over: pass another train.out_dir (e.g. train.out_dir={out}-2), or "
                f"delete {out} first"
            )
        return
    if not run_evidence(out):  # nothing of an earlier run would be continued
        return
    saved, where = _saved(out)
    if saved is None:
        return
    diff = resume_differences(saved, run_record(cfg))
    if not diff:
        return
    shown = diff[:20] + ([f"  ... and {len(diff) - 20} more"] if len(diff) > 20 else [])
    raise ConfigError(
        f"--resume: the run in {out} was made with other settings ({where}); resuming it "
        "would continue its optimizer state, reference model and data order under these "
        "(old -> new):\n" + "\n".join(shown) + "\nFix: resume with the same settings (the old "
        "values above), or start a new run with another train.out_dir (or delete "
        f"{out}). A resume may change only {', '.join(sorted(RESUME_MAY_CHANGE))}"
    )


def record_run(cfg: Config) -> None:
    """Write ``run.json`` (atomically) for the run of ``cfg`` in ``train.out_dir``: at the start
    of a run that :func:`check_run_folder` let through, and again once its model is built (the
    tiny model's fingerprint); a resume rewrites it with its allowed changes. Rank 0 only."""
    out = Path(cfg.train.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / RUN_FILE, json.dumps(run_record(cfg), indent=1) + "\n")


def logged_eval(
    out: str | Path, kind: str, step: int | None = None, ctx: Any = None
) -> dict[str, Any]:
    """The last ``kind`` evaluation row (``eval_before`` / ``eval_after``) of ``out``'s
    ``metrics.jsonl`` (at ``step``, when given), or {}: ``paravt.train`` reuses an evaluation
    a resumed run logged already instead of logging it twice. Collective with ``ctx``: rank 0
    (the one that writes the file) reads it and every rank gets its answer, so all ranks
    evaluate or none does."""

    rows: list[dict[str, Any]] = []
    ctx = ctx or DistContext()
    if ctx.is_main:
        rows = [
            r
            for r in read_metrics(Path(out) / "metrics.jsonl")
            if r.get("kind") == kind and (step is None or r.get("step") == step)
        ]
    return broadcast_object(rows[-1] if rows else {}, ctx)
