"""The prepared GPU calls, checked in CI before any device time is spent on them (issues 49, 65).

- Every package the GPU scripts import without a guard (the scripts named by
  scripts/gpu_train_check.sh, scripts/gpu_launch.sh and scripts/gpu_check.sh, the tests they
  run, and the paravt / paravt_kernels modules those import at module level, followed
  transitively) is in the device image (scripts/device_packages.txt, with its date) or in the
  wheels the prepared calls carry (scripts/gpu_wheels.txt). omegaconf was in neither once:
  ``import paravt.train`` failed there and every training step died at import.
- The carried wheels are pinned, one version each, the folder is rebuilt from empty, and a
  folder with two versions of one package is refused by name (pip refuses the whole set).
- What each prepared call carries stays 4 MiB under the device tool's 64 MiB
  (scripts/gpu_carry.py).
- The calls as docs/gpu/README.md gives them: each command under 2,000 characters, only the
  call that needs a card names a kind, its timeout_s and its time plan are the script's
  (``--plan``), the budgets add up under the timeout; and each documented command, run
  exactly as written from an empty folder holding only what it carries (PARAVT_GPU_DRY=1:
  every step on the CPU at tiny shapes through the same command lines), ends with every step
  ok: a break such as gpu_real_size's ``summarise()`` TypeError, bench/gpu_kernels.py's
  shadowed ``_policy_inputs`` or a rerun that needs a warm machine fails here. ~2.5 min on a
  2-core machine for the four calls.
- The device's ``gpu_tests`` step selects every test that skips without CUDA.
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
SHELL = [ROOT / "scripts" / n for n in ("gpu_train_check.sh", "gpu_launch.sh", "gpu_check.sh")]
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


def _gpu_carry():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_carry
    finally:
        sys.path.pop(0)
    return gpu_carry


def _carried_wheels() -> set[str]:
    return set(_gpu_carry().pinned_wheels())


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
        "imported by the GPU scripts but neither in scripts/device_packages.txt nor in "
        f"scripts/gpu_wheels.txt (carry its wheel): {missing}"
    )


def test_the_import_walk_sees_paravt_train_and_its_omegaconf():
    imp = third_party_imports()
    assert any("paravt/config.py" in w for w in imp["omegaconf"])
    assert "bench/gpu_kernels.py" in imp["torch"]
    # QuACK is imported under try/except ImportError (not carried: a baseline that skips)
    assert "quack" not in imp and "bench/gpu_kernels.py" in imp["liger_kernel"]


def test_each_prepared_call_keeps_4_mib_under_the_carry_limit():
    gpu_carry = _gpu_carry()
    r = gpu_carry.carry_report()
    assert set(r["calls"]) == {"main", "extra", "video"}
    for call, c in r["calls"].items():
        assert c["ok"], f"{call}: {c}"
        assert c["margin_mib"] >= gpu_carry.MARGIN_MIB
    assert r["tree_mib"] < 16  # the tree travels beside the snapshot: keep large files out


# ---- the pinned wheels ------------------------------------------------------------------
def _fake_wheels(d: Path, pins: dict[str, str], extra: tuple[str, ...] = ()) -> Path:
    """Empty files named as ``pip download`` names the pinned wheels (the check reads names)."""
    d.mkdir(parents=True, exist_ok=True)
    for name, v in pins.items():
        (d / f"{name.replace('-', '_')}-{v}-py3-none-any.whl").write_bytes(b"")
    for f in extra:
        (d / f).write_bytes(b"")
    return d


def test_every_wheel_is_pinned_and_the_folder_is_rebuilt_from_empty():
    pins = _gpu_carry().pinned_wheels()  # raises on a line that is not NAME==VERSION
    assert {"omegaconf", "av", "setuptools", "transformers"} <= set(pins)
    assert all(re.fullmatch(r"\d+(\.\d+)+", v) for v in pins.values()), pins
    mk = (ROOT / "Makefile").read_text()
    recipe = mk[mk.index("\ngpu-wheels:") + 1 :].split("\n\n")[0].splitlines()[1:]
    assert recipe[0].strip() == "rm -rf .gpu_wheels", recipe  # emptied before the download
    assert "-d .gpu_wheels -r scripts/gpu_wheels.txt" in recipe[1]
    assert "scripts/gpu_carry.py --check-wheels .gpu_wheels" in recipe[2]


def test_two_versions_of_one_package_in_the_wheel_folder_are_refused(tmp_path):
    gc = _gpu_carry()
    pins = gc.pinned_wheels()
    ok = _fake_wheels(tmp_path / "ok", pins)
    assert gc.wheel_problems(ok) == []
    two = _fake_wheels(tmp_path / "two", pins, extra=("setuptools-99.0.0-py3-none-any.whl",))
    errs = gc.wheel_problems(two)
    assert len(errs) == 1 and errs[0].startswith(
        f"setuptools: 2 versions in {two} ({pins['setuptools']}, 99.0.0): pip refuses the whole set"
    ), errs
    (ok / f"omegaconf-{pins['omegaconf']}-py3-none-any.whl").unlink()
    (ok / "numpy-2.5.0-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"")
    errs = gc.wheel_problems(ok)
    assert any(e.startswith("numpy 2.5.0: in ") and "not pinned" in e for e in errs), errs
    assert any(e.startswith(f"omegaconf=={pins['omegaconf']}: pinned but no wheel") for e in errs)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_carry.py"), "--check-wheels",
                        str(two)], capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 1 and "setuptools: 2 versions" in r.stderr


# ---- the documented calls ---------------------------------------------------------------
DOCS = ROOT / "docs" / "gpu" / "README.md"
SECTION = "## Prepared calls (issue 65)"
RUN_RE = re.compile(
    r'run\(command="(?P<cmd>[^"]*)",\s*carry=(?P<carry>\[[^\]]*\])'
    r'(?:,\s*kind="(?P<kind>[\w-]+)")?,\s*timeout_s=(?P<timeout>\d+)\)'
)


def _section() -> str:
    text = DOCS.read_text()
    assert SECTION in text, f"{DOCS}: no section {SECTION!r}"
    rest = text[text.index(SECTION) + len(SECTION) :]
    return rest.split("\n## ", 1)[0]


def documented_calls() -> list[dict]:
    """Every ``run(...)`` of the docs' prepared-calls section."""
    out = []
    for m in RUN_RE.finditer(_section()):
        cmd = m["cmd"]
        call = re.search(r"PARAVT_GPU_CALL=(\w+)", cmd)
        steps = re.search(r"PARAVT_GPU_STEPS=([\w,]+)", cmd)
        out.append({"id": (call[1] if call else "?") + ("-rerun" if steps else ""),
                    "call": call[1] if call else None, "cmd": cmd,
                    "carry": json.loads(m["carry"]), "kind": m["kind"],
                    "timeout": int(m["timeout"]),
                    "steps": steps[1].split(",") if steps else None})  # fmt: skip
    return out


