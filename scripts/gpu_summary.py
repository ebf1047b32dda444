"""summary.json and summary.txt of a prepared device call, rewritten by
scripts/gpu_train_check.sh after its setup and after every step (a command cut at its limit
still brings back what ended).

    python scripts/gpu_summary.py --out OUT --work WORK --call main --steps "probe ..." \
        --plan "setup:100 probe:30 ..." --deadline 450 --timeout 480 [--cuda] [--dry] ...

Per step: status (``ok`` | ``failed`` | ``timeout`` | ``skipped`` | ``running``), rc, seconds,
the limit it ran under and its planned budget, the reason, and the step's own JSON (in OUT, or
in WORK/steps for a step that did not run or whose JSON did not fit the 8 files that come
back). ``gpu_tests``' figures are pytest's closing counts (from its log), ``default_train``'s
the run's evaluations against the README's CPU table.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

# The README's CPU run of the embedded default (make train, seed 0): accuracy and 95% half-width.
CPU_README = {
    "eval_before": {
        "K4_tools": (0.781, 0.109),
        "K4_notools": (0.500, 0.176),
        "K32_notools": (1.0, 0.0),
    },
    "eval_after": {
        "K4_tools": (0.828, 0.107),
        "K4_notools": (0.500, 0.176),
        "K32_notools": (1.0, 0.0),
    },
}


def default_train_figures(d: Path) -> dict[str, Any]:
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
    r: dict[str, Any] = {"train_steps": sum(x["kind"] == "train" for x in rows)}
    for kind in ("eval_before", "eval_after"):
        ev = next((x for x in rows if x["kind"] == kind), None)
        if ev is None:
            continue
        r[kind] = {k: v for k, v in ev.items() if k not in ("step", "kind")}
        cmp = {}
        for name, (c, c_ci) in CPU_README[kind].items():
            g, g_ci = ev.get(f"{name}/accuracy"), ev.get(f"{name}/accuracy_ci95")
            if g is not None:
                cmp[name] = {"run": g, "run_ci95": g_ci, "cpu_readme": c, "cpu_ci95": c_ci,
                             "intervals_overlap": abs(g - c) <= (g_ci or 0) + c_ci}  # fmt: skip
        r[f"{kind}_vs_cpu"] = cmp
    return r


def pytest_figures(log: Path) -> dict[str, Any]:
    """The counts of pytest's closing line: ``ok`` when it ran tests and none failed."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    lines = [x for x in text.strip().splitlines() if not x.startswith("[")]  # not the step's own
    tail = next(
        (x for x in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error)", x)), ""
    )
    r = {
        k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", tail)
    }
    ok = bool(r) and not r.get("failed") and not r.get("error") and not r.get("errors")
    return {"status": "ok" if ok else "failed", "figures": r}


def step_record(name: str, out: Path, work: Path, budget: int | None) -> dict[str, Any] | None:
    rcf, log = work / "steps" / f"{name}.rc", work / "logs" / f"{name}.log"
    rc = secs = limit = None
    if rcf.is_file():
        rc, secs, limit = (int(x) for x in rcf.read_text().split())
    js = out / f"{name}.json"
    if not js.is_file():
        js = work / "steps" / f"{name}.json"
    started = (work / "steps" / f"{name}.started").is_file()
    if rc is None and not js.is_file() and not started:
        return None  # not reached yet
    try:
        fig = json.loads(js.read_text()) if js.is_file() else {}
    except ValueError as e:
        fig = {"status": "failed", "error": f"unreadable step JSON: {e}"}
    if name == "gpu_tests" and rc is not None:
        fig = pytest_figures(log)
    if name == "default_train" and rc == 0:
        try:
            fig = {"status": "ok", **default_train_figures(work / "default_train")}
        except (OSError, ValueError, KeyError) as e:
            fig = {"status": "failed", "error": f"metrics.jsonl: {type(e).__name__}: {e}"}
    status = fig.get("status") or ("running" if rc is None else "ok" if rc == 0 else "failed")
    if rc in (124, 137):
        status = "timeout"
    elif rc not in (0, None) and status in ("ok", "running", "skipped"):
        status = "failed"
    reason = fig.get("reason") or fig.get("error")
    if not reason and fig.get("errors"):
        reason = "; ".join(fig["errors"])
    if status == "timeout":
        reason = f"cut at its limit of {limit} s" + (f" ({reason})" if reason else "")
    return {"status": status, "rc": rc, "seconds": secs, "limit_s": limit, "budget_s": budget,
            "log": "steps.log", "reason": reason, "figures": fig}  # fmt: skip


