"""What each prepared device call carries, and the two folders it carries.

    python scripts/gpu_carry.py [--json OUT.json]          # each call's carry vs 64 MiB
    python scripts/gpu_carry.py --check-wheels DIR          # DIR holds exactly the pinned wheels
    python scripts/gpu_carry.py --snapshot DIR [--rev REV]  # the code a call runs (make gpu-snapshot)

A call sends the working tree (tracked files and untracked ones git does not ignore: ``git
ls-files -co --exclude-standard``) plus the ignored paths its ``carry`` names. Per prepared
call (``CALLS``, the carries of docs/gpu/README.md's "Prepared calls") it adds up the tree and
the carried folders as they are here, or, for a folder not built yet, the size recorded in
``EXPECTED_MIB`` (``make gpu-wheels gpu-snapshot`` builds the real ones), and prints the margin
under 64 MiB. Exits 1 when a call's margin is under ``MARGIN_MIB`` (tests/test_gpu_scripts.py
runs it in CI: one more large file in the tree shows there, not as a refused device call).

``--check-wheels``: the wheel folder must hold one wheel per pin of scripts/gpu_wheels.txt, at
the pinned version, and nothing else; two versions of one package make pip refuse the whole
set. Exits 1 naming each problem. The device's setup (scripts/gpu_train_check.sh) runs it
before it installs.

``--snapshot``: ``tree.tar.gz`` (the code paths ``SNAP_PATHS`` of ``--rev``, default HEAD; with
``--worktree`` the working tree's files as they are, for the CI dry run), ``COMMIT`` and
``launch.sh`` (scripts/gpu_launch.sh of the same code: the one command every call runs). The
device copy's ``.git`` is stale (docs/gpu/README.md, run 1): a call runs this snapshot, not the
tree it was sent with.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
LIMIT_MIB = 64.0
MARGIN_MIB = 4.0
# Carried folders when not built here (MiB, measured 2026-12-07): make gpu-wheels (transformers
# 5.19.0 12.0, av 18.1.0 34.1, liger-kernel 0.87, setuptools 0.84, omegaconf 0.24,
# cut-cross-entropy 0.02) and make gpu-snapshot (the code-only tar.gz, ~1.0, and launch.sh).
EXPECTED_MIB = {".gpu_wheels": 48.1, ".gpu_snap": 1.2}
CALLS = {
    "main": [".gpu_snap", ".gpu_wheels"],
    "extra": [".gpu_snap", ".gpu_wheels"],
    "video": [".gpu_snap", ".gpu_wheels"],
}
WHEELS_TXT = ROOT / "scripts" / "gpu_wheels.txt"
# The code a device call runs (no docs/: its figures and images are 2.7 MB).
SNAP_PATHS = ("CMakeLists.txt", "Makefile", "README.md", "bench", "configs", "csrc", "kernels",
              "paravt", "paravt_startup.py", "pyproject.toml", "requirements.txt",
              "requirements-vllm-cpu.txt", "scripts", "setup.py", "tests")  # fmt: skip


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of the files a call sends besides its carry."""
    total = 0
    for name in _ls_files(root):
        p = root / name
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def _ls_files(root: Path, *paths: str) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard", "--", *paths], cwd=root,
        capture_output=True, check=True,
    ).stdout  # fmt: skip
    return [n for n in out.decode().split("\0") if n]


def folder_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())


def carry_report(root: Path = ROOT) -> dict:
    tree = tree_bytes(root) / MIB
    res: dict = {"tree_mib": round(tree, 2), "limit_mib": LIMIT_MIB, "calls": {}}
    for call, paths in CALLS.items():
        parts = {"tree": round(tree, 2)}
        for c in paths:
            p = root / c
            built = p.is_dir() and any(p.iterdir())
            parts[c] = round(folder_bytes(p) / MIB if built else EXPECTED_MIB[c], 2)
            if not built:
                parts[c + " (expected: not built here)"] = parts.pop(c)
        total = sum(parts.values())
        res["calls"][call] = {"carry": paths, "parts_mib": parts, "total_mib": round(total, 2),
                              "margin_mib": round(LIMIT_MIB - total, 2),
                              "ok": LIMIT_MIB - total >= MARGIN_MIB}  # fmt: skip
    return res


