"""Step 4 of ``scripts/gpu_train_check.sh`` (issue 36): whether the driver exposes NVDEC, and
DALI's decode (``video.backend=dali``) against the CPU path (``pyav``) on the same long videos.

    python scripts/dali_check.py --json OUT.json [--videos 2] [--duration 600] [--codec h264]

1. Probe (any machine): ``NVIDIA_DRIVER_CAPABILITIES`` (NVDEC needs ``video`` or ``all`` in a
   container), ``libnvcuvid`` in the linker cache / the driver's folders and whether it loads,
   whether ``nvidia.dali`` and ``av`` import.
2. Decode: long videos written with PyAV (``paravt.data.synth.write_index_clip``: every frame
   carries its index as a barcode, read back by ``read_frame_index``), then per video the
   overview frames (K = 32 and 64) and 5 crops of 16 frames (the oracle's 5 equal windows at
   1 frame/s), as the agent asks for them (``FrameRequest``s through ``DecodePlanner``), once
   with ``backend='pyav'`` and once with ``backend='dali'``:
   the same frame indices, every DALI frame's barcode equal to its index (native size), the
   pixel difference (only YUV->RGB differs), and the wall time of each backend (a fresh
   planner each repetition: no frame cache), native and resized to the pixel budget.

Without CUDA DALI decodes VP9/MJPEG only: there the decode part is ``skipped: no CUDA`` unless
``--codec vp9`` (the CPU dry run), which runs DALI's CPU decoder through the same code.
Not measured (not implemented): DALI's frames feeding the packed encoder without a host copy;
``paravt.video.dali_backend`` copies every decoded batch to the host (``as_cpu``).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

LIB_DIRS = ("/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/x86_64-linux-gnu",
            "/usr/lib64", "/usr/local/cuda/lib64")  # fmt: skip


def probe_nvdec() -> dict[str, Any]:
    """What NVDEC needs from the machine, read without decoding anything."""
    caps = os.environ.get("NVIDIA_DRIVER_CAPABILITIES")
    r: dict[str, Any] = {
        "NVIDIA_DRIVER_CAPABILITIES": caps,
        "caps_include_video": caps is not None
        and any(c.strip() in ("video", "all") for c in caps.split(",")),
    }
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=20).stdout
        r["ldconfig_nvcuvid"] = [ln.strip() for ln in out.splitlines() if "nvcuvid" in ln]
    except (OSError, subprocess.SubprocessError) as e:
        r["ldconfig_nvcuvid"] = f"ldconfig failed: {e}"
    r["nvcuvid_files"] = sorted(f for d in LIB_DIRS for f in glob.glob(f"{d}/libnvcuvid*"))
    try:
        ctypes.CDLL("libnvcuvid.so.1")
        r["nvcuvid_loads"] = True
    except OSError as e:
        r["nvcuvid_loads"] = False
        r["nvcuvid_error"] = str(e)
    for mod in ("nvidia.dali", "av"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            r[f"{mod}_version"] = getattr(m, "__version__", "?")
        except Exception as e:
            r[f"{mod}_version"] = None
            r[f"{mod}_error"] = f"{type(e).__name__}: {e}"
    r["cuda"] = torch.cuda.is_available()
    r["nvdec_expected"] = bool(r["cuda"] and r["nvcuvid_loads"])
    return r


def requests_for(path: str, pixels: int | None) -> list[Any]:
    """The agent's requests for one video: overviews at K=32 and K=64, and 5 crops (the
    oracle's equal windows) of at most 16 frames at 1 frame/s."""
    from paravt.types import FrameRequest
    from paravt.video import crop_timestamps, overview_timestamps, probe
    from paravt.video.sampling import frame_size_for_budget

    m = probe(path)
    size = frame_size_for_budget(m, pixels, pixels, 32) if pixels else None
    reqs = [FrameRequest(path, tuple(overview_timestamps(m, k)), size, f"overview:{k}")
            for k in (32, 64)]  # fmt: skip
    w = m.duration / 5
    for i in range(5):
        ts = crop_timestamps(m, i * w, (i + 1) * w, fps=1.0, max_frames=16)
        reqs.append(FrameRequest(path, tuple(ts), size, f"crop:{i}"))
    return reqs


