"""The prepared GPU scripts, checked in CI before any device time is spent on them (issue 49).

- Every package the GPU scripts import without a guard (the scripts named by
  scripts/gpu_train_check.sh and scripts/gpu_check.sh, the tests they run, and the paravt /
  paravt_kernels modules those import at module level, followed transitively) is in the
  device image (scripts/device_packages.txt, with its date) or in the wheels the prepared calls
  carry (the Makefile's GPU_WHEELS). omegaconf was in neither once: ``import paravt.train``
  failed there and every training step died at import.
- What each prepared call carries stays 4 MiB under the device tool's 64 MiB
  (scripts/gpu_carry.py).
- scripts/gpu_train_check.sh's dry run (PARAVT_GPU_DRY=1: every step on the CPU at tiny
  shapes through the same command lines) ends with every step ok: a break such as
  gpu_real_size's ``summarise()`` TypeError or bench/gpu_kernels.py's shadowed
  ``_policy_inputs`` fails here. ~1 min on a 2-core machine.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHELL = [ROOT / "scripts" / "gpu_train_check.sh", ROOT / "scripts" / "gpu_check.sh"]
# Import name -> distribution name, where they differ.
DIST = {"yaml": "pyyaml", "PIL": "pillow", "cv2": "opencv-python-headless",
        "sklearn": "scikit-learn", "google": "protobuf", "liger_kernel": "liger-kernel",
        "cut_cross_entropy": "cut-cross-entropy", "xdist": "pytest-xdist",
        "pytest_benchmark": "pytest-benchmark", "typing_extensions": "typing-extensions",
        "huggingface_hub": "huggingface-hub"}  # fmt: skip
LOCAL = {"paravt", "paravt_kernels", "paravt_startup"}


def _device_packages() -> set[str]:
    lines = (ROOT / "scripts" / "device_packages.txt").read_text().splitlines()
    return {x.strip().lower() for x in lines if x.strip() and not x.startswith("#")}


def _carried_wheels() -> set[str]:
    mk = (ROOT / "Makefile").read_text()
    m = re.search(r"^GPU_WHEELS :=(.*?)(?<!\\)\n", mk, re.S | re.M)
    assert m, "Makefile: GPU_WHEELS not found"
    return {re.split(r"[=<>~\"]", w.strip('"'))[0].lower() for w in m.group(1).split()
            if w != "\\" and w.strip('"')}  # fmt: skip


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside a ``try`` whose handlers catch ImportError / Exception: an optional import."""
    while node in parents:
        child, node = node, parents[node]
        if isinstance(node, ast.Try) and child in node.body:
            for h in node.handlers:
                names = ast.unparse(h.type) if h.type is not None else "Exception"
                if any(n in names for n in ("ImportError", "ModuleNotFoundError", "Exception")):
                    return True
    return False


def _imports(path: Path, module_level_only: bool) -> set[str]:
    """Dotted modules ``path`` imports unguarded (``from a.b import c``: ``a.b`` and ``a.b.c``)."""
    tree = ast.parse(path.read_text())
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    out: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or _guarded(node, parents):
            continue
        if module_level_only:
            p = parents.get(node)
            while p is not None and not isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef)):
                p = parents.get(p)
            if p is not None:
                continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif node.level == 0 and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
        elif node.level and path.parent.name == "kernels":  # relative, inside paravt_kernels
            base = "paravt_kernels" + (f".{node.module}" if node.module else "")
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def _module_file(mod: str) -> Path | None:
    parts = mod.split(".")
    base = {"paravt": ROOT / "paravt", "paravt_kernels": ROOT / "kernels"}.get(parts[0])
    if base is None:
        return None
    p = base.joinpath(*parts[1:])
    for f in (p.with_suffix(".py"), p / "__init__.py"):
        if f.is_file():
            return f
    return None


def _entry_points() -> tuple[list[Path], set[str]]:
    """The Python files and ``-m`` modules the two shell scripts run."""
    files, mods = [], set()
    for sh in SHELL:
        text = sh.read_text()
        for rel in sorted(set(re.findall(r"\b((?:scripts|bench|tests)/\w+\.py)\b", text))):
            files.append(ROOT / rel)
        mods |= set(re.findall(r"-m (paravt[\w.]*)", text))
        # the setup checks' imports (not the probes that only decide whether a step runs)
        for line in re.findall(r'-c "import ([\w., ]+)"', text):
            if "paravt" in line:
                mods |= {m.strip() for m in line.split(",")}
    return files, mods


def third_party_imports() -> dict[str, set[str]]:
    """Top-level third-party import name -> the files that import it (transitively)."""
    files, mods = _entry_points()
    found: dict[str, set[str]] = {}
    seen: set[Path] = set()
    todo = [(f, False) for f in files] + [(f, True) for m in mods if (f := _module_file(m))]
    for m in mods:
        found.setdefault(m.split(".")[0], set()).add("shell -c / -m")
    # paravt/__init__.py runs first for every paravt.* import
    todo.append((ROOT / "paravt" / "__init__.py", True))
    while todo:
        f, module_level = todo.pop()
        if f in seen or not f.is_file():
            continue
        seen.add(f)
        for mod in _imports(f, module_level):
            top = mod.split(".")[0]
            if top in LOCAL:
                mf = _module_file(mod)
                if mf is not None:
                    todo.append((mf, True))
                parts = mod.split(".")
                for i in range(1, len(parts)):  # packages on the way run their __init__
                    pf = _module_file(".".join(parts[:i]))
                    if pf is not None:
                        todo.append((pf, True))
            else:
                found.setdefault(top, set()).add(str(f.relative_to(ROOT)))
    return found