def _norm(name: str) -> str:
    """A distribution name as pip compares it (PEP 503): ``Cut_Cross.Entropy`` -> ``cut-cross-entropy``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_wheels(path: Path = WHEELS_TXT) -> dict[str, str]:
    """scripts/gpu_wheels.txt as {normalised name: version}; every line must pin ``==``."""
    pins: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", line)
        if m is None:
            raise ValueError(f"{path.name}:{n}: {line!r} is not NAME==VERSION: pin every wheel "
                             "to one version (an open range can leave two in the folder)")  # fmt: skip
        pins[_norm(m.group(1))] = m.group(2)
    return pins


def wheel_problems(folder: Path, pins: dict[str, str] | None = None) -> list[str]:
    """What is wrong with a wheel folder for ``pip install --no-deps --no-index *.whl``: two
    versions of one package (pip refuses the whole set), a pinned package without its wheel or
    at another version, a wheel nobody pinned. Empty when the folder is exactly the pins."""
    pins = pinned_wheels() if pins is None else pins
    found: dict[str, list[str]] = {}
    for whl in sorted(folder.glob("*.whl")):
        parts = whl.name[: -len(".whl")].split("-")  # name-version(-build)?-py-abi-platform
        if len(parts) < 5:
            return [f"{whl.name}: not a wheel file name (name-version-python-abi-platform.whl)"]
        found.setdefault(_norm(parts[0]), []).append(parts[1])
    fix = "run `make gpu-wheels` here (it empties the folder first)"
    errs = []
    for name, versions in sorted(found.items()):
        if len(versions) > 1:
            errs.append(f"{name}: {len(versions)} versions in {folder} ({', '.join(versions)}): "
                        f"pip refuses the whole set; {fix}")  # fmt: skip
        elif name not in pins:
            errs.append(f"{name} {versions[0]}: in {folder} but not pinned in "
                        f"scripts/gpu_wheels.txt; {fix}")  # fmt: skip
        elif versions[0] != pins[name]:
            errs.append(f"{name}: {versions[0]} in {folder}, pinned {pins[name]}; {fix}")
    for name, v in sorted(pins.items()):
        if name not in found:
            errs.append(f"{name}=={v}: pinned but no wheel in {folder}; {fix}")
    return errs


def snapshot(dest: Path, rev: str | None = "HEAD", root: Path = ROOT) -> Path:
    """Write ``dest``/tree.tar.gz, COMMIT and launch.sh from ``rev`` (None: the working tree)."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in ("tree.tar.gz", "tree.tar", "COMMIT", "launch.sh"):
        (dest / f).unlink(missing_ok=True)
    git = ["git", "-C", str(root)]
    head = subprocess.run(git + ["rev-parse", "--short", rev or "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    if rev is not None:
        subprocess.run(git + ["archive", "--format=tar.gz", "-o", str(dest / "tree.tar.gz"),
                              rev, "--", *SNAP_PATHS], check=True)  # fmt: skip
        launch = subprocess.run(git + ["show", f"{rev}:scripts/gpu_launch.sh"],
                                capture_output=True, check=True).stdout  # fmt: skip
        commit = head
    else:
        with tarfile.open(dest / "tree.tar.gz", "w:gz") as tar:
            for name in sorted(_ls_files(root, *SNAP_PATHS)):
                if (root / name).is_file():
                    tar.add(root / name, arcname=name, recursive=False)
        launch = (root / "scripts" / "gpu_launch.sh").read_bytes()
        commit = f"{head}+worktree"
    (dest / "launch.sh").write_bytes(launch)
    (dest / "COMMIT").write_text(commit + "\n")
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="")
    ap.add_argument("--check-wheels", default="", metavar="DIR")
    ap.add_argument("--snapshot", default="", metavar="DIR")
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--worktree", action="store_true", help="snapshot the working tree as it is")
    a = ap.parse_args(argv)
    if a.check_wheels:
        errs = wheel_problems(Path(a.check_wheels))
        for e in errs:
            print(f"gpu wheels: {e}", file=sys.stderr)
        if not errs:
            print(f"gpu wheels: {a.check_wheels} holds exactly scripts/gpu_wheels.txt's pins")
        return 1 if errs else 0
    if a.snapshot:
        d = snapshot(Path(a.snapshot), None if a.worktree else a.rev)
        for f in sorted(d.iterdir()):
            print(f"{f}: {f.stat().st_size} bytes")
        return 0
    r = carry_report()
    for call, c in r["calls"].items():
        print(f"{call}: {c['total_mib']:.2f} MiB of {LIMIT_MIB:g} (margin {c['margin_mib']:.2f}, "
              f"need >= {MARGIN_MIB:g}): {c['parts_mib']}")  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))
    return 0 if all(c["ok"] for c in r["calls"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
