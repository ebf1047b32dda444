"""What each prepared device call carries, against the device tool's 64 MiB per call.

    python scripts/gpu_carry.py [--json OUT.json]

A call sends the working tree (tracked files and untracked ones git does not ignore: ``git
ls-files -co --exclude-standard``) plus the ignored paths its ``carry`` names. Per prepared
call (``CALLS``, the same carries as docs/gpu/README.md's "Prepared calls") it adds up the
tree and the carried folders as they are here, or, for a folder not built yet, the size
recorded in ``EXPECTED_MIB`` (measured when the wheels were chosen; ``make gpu-wheels
gpu-snapshot`` builds the real ones), and prints the margin under 64 MiB. Exits 1 when a
call's margin is under ``MARGIN_MIB`` (tests/test_gpu_scripts.py runs it in CI: one more
large file in the tree shows there, not as a refused device call).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
LIMIT_MIB = 64.0
MARGIN_MIB = 4.0
# Carried folders when not built here (MiB, measured 2026-12-06): make gpu-wheels (transformers
# 5.19.0 12.0, av 18.1.0 34.1, liger-kernel 0.87, setuptools 0.84, omegaconf 0.24,
# cut-cross-entropy 0.02) and make gpu-snapshot (the code-only tar.gz, ~1.0).
EXPECTED_MIB = {".gpu_wheels": 48.1, ".gpu_snap": 1.2}
CALLS = {
    "main": [".gpu_snap", ".gpu_wheels"],
    "video": [".gpu_snap", ".gpu_wheels"],
}


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of the files a call sends besides its carry."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root, capture_output=True,
        check=True,
    ).stdout  # fmt: skip
    total = 0
    for name in out.decode().split("\0"):
        p = root / name
        if name and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    r = carry_report()
    for call, c in r["calls"].items():
        print(f"{call}: {c['total_mib']:.2f} MiB of {LIMIT_MIB:g} (margin {c['margin_mib']:.2f}, "
              f"need >= {MARGIN_MIB:g}): {c['parts_mib']}")  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))
    return 0 if all(c["ok"] for c in r["calls"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