def run_backend(backend: str, reqs: list[Any], reps: int) -> tuple[list[Any], float, list[float]]:
    from paravt.video import DecodePlanner

    times, out = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = DecodePlanner(backend=backend, timeout_s=None).run(reqs)
        times.append(time.perf_counter() - t0)
    for r, o in zip(reqs, out):
        if not hasattr(o, "frames"):
            raise RuntimeError(f"{backend}: {r.tag} of {r.video} failed: {o}")
    return out, statistics.median(times), times


def compare(reqs: list[Any], reps: int, check_index: bool) -> dict[str, Any]:
    from paravt.data.synth import read_frame_index

    a, ta, all_a = run_backend("pyav", reqs, reps)
    b, tb, all_b = run_backend("dali", reqs, reps)
    frames = sum(int(x.frames.shape[0]) for x in a)
    same_idx = all(torch.equal(x.indices, y.indices) for x, y in zip(a, b))
    diff = [(x.frames.int() - y.frames.int()).abs() for x, y in zip(a, b)]
    r: dict[str, Any] = {
        "requests": len(reqs),
        "frames": frames,
        "same_indices": same_idx,
        "max_pixel_diff": int(max(int(d.max()) for d in diff)),
        "mean_pixel_diff": float(sum(float(d.float().mean()) for d in diff) / len(diff)),
        "pyav_s": ta,
        "dali_s": tb,
        "pyav_all_s": all_a,
        "dali_all_s": all_b,
        "dali_speedup": ta / max(tb, 1e-9),
    }
    if check_index:
        wrong = [
            (y.tag if hasattr(y, "tag") else "", int(i), read_frame_index(f))
            for y in b
            for f, i in zip(y.frames, y.indices)
            if read_frame_index(f) != int(i)
        ]
        r["dali_barcode_mismatches"] = len(wrong)
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="")
    ap.add_argument("--dir", default="gpu_out_work/dali_videos", help="where the videos go")
    ap.add_argument("--videos", type=int, default=2)
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--codec", default="h264")
    ap.add_argument("--pixels", type=int, default=448 * 448, help="resized pass pixel budget")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    res: dict[str, Any] = {"probe": probe_nvdec()}
    p = res["probe"]
    print(f"[dali] probe: {json.dumps(p)}", flush=True)
    status = "ok"
    if not p["cuda"] and a.codec not in ("vp9", "mjpeg"):
        status, res["reason"] = "skipped", "no CUDA (DALI decodes H.264 on the GPU only)"
    elif p["nvidia.dali_version"] is None or p["av_version"] is None:
        status = "skipped"
        res["reason"] = "nvidia.dali or av does not import (carry their wheels: docs/gpu)"
    if status == "ok":
        try:
            from paravt.data.synth import write_index_clip

            d = Path(a.dir)
            d.mkdir(parents=True, exist_ok=True)
            paths, t0 = [], time.perf_counter()
            for i in range(a.videos):
                f = d / f"long_{i}_{a.codec}_{a.duration:g}s.mp4"
                if not f.is_file():
                    write_index_clip(f, duration=a.duration, codec=a.codec, gop=50)
                paths.append(str(f))
            res["videos"] = {"count": a.videos, "duration_s": a.duration, "codec": a.codec,
                             "write_s": time.perf_counter() - t0}  # fmt: skip
            native = [r for f in paths for r in requests_for(f, None)]
            resized = [r for f in paths for r in requests_for(f, a.pixels)]
            res["native"] = compare(native, a.reps, check_index=True)
            res["resized"] = compare(resized, a.reps, check_index=False)
            n = res["native"]
            ok = (
                n["same_indices"] and n["dali_barcode_mismatches"] == 0 and n["max_pixel_diff"] <= 8
            )
            res["same_frames"] = ok
            status = "ok" if ok else "failed"
            for k in ("native", "resized"):
                c = res[k]
                print(
                    f"[dali] {k}: {c['frames']} frames in {c['requests']} requests; pyav "
                    f"{c['pyav_s']:.3f} s, dali {c['dali_s']:.3f} s ({c['dali_speedup']:.2f}x); "
                    f"same indices {c['same_indices']}, max pixel diff {c['max_pixel_diff']}",
                    flush=True,
                )
        except Exception as e:
            status, res["error"] = "failed", f"{type(e).__name__}: {e}"
            print(f"[dali] failed: {res['error']}", file=sys.stderr, flush=True)
    res["status"] = status
    res["not_measured"] = (
        "DALI frames into the packed encoder without a host copy: paravt.video.dali_backend "
        "copies each decoded batch to the host (as_cpu)"
    )
    if status == "skipped":
        print(f"[dali] skipped: {res['reason']}", flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 1 if status == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