def script_plans() -> dict:
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_train_check.sh"), "--plan"],
                       capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(r.stdout)


def test_the_documented_calls_and_their_time_plans_are_the_scripts():
    calls, plans = documented_calls(), script_plans()
    assert [c["id"] for c in calls] == ["main", "extra", "main-rerun", "video"]
    carries = _gpu_carry().CALLS
    for c in calls:
        assert len(c["cmd"]) <= 2000 and "bash .gpu_snap/launch.sh" in c["cmd"], c
        assert c["carry"] == carries[c["call"]], c  # the wheels too: a fresh machine has none
        assert c["timeout"] <= 600, c
        # only the call that needs the H200's memory names a kind: a kind left out falls back
        # to an H200 when no H100 opens
        assert c["kind"] == ("nvidia-h200" if c["call"] == "video" else None), c
        if c["steps"] is None:
            assert c["timeout"] == plans[c["call"]]["timeout_s"], c
        else:  # a rerun names its deadline, 30 s under its timeout
            deadline = re.search(r"PARAVT_GPU_DEADLINE_S=(\d+)", c["cmd"])
            assert deadline and int(deadline[1]) + 30 == c["timeout"], c
            assert set(c["steps"]) <= set(plans[c["call"]]["steps"]), c
    # the docs' table: per call its kind, timeout_s and plan, equal to the script's
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \| (\d+) \| ([^|]+) \|$", _section(), re.M)
    assert [r[0] for r in rows] == ["main", "extra", "video"], rows
    for call, kind, timeout, plan in rows:
        p = plans[call]
        steps = {k: int(v) for k, v in re.findall(r"([a-z_0-9]+) (\d+)", plan.split("=")[0])}
        assert steps == p["steps"], (call, steps, p["steps"])
        assert int(plan.split("=")[1]) == sum(steps.values()) == p["deadline_s"], call
        assert int(timeout) == p["timeout_s"] and p["deadline_s"] + 30 <= p["timeout_s"] <= 600
        assert ("nvidia-h200" in kind) == (call == "video"), (call, kind)