def test_every_gpu_script_import_is_on_the_device_or_carried():
    have = _device_packages() | _carried_wheels()
    assert {"omegaconf", "av", "liger-kernel"} <= _carried_wheels()
    stdlib = set(sys.stdlib_module_names)
    missing = {}
    for top, where in sorted(third_party_imports().items()):
        if top in stdlib or top in LOCAL or top.startswith("_"):
            continue
        if any((ROOT / d / f"{top}.py").is_file() for d in ("scripts", "tests", "bench")):
            continue  # a helper beside the script (sys.path or pytest's rootdir)
        if DIST.get(top, top).lower().replace("_", "-") not in {h.replace("_", "-") for h in have}:
            missing[top] = sorted(where)[:3]
    assert not missing, (
        "imported by the GPU scripts but neither in scripts/device_packages.txt nor in the "
        f"Makefile's GPU_WHEELS (carry its wheel): {missing}"
    )


def test_the_import_walk_sees_paravt_train_and_its_omegaconf():
    imp = third_party_imports()
    assert any("paravt/config.py" in w for w in imp["omegaconf"])
    assert "bench/gpu_kernels.py" in imp["torch"]
    # QuACK is imported under try/except ImportError (not carried: a baseline that skips)
    assert "quack" not in imp and "bench/gpu_kernels.py" in imp["liger_kernel"]


def test_each_prepared_call_keeps_4_mib_under_the_carry_limit():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_carry
    finally:
        sys.path.pop(0)
    r = gpu_carry.carry_report()
    for call, c in r["calls"].items():
        assert c["ok"], f"{call}: {c}"
        assert c["margin_mib"] >= gpu_carry.MARGIN_MIB
    assert r["tree_mib"] < 16  # the tree travels beside the snapshot: keep large files out


@pytest.mark.slow  # ~1 min on an idle 2-core machine (1.7 min under a neighbour's load)
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs for real")
def test_dry_run_of_every_gpu_step_ends_ok(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    steps = "kernel_tests kernel_targets real_size_2b varlen nvdec real_size_big"
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_train_check.sh")], capture_output=True, text=True,
        timeout=400, env={**os.environ, "PY": sys.executable, "OUT": str(out),
                          "PARAVT_GPU_WORK": str(work), "PARAVT_GPU_DRY": "1",
                          "PARAVT_GPU_STEPS": steps, "PARAVT_GPU_CARD": "h200-141gb",
                          "PARAVT_GPU_DRY_VOCAB": "4096"},
    )  # fmt: skip
    s = json.loads((out / "summary.json").read_text())
    assert r.returncode == 0 and s["failed"] == [], r.stdout[-4000:] + r.stderr[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files), files
    assert s["dry"] and s["setup_ok"] and s["plan_gpu"] == "h200-141gb"
    st = s["steps"]
    assert list(st) == steps.split()
    # the kernel tests' files and selection collect; every gpu_kernels section ran, none raised
    assert st["kernel_tests"]["figures"]["figures"]["collected"] > 100
    k = st["kernel_targets"]["figures"]
    assert k["errors"] == [] and st["kernel_targets"]["status"] == "ok"
    for sec in ("linear_logprob", "linear_policy_loss", "policy_loss", "baselines",
                "policy_loss_launches_bytes_graph", "linear_logprob_tiles"):  # fmt: skip
        assert sec in k and "error" not in k[sec], sec
    assert set(k["targets"]) == {"policy_loss_bandwidth", "linear_logprob_memory",
                                 "linear_policy_loss_tflops"}  # fmt: skip
    # the real-size step: figures of every phase, and crops and sub-agents inside the step
    rs = st["real_size_2b"]
    assert rs["status"] == "ok", rs["reason"]
    fig = rs["figures"]["figures"]
    assert fig["update_s"] > 0 and fig["packed_tokens_per_step"] > 0 and "update_mfu" in fig
    tw = rs["figures"]["tool_work"]
    assert tw["crops"] > 0 and tw["sub_agents"] > 0 and tw["tool_calls"] > 0
    assert st["varlen"]["status"] in ("ok", "skipped")  # varlen_attn has no CPU kernel
    nv = st["nvdec"]["figures"]
    assert st["nvdec"]["status"] == "ok" and set(nv["clips"]) == {
        "720p_h264", "720p_hevc", "1080p_h264", "1080p_hevc"}  # fmt: skip
    assert all(c["same_frames"] for c in nv["clips"].values())
    # the plan ran (paravt.plan imports) and chose for the card: 8B (205 GiB) does not fit an
    # H200, 4B (108 GiB) does
    assert st["real_size_big"]["status"] == "ok"
    assert st["real_size_big"]["reason"] == "dry: the plan for h200-141gb chose qwen3vl_4b"