def summarise(a: argparse.Namespace) -> dict[str, Any]:
    out, work = Path(a.out), Path(a.work)
    plan = {k: int(v) for k, v in (x.split(":") for x in a.plan.split())}
    summary: dict[str, Any] = {
        "call": a.call, "commit": a.commit or None, "gpu": a.gpu or None,
        "plan_gpu": a.card or "torch device memory", "cuda": a.cuda, "dry": a.dry,
        "setup_ok": a.setup_ok, "plan_s": plan, "deadline_s": a.deadline, "timeout_s": a.timeout,
        "elapsed_s": a.elapsed, "log": "steps.log", "steps": {},
    }  # fmt: skip
    problems = work / "setup_problems.txt"
    summary["setup_problems"] = problems.read_text().splitlines() if problems.is_file() else []
    lines = [f"call {a.call} at {a.commit or '?'} on {a.gpu or 'no GPU'} (plan for "
             f"{a.card or 'torch device memory'}); setup "
             + ("ok" if a.setup_ok else "FAILED: " + "; ".join(summary["setup_problems"]))
             + f"; {a.elapsed} s of the {a.deadline} s deadline"]  # fmt: skip
    failed = [] if a.setup_ok else ["setup"]
    for s in a.steps.split():
        rec = step_record(s, out, work, plan.get(s))
        if rec is None:
            continue
        summary["steps"][s] = rec
        if rec["status"] in ("failed", "timeout"):
            failed.append(s)
        lines.append(f"{s}: {rec['status']}"
                     + (f" (rc {rec['rc']}, {rec['seconds']} s of {rec['limit_s']})" if rec["rc"] is not None else "")
                     + (f": {rec['reason']}" if rec["reason"] else ""))  # fmt: skip
        fig = rec["figures"]
        f = fig.get("figures")
        if isinstance(f, dict):
            lines += [
                f"    {k}: {v:.4g}" for k, v in sorted(f.items()) if isinstance(v, (int, float))
            ]
        for k, t in (fig.get("targets") or {}).items():
            lines.append(f"    target {k}: met={t.get('met')} " + ", ".join(
                f"{n}={v:.4g}" for n, v in t.items() if isinstance(v, (int, float))
                and not isinstance(v, bool)))  # fmt: skip
        if isinstance(fig.get("tool_work"), dict):
            lines.append(f"    tool work: {fig['tool_work']}")
    summary["failed"] = failed
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="scripts/gpu_summary.py", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--call", required=True)
    ap.add_argument("--steps", required=True)
    ap.add_argument("--plan", required=True, help="NAME:SECONDS ... (setup included)")
    ap.add_argument("--deadline", type=int, required=True)
    ap.add_argument("--timeout", type=int, required=True)
    ap.add_argument("--elapsed", type=int, default=0)
    ap.add_argument("--commit", default="")
    ap.add_argument("--gpu", default="")
    ap.add_argument("--card", default="")
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--dry", action="store_true")
    ap.add_argument("--setup-failed", dest="setup_ok", action="store_false")
    ap.add_argument("--exit-status", action="store_true", help="exit 1 when a step failed")
    a = ap.parse_args(argv)
    s = summarise(a)
    return 1 if a.exit_status and s["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
