"""NVDEC through PyAV against PyAV's CPU decode, at real resolutions (issue 49's video call).

    python scripts/nvdec_check.py --json OUT.json [--dir DIR] [--seconds 10] [--dry]

PyAV's wheel (18.1, the one ``make gpu-wheels`` carries) bundles an FFmpeg built with the
``cuda`` hardware device and the ``h264_cuvid`` / ``hevc_cuvid`` decoders, which load the
driver's ``libnvcuvid.so.1`` at run time: NVDEC needs no DALI wheel (199 MB, four device calls
of parts) on a machine whose driver exposes it. Per clip (720p and 1080p, H.264 and HEVC,
written here with the wheel's libx264 / libx265; every frame carries its index as a barcode,
``paravt.data.synth.draw_frame_index``):

- every frame decoded twice to RGB: on the CPU (PyAV's software decoder, frame threads, as
  ``paravt.video`` decodes) and through ``av.codec.hwaccel.HWAccel("cuda")`` with no software
  fallback (frames downloaded to host memory, as the CPU path returns them);
- the same frame count, every barcode equal to its frame number on both paths, and the
  largest pixel difference between the two (the YUV data is bit-exact; only the download's
  pixel format and its conversion may differ);
- frames per second of each path (host clock, whole clip, after one warm-up decode) and
  their ratio.

``--dry``: the CPU at tiny sizes, the second path through the software decoder too (no
NVDEC without a GPU), so the script's code runs in CI. Without CUDA and without ``--dry`` the
check reports ``skipped``. Exits 1 when a clip failed or its frames differ.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch

# (name, (height, width), encoder)
CLIPS = (
    ("720p_h264", (720, 1280), "libx264"),
    ("720p_hevc", (720, 1280), "libx265"),
    ("1080p_h264", (1080, 1920), "libx264"),
    ("1080p_hevc", (1080, 1920), "libx265"),
)
DRY_SIZES = {"720p": (72, 128), "1080p": (108, 192)}
MAX_PIXEL_DIFF = 8  # nv12 vs yuv420p download, then swscale to RGB: rounding only


def write_clip(path: Path, size: tuple[int, int], encoder: str, frames: int, fps: int) -> None:
    """``frames`` frames of ``size`` (height, width) with their index barcodes and a moving
    block, one keyframe a second, yuv420p."""
    import av

    from paravt.data.synth import BACKGROUND, draw_frame_index

    h, w = size
    with av.open(str(path), "w") as c:
        s = c.add_stream(encoder, rate=Fraction(fps))
        s.width, s.height, s.pix_fmt, s.gop_size = w, h, "yuv420p", fps
        s.options = {"preset": "ultrafast"}
        if encoder == "libx265":
            s.options["x265-params"] = "log-level=error"
        for i in range(frames):
            a = np.empty((h, w, 3), np.uint8)
            a[:] = BACKGROUND
            x = (i * 7) % max(1, w - h // 8)
            a[h // 2 : h // 2 + h // 8, x : x + h // 8] = 200
            draw_frame_index(a, i)
            for p in s.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def decode(path: Path, hw: bool) -> tuple[list[np.ndarray], float, list[str]]:
    """Every frame of ``path`` as RGB arrays, the seconds it took and the pixel formats the
    decoder handed back (``nv12`` from an NVDEC download, ``yuv420p`` from the CPU)."""
    import av
    from av.codec.hwaccel import HWAccel

    accel = HWAccel("cuda", allow_software_fallback=False) if hw else None
    t0 = time.perf_counter()
    frames, formats = [], set()
    with av.open(str(path), hwaccel=accel) as c:
        s = c.streams.video[0]
        if not hw:  # frame threads, as paravt.video decodes; NVDEC decodes on the device
            s.thread_type = "AUTO"
        for f in c.decode(s):
            formats.add(f.format.name)
            frames.append(f.to_ndarray(format="rgb24"))
    return frames, time.perf_counter() - t0, sorted(formats)


def check_clip(path: Path, hw: bool) -> dict[str, Any]:
    from paravt.data.synth import read_frame_index

    decode(path, hw)  # warm-up: device context, decoder start
    cpu, t_cpu, fmt_cpu = decode(path, False)
    acc, t_acc, fmt_acc = decode(path, hw)
    r: dict[str, Any] = {"frames_cpu": len(cpu), "frames_accel": len(acc)}
    n = min(len(cpu), len(acc))
    r["barcode_mismatches_cpu"] = sum(read_frame_index(cpu[i]) != i for i in range(len(cpu)))
    r["barcode_mismatches_accel"] = sum(read_frame_index(acc[i]) != i for i in range(len(acc)))
    r["max_pixel_diff"] = max(
        (int(np.abs(cpu[i].astype(np.int16) - acc[i]).max()) for i in range(n)), default=-1
    )
    r.update(cpu_s=t_cpu, accel_s=t_acc, cpu_fps=len(cpu) / t_cpu, accel_fps=len(acc) / t_acc,
             accel_over_cpu=t_cpu / max(t_acc, 1e-9), formats_cpu=fmt_cpu,
             formats_accel=fmt_acc)  # fmt: skip
    r["same_frames"] = (
        len(cpu) == len(acc) > 0
        and r["barcode_mismatches_cpu"] == r["barcode_mismatches_accel"] == 0
        and 0 <= r["max_pixel_diff"] <= MAX_PIXEL_DIFF
    )
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="")
    ap.add_argument("--dir", default="gpu_out_work/nvdec_videos")
    ap.add_argument("--seconds", type=float, default=10.0, help="clip length at 30 frames/s")
    ap.add_argument("--dry", action="store_true", help="tiny clips, software on both paths")
    a = ap.parse_args(argv)
    hw = torch.cuda.is_available() and not a.dry
    res: dict[str, Any] = {"accel": "nvdec (PyAV hwaccel cuda)" if hw else "software (dry)",
                           "clips": {}}  # fmt: skip
    try:
        import av

        res["av"] = av.__version__
        res["hwdevices"] = list(av.codec.hwaccel.hwdevices_available())
    except Exception as e:
        res.update(status="skipped", reason=f"PyAV does not import: {type(e).__name__}: {e}")
    if "status" not in res and not hw and not a.dry:
        res.update(status="skipped", reason="no CUDA (NVDEC needs a GPU)")
    if "status" not in res:
        fps = 30
        frames = max(2, round(a.seconds * fps)) if not a.dry else 12
        d = Path(a.dir)
        d.mkdir(parents=True, exist_ok=True)
        failed = []
        for name, size, enc in CLIPS:
            if a.dry:
                size = DRY_SIZES[name.split("_")[0]]
            path = d / f"{name}_{size[0]}x{size[1]}_{frames}.mp4"
            try:
                t0 = time.perf_counter()
                if not path.is_file():
                    write_clip(path, size, enc, frames, fps)
                r = {"size": list(size), "frames": frames, "write_s": time.perf_counter() - t0}
                r.update(check_clip(path, hw))
                if not r["same_frames"]:
                    failed.append(name)
            except Exception as e:
                r = {"error": f"{type(e).__name__}: {e}"}
                failed.append(name)
            res["clips"][name] = r
            print(f"[nvdec] {name}: " + json.dumps(r, default=str), flush=True)
        res["status"] = "failed" if failed else "ok"
        if failed:
            res["error"] = f"clips failed or differ: {failed}"
        fig = {f"{k}_accel_over_cpu": v["accel_over_cpu"] for k, v in res["clips"].items()
               if "accel_over_cpu" in v}  # fmt: skip
        fig.update({f"{k}_accel_fps": v["accel_fps"] for k, v in res["clips"].items()
                    if "accel_fps" in v})  # fmt: skip
        res["figures"] = fig
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    print(f"[nvdec] {res['status']}" + (f": {res.get('reason') or res.get('error')}"
                                        if res["status"] != "ok" else ""))  # fmt: skip
    return 1 if res["status"] == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