def _dry_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAVT_GPU")}
    return {**env, "PY": sys.executable, "OUT": str(tmp_path / "out"),
            "PARAVT_GPU_DIR": str(tmp_path / "pv"), "PARAVT_GPU_WORK": str(tmp_path / "work"),
            "PARAVT_GPU_STATE": str(tmp_path / "state"), "PARAVT_GPU_DRY": "1",
            "PARAVT_GPU_CARD": "h200-141gb", "PARAVT_GPU_DRY_VOCAB": "4096"}  # fmt: skip


def _device_tree(tmp_path: Path, extra_wheels: tuple[str, ...] = ()) -> Path:
    """A folder holding only what a call carries: the snapshot (of this working tree) and the
    wheels (empty files under the pinned names: a dry run installs none, it checks them)."""
    gc = _gpu_carry()
    dev = tmp_path / "device"
    gc.snapshot(dev / ".gpu_snap", rev=None)
    _fake_wheels(dev / ".gpu_wheels", gc.pinned_wheels(), extra_wheels)
    return dev


def _check_step(name: str, st: dict) -> None:
    fig = st["figures"]
    if name == "probe":
        assert st["status"] == "ok", st["reason"]
        v = fig["facts"]["versions"]
        assert {"python", "torch", "triton", "numpy", "transformers", "av"} <= set(v)
        assert "libnvcuvid" in fig["facts"]["nvdec"] and "free_gib" not in fig["facts"]["card"]
        assert fig["forward"]["finite"] and fig["forward"]["rel_vs_fp32_cpu"] < 5e-2
    elif name == "real_size_2b":  # figures of every phase, crops and sub-agents in the step
        assert st["status"] == "ok", st["reason"]
        f = fig["figures"]
        assert f["update_s"] > 0 and f["packed_tokens_per_step"] > 0 and "update_mfu" in f
        tw = fig["tool_work"]
        assert tw["crops"] > 0 and tw["sub_agents"] > 0 and tw["tool_calls"] > 0
    elif name == "kernel_targets":  # --targets: every target's section ran, none raised
        assert st["status"] == "ok" and fig["errors"] == [], st["reason"]
        for sec in ("policy_loss_launches_bytes_graph", "linear_logprob", "linear_policy_loss",
                    "baselines"):  # fmt: skip
            assert sec in fig and "error" not in fig[sec], sec
        assert set(fig["targets"]) == {"policy_loss_bandwidth", "linear_logprob_memory",
                                       "linear_policy_loss_tflops"}  # fmt: skip
    elif name == "gpu_tests":  # the same selection; without CUDA each of them skips
        f = fig["figures"]
        assert st["status"] == "ok" and f.get("passed", 0) == 0 and f["skipped"] >= 13, f
    elif name == "varlen":
        assert st["status"] in ("ok", "skipped"), st["reason"]  # no CPU kernel
    elif name in ("copy_stream", "hsdp", "vllm_graphs"):
        assert st["status"] in ("ok", "skipped"), st["reason"]
        if st["status"] == "skipped":
            assert re.match(r"not implemented yet \(issue 61 item \d|.*not importable|"
                            r"implemented, but no test", st["reason"]), st["reason"]  # fmt: skip
    elif name == "nvdec":
        assert st["status"] == "ok" and set(fig["clips"]) == {
            "720p_h264", "720p_hevc", "1080p_h264", "1080p_hevc"}  # fmt: skip
        assert all(c["same_frames"] for c in fig["clips"].values())
    elif name == "real_size_big":  # the plan ran: 8B (205 GiB) does not fit an H200, 4B does
        assert st["status"] == "ok"
        assert st["reason"] == "dry: the plan for h200-141gb chose qwen3vl_4b"
    elif name == "default_train":
        assert st["status"] == "ok" and fig["train_steps"] == 1, st
    else:
        raise AssertionError(f"no check for step {name}")


