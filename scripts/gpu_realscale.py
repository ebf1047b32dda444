"""The GPU-only halves of issue 61's real-scale work, as steps of the prepared device calls
(scripts/gpu_train_check.sh, call ``extra``), each behind a probe of whether the code has it.

    python scripts/gpu_realscale.py FEATURE --json OUT.json [--dry]

``FEATURE`` (``FEATURES``):

- ``vllm_graphs`` (item 3): vLLM with CUDA graphs, ``rollout.vllm_enforce_eager`` off on
  CUDA; on the GPU the behaviour log-probs must be equal with graphs after a sleep/wake. Needs
  ``vllm``, which the device image lacks and whose CUDA wheel is far over the 64 MiB a call
  carries: until one of the two changes this step reports that. The same step runs item 5's
  vLLM half: after a push vLLM's own parameters are compared by element sum with what was
  pushed (``tests/test_vllm_engine.py -k checked_against``); on a GPU the fused and linear
  weights are compared too (the CPU's vLLM moves them into oneDNN handles: 22 of 64 there).
- ``copy_stream`` (item 5): the weight push copies its buckets on a dedicated CUDA stream, so
  the next step's compute on the default stream is not held up. Besides its tests, measured
  here: the push alone, a bf16 matmul loop alone, and both together (``push_overlap``).
- ``hsdp`` (item 6): HSDP meshes (shard within a node, replicate across); one GPU runs the
  CUDA half only (a 2-D mesh of one rank over NCCL), the two-node part is the CPU's gloo test.

Per feature, in order: the probe (``detect``) looks for the code the item adds; missing, the
step is ``skipped`` with reason ``not implemented yet: ...`` naming what it looked for (exit 0:
nothing was wrong with the device or the script). Then the packages it needs; then the CUDA
tests the item ships (``pytest -k SELECT`` over ``TESTS``: none selected is ``skipped``, with
the selection named), then the feature's own measurement, if any. ``failed`` (exit 1) only when
a selected test fails or the measurement raises. Without CUDA and without ``--dry``:
``skipped``; ``--dry`` runs the same path on the CPU (the selected tests then skip there).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Feature:
    item: str  # what issue 61 asks for
    detect: Callable[[], tuple[bool, str]]  # (found, what was looked for)
    tests: tuple[str, ...]  # globs under the tree's root
    select: str  # pytest -k over them
    needs: tuple[str, ...] = ()  # importable modules
    measure: Callable[[bool], dict[str, Any]] | None = None  # (dry) -> figures


def _config_field(section: str, name: str) -> Callable[[], tuple[bool, str]]:
    def detect() -> tuple[bool, str]:
        from paravt import config

        cls = {f.name: f.type for f in dataclasses.fields(config.Config)}[section]
        cls = getattr(config, cls) if isinstance(cls, str) else cls
        found = name in {f.name for f in dataclasses.fields(cls)}
        return found, f"the config key {section}.{name}"

    return detect


def _source_has(module: str, pattern: str) -> Callable[[], tuple[bool, str]]:
    def detect() -> tuple[bool, str]:
        src = inspect.getsource(importlib.import_module(module))
        return re.search(pattern, src) is not None, f"/{pattern}/ in {module}"

    return detect


def push_overlap(dry: bool, mib: int = 1024, tensors: int = 8) -> dict[str, Any]:
    """Seconds of a weight push (``paravt.weight_sync.WeightPublisher``, bucketed, overlapped;
    a group that only records the buffers it is handed), of a bf16 matmul loop on the default
    stream, and of both started together (the loop queued first, then the push). ``overlap`` =
    (push + compute - both) / min(push, compute): 0 when the push waits for the queued
    compute, 1 when it hides entirely behind it. ``dry``: the CPU, 1 MiB, a short loop."""
    from paravt.weight_sync import Spec, WeightPublisher

    dev = torch.device("cpu" if dry else "cuda")
    mib = 1 if dry else mib
    n = mib * (1 << 20) // 2 // tensors  # bf16 elements per tensor
    g = torch.Generator(device=dev).manual_seed(0)
    w = {
        f"layer{i}.weight": torch.randn(n, generator=g, device=dev).bfloat16()
        for i in range(tensors)
    }
    specs = [Spec(k, tuple(t.shape), t.dtype) for k, t in w.items()]
    m = 256 if dry else 8192
    a = torch.randn(m, m, generator=g, device=dev).bfloat16()
    loops = 2 if dry else 60

    class Ctrl:
        def bcast(self, obj: Any = None) -> Any:
            return obj

    class Group:
        def __init__(self) -> None:
            self.bytes = 0
            self.lock = threading.Lock()

        def bcast(self, buf: torch.Tensor) -> None:
            with self.lock:
                self.bytes += buf.numel() * buf.element_size()

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def compute() -> None:
        x = a
        for _ in range(loops):
            x = (x @ a) * 1e-3

    def push(version: int) -> int:
        grp = Group()
        pub = WeightPublisher(Ctrl(), grp, "bucketed", bucket_bytes=256 << 20, overlap=True,
                              device=dev)  # fmt: skip
        pub.push(version, specs, iter(w.items()))
        assert pub.wait(120), "the push's sending thread did not end in 120 s"
        return grp.bytes

    def timed(fn: Callable[[], Any]) -> float:
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t

    timed(compute), timed(lambda: push(0))  # warm-up: kernels, pinned allocations
    t_c = min(timed(compute) for _ in range(2))
    sent: list[int] = []
    t_p = min(timed(lambda: sent.append(push(1))) for _ in range(2))
    t_b = min(timed(lambda: (compute(), sent.append(push(2)))) for _ in range(2))
    return {"device": dev.type, "push_mib": mib, "sent_bytes": sent[-1], "compute_s": t_c,
            "push_s": t_p, "both_s": t_b,
            "overlap": (t_c + t_p - t_b) / max(min(t_c, t_p), 1e-9)}  # fmt: skip


FEATURES: dict[str, Feature] = {
    "vllm_graphs": Feature(
        item="issue 61 items 3 and 5: vLLM with CUDA graphs (rollout.vllm_enforce_eager); "
        "vLLM's copy read back by element sums (on a GPU its linear weights stay readable)",
        detect=_config_field("rollout", "vllm_enforce_eager"),
        tests=("tests/test_*vllm*.py",),
        select="(cuda and graph) or checked_against",
        needs=("vllm",),
    ),
    "copy_stream": Feature(
        item="issue 61 item 5: the weight push's dedicated copy stream",
        detect=_source_has("paravt.weight_sync", r"copy_stream"),
        tests=("tests/test_weight_sync.py",),
        select="cuda and stream",
        measure=push_overlap,
    ),
    "hsdp": Feature(
        item="issue 61 item 6: HSDP (shard within a node, replicate across)",
        detect=_source_has("paravt.distributed", r"(?i)\bhsdp\b|mesh_dim_names"),
        tests=("tests/test_distributed*.py", "tests/test_*hsdp*.py"),
        select="cuda and hsdp",
    ),
}


def run_tests(f: Feature, cuda: bool) -> dict[str, Any]:
    files = sorted({p for g in f.tests for p in glob.glob(str(ROOT / g))})
    if not files:
        return {"selected": 0, "files": []}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "-k", f.select,
           *files]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(r.stdout[-6000:], r.stderr[-2000:], sep="\n", flush=True)
    tail = (r.stdout.strip().splitlines() or [""])[-1]
    counts = {
        k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", tail)
    }
    selected = sum(v for k, v in counts.items() if k != "deselected")
    return {"selected": selected, "counts": counts, "rc": r.returncode,
            "files": [str(Path(p).relative_to(ROOT)) for p in files]}  # fmt: skip


def check(name: str, dry: bool) -> dict[str, Any]:
    f = FEATURES[name]
    res: dict[str, Any] = {"feature": name, "item": f.item}
    found, looked = f.detect()
    res["detected"] = {"found": found, "looked_for": looked}
    if not found:
        return {
            **res,
            "status": "skipped",
            "reason": f"not implemented yet ({f.item}): {looked} not found",
        }
    missing = [m for m in f.needs if importlib.util.find_spec(m) is None]
    if missing:
        return {**res, "status": "skipped",
                "reason": f"{', '.join(missing)} not importable here (vllm: not in the device "
                          "image, and its CUDA wheel is far over the 64 MiB a call carries)"}  # fmt: skip
    cuda = torch.cuda.is_available()
    if not (cuda or dry):
        return {**res, "status": "skipped", "reason": "no CUDA"}
    t = res["tests"] = run_tests(f, cuda)
    if (
        t.get("counts", {}).get("failed")
        or t.get("counts", {}).get("error")
        or t.get("rc", 0) not in (0, 5)
    ):
        return {
            **res,
            "status": "failed",
            "error": f"its CUDA tests: {t.get('counts')} (rc {t.get('rc')})",
        }
    if f.measure is not None:
        res["figures"] = f.measure(dry)
    if not t["selected"] and f.measure is None:
        return {**res, "status": "skipped",
                "reason": f"implemented, but no test in {', '.join(f.tests)} is selected by "
                          f"-k '{f.select}': the GPU half has no check yet"}  # fmt: skip
    return {**res, "status": "ok"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/gpu_realscale.py",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("feature", choices=sorted(FEATURES))
    ap.add_argument("--json", default="")
    ap.add_argument("--dry", action="store_true", help="the same path on the CPU (CI)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        res = check(a.feature, a.dry)
    except Exception as e:  # noqa: BLE001 - recorded, the step fails
        res = {"feature": a.feature, "status": "failed", "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()}  # fmt: skip
        print(res["traceback"], file=sys.stderr)
    res["wall_s"] = time.perf_counter() - t0
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    why = res.get("reason") or res.get("error") or ""
    print(f"[{a.feature}] {res['status']}" + (f": {why}" if why else ""))
    if "figures" in res:
        print(f"[{a.feature}] {json.dumps(res['figures'])}")
    return 1 if res["status"] == "failed" else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