@pytest.mark.slow  # ~20-70 s each on an idle 2-core machine
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs for real")
@pytest.mark.parametrize("doc", documented_calls(), ids=lambda d: d["id"])
def test_each_documented_call_passes_its_dry_run_from_an_empty_folder(doc, tmp_path):
    plan = script_plans()[doc["call"]]
    dev = _device_tree(tmp_path)
    r = subprocess.run(["bash", "-c", doc["cmd"]], cwd=dev, env=_dry_env(tmp_path),
                       capture_output=True, text=True, timeout=500)  # fmt: skip
    out = tmp_path / "out"
    s = json.loads((out / "summary.json").read_text())
    assert r.returncode == 0 and s["failed"] == [], r.stdout[-4000:] + r.stderr[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files), files
    assert {"steps.log", "summary.json", "summary.txt"} <= set(files)
    assert s["dry"] and s["setup_ok"] and s["plan_gpu"] == "h200-141gb"
    assert s["commit"].endswith("+worktree")  # it ran the snapshot, not the tree it was sent
    steps = doc["steps"] or [k for k in plan["steps"] if k != "setup"]
    assert list(s["steps"]) == steps
    if doc["steps"] is None:
        assert s["plan_s"] == plan["steps"] and s["deadline_s"] == plan["deadline_s"]
    log = (out / "steps.log").read_text()
    assert log.startswith("==== [setup] call=" + doc["call"])
    for name in steps:
        if s["steps"][name]["rc"] is not None and name != "real_size_big":
            assert f"==== [{name}] limit " in log and f"==== [{name}] rc=0 in " in log, name
        _check_step(name, s["steps"][name])
    if "kernel_targets" in steps:
        assert "bench/gpu_kernels.py --targets --dry --out " + str(out) in log


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs for real")
def test_a_call_carrying_two_versions_of_a_wheel_fails_its_setup_by_name(tmp_path):
    dev = _device_tree(tmp_path, extra_wheels=("av-99.0-cp311-abi3-manylinux_2_28_x86_64.whl",))
    env = {**_dry_env(tmp_path), "PARAVT_GPU_STEPS": "varlen"}
    r = subprocess.run(["bash", "-c", "PARAVT_GPU_CALL=main bash .gpu_snap/launch.sh"], cwd=dev,
                       env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert r.returncode == 1 and s["failed"] == ["setup"] and not s["setup_ok"]
    assert (
        s["setup_problems"][0].startswith("the wheels in ")
        and "make gpu-wheels" in s["setup_problems"][0]
    )
    assert "gpu wheels: av: 2 versions in" in (tmp_path / "out" / "steps.log").read_text()


def test_a_call_without_its_snapshot_says_what_to_carry(tmp_path):
    (tmp_path / "device").mkdir()
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_launch.sh")], cwd=tmp_path / "device",
                       env=_dry_env(tmp_path), capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "run 'make gpu-snapshot'" in r.stderr
    assert "carry .gpu_snap" in (tmp_path / "out" / "steps.log").read_text()


# ---- the gpu_tests step selects every test that needs CUDA ---------------------------------
_NEEDS_CUDA = re.compile(
    r"not\s+torch\.cuda\.is_available\(\)|not\s*\([^()]*torch\.cuda\.is_available\(\)\s*\)"
)
# Test files that need more than CUDA: DALI (not in the image; scripts/dali_check.py instead).
NOT_ON_THE_DEVICE = {"test_video_dali.py", "test_video_corpus_dali.py"}


def _cuda_tests(path: Path) -> dict[str, bool]:
    """Tests of ``path`` skipped without CUDA (a skipif on ``not torch.cuda.is_available()`` on
    the test, through a module-level name, or as the module's pytestmark): whether ``-k cuda``
    selects each (``cuda`` in its name or its file's, or a ``pytest.mark.cuda``)."""
    tree = ast.parse(path.read_text())
    marks = {t.id for n in tree.body if isinstance(n, ast.Assign) and _NEEDS_CUDA.search(ast.unparse(n.value))
             for t in n.targets if isinstance(t, ast.Name)}  # fmt: skip
    whole = "pytestmark" in marks
    out = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.FunctionDef) and n.name.startswith("test_"):
            decs = [ast.unparse(d) for d in n.decorator_list]
            if whole or any(_NEEDS_CUDA.search(d) or d in marks for d in decs):
                out[n.name] = "cuda" in n.name or "cuda" in path.name or "pytest.mark.cuda" in decs
    return out


def test_the_gpu_tests_step_selects_every_test_that_needs_cuda():
    text = (ROOT / "scripts" / "gpu_train_check.sh").read_text()
    listed = set(
        re.findall(r"tests/(test_\w+\.py)", text[text.index("GPU_TESTS=(") :].split(")")[0])
    )
    assert "-k cuda" in text and '"${GPU_TESTS[@]}"' in text
    found: dict[str, dict[str, bool]] = {}
    for f in sorted((ROOT / "tests").glob("test_*.py")):
        if f.name not in NOT_ON_THE_DEVICE and (tests := _cuda_tests(f)):
            found[f.name] = tests
    assert set(found) == listed, (
        f"files with CUDA tests {sorted(found)}, the step's {sorted(listed)}"
    )
    missed = {f: [n for n, sel in t.items() if not sel] for f, t in found.items()}
    assert not any(missed.values()), f"need CUDA but -k cuda does not select them: {missed}"
    assert sum(map(len, found.values())) >= 11
