"""The first step of every prepared device call (scripts/gpu_train_check.sh, ``probe``): the
device facts the later steps rely on, recorded in ~20 s before any of them spends its budget.

    python scripts/gpu_probe.py --json OUT.json [--dir WORK] [--dry]

Records (``facts``):

- versions: Python, torch (and its CUDA), Triton, numpy, transformers, PyAV, omegaconf,
  liger-kernel (``importlib.metadata``; the image's or the carried wheels');
- the card: name, compute capability, multiprocessors, total and free memory
  (``torch.cuda.mem_get_info``: what another process or a leak already holds shows here);
- NVDEC's library: whether ``libnvcuvid.so.1`` loads (``ctypes``; FFmpeg's nvdec hwaccel, which
  PyAV's wheel uses on the native h264/hevc decoders, loads it at run time), ``ldconfig``'s
  entries for it, ``NVIDIA_DRIVER_CAPABILITIES`` (a container needs ``video`` in it) and PyAV's
  hardware device types;
- ``paravt._C``: built with its CUDA ops or not.

Then ``forward``: one-layer Qwen3-VL-2B (the real width 2048 and vocabulary 151,936; one text
layer, one vision block; ``model.init=random`` through ``build_random_checkpoint`` and
``load_model``, as ``python -m paravt.train`` builds a model) in bf16 on CUDA, the teacher-forced
log-probs of 512 random tokens through ``paravt.algo.logprobs.sequence_logprobs`` (the trainer's
gathered-rows path: the backbone, then ``paravt_kernels.linear_logprob`` at T = 0.7) and their
backward; the first 64 tokens' log-probs against the same weights in fp32 on the CPU. Status
``failed`` when the forward raises, a log-prob or gradient is not finite, or the relative
difference to fp32 is over 5e-2 (bf16 weights and activations: ~1e-2 expected).

Missing NVDEC is a fact, not a failure: the ``nvdec`` step reports it. ``--dry``: the CPU, a
narrowed architecture (hidden 64, vocabulary 4096), so CI runs the same code. Without CUDA and
without ``--dry``: ``skipped``.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata as md
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

GIB = 1 << 30
MAX_REL_VS_FP32 = 5e-2
PACKAGES = ("torch", "triton", "numpy", "transformers", "av", "omegaconf", "liger-kernel")


def versions() -> dict[str, Any]:
    v: dict[str, Any] = {"python": sys.version.split()[0], "torch_cuda": torch.version.cuda}
    for p in PACKAGES:
        try:
            v[p] = md.version(p)
        except md.PackageNotFoundError:
            v[p] = None
    return v


def card() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"cuda": False}
    p = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    return {"cuda": True, "name": p.name, "capability": f"{p.major}.{p.minor}",
            "multiprocessors": p.multi_processor_count, "total_gib": total / GIB,
            "free_gib": free / GIB}  # fmt: skip


def nvdec_library() -> dict[str, Any]:
    r: dict[str, Any] = {"NVIDIA_DRIVER_CAPABILITIES": os.environ.get("NVIDIA_DRIVER_CAPABILITIES")}
    try:
        ctypes.CDLL("libnvcuvid.so.1")
        r["libnvcuvid"] = "loads"
    except OSError as e:
        r["libnvcuvid"] = f"does not load: {e}"
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
        r["ldconfig"] = [x.strip() for x in out.splitlines() if "nvcuvid" in x]
    except (OSError, subprocess.SubprocessError) as e:
        r["ldconfig"] = f"not run: {e}"
    try:
        from av.codec.hwaccel import hwdevices_available

        r["pyav_hw_devices"] = sorted(hwdevices_available())
    except ImportError as e:
        r["pyav_hw_devices"] = f"PyAV not importable: {e}"
    return r


def native_cuda() -> Any:
    try:
        from paravt.vision.pack import native_has_cuda

        return native_has_cuda()
    except Exception as e:  # noqa: BLE001 - a fact to record
        return f"{type(e).__name__}: {e}"


def one_layer_arch(path: Path, dry: bool) -> Path:
    """Qwen3-VL-2B with one text layer and one vision block (``dry``: also narrowed)."""
    from paravt.models.tiny import arch_config_path, write_narrow_arch

    if dry:
        write_narrow_arch(path, vocab=4096)
        c = json.loads(path.read_text())
    else:
        c = json.loads(arch_config_path("qwen3vl_2b").read_text())
    c["text_config"]["num_hidden_layers"] = 1
    c["vision_config"].update(depth=1, deepstack_visual_indexes=[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(c, indent=1))
    return path


def forward(work: Path, dry: bool, tokens: int = 512, compare: int = 64) -> dict[str, Any]:
    import paravt.train  # noqa: F401 - the training path imports on this image
    from paravt.algo.logprobs import sequence_logprobs
    from paravt.models.loader import load_model
    from paravt.models.tiny import build_random_checkpoint

    dev = "cpu" if dry else "cuda"
    t0 = time.perf_counter()
    ckpt = build_random_checkpoint(work / "ckpt", str(one_layer_arch(work / "arch.json", dry)))
    r: dict[str, Any] = {"checkpoint_s": time.perf_counter() - t0}
    model = load_model(ckpt, dtype="bfloat16", device=dev).model
    r["params"] = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(300, 4000, (tokens,), generator=g)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(2):  # the first call compiles the Triton kernels
        model.zero_grad(set_to_none=True)
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        lp, _ = sequence_logprobs(model, ids, None, None, temperature=0.7)
        lp.sum().backward()
        if dev == "cuda":
            torch.cuda.synchronize()
        r["first_s" if i == 0 else "fwd_bwd_s"] = time.perf_counter() - t
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    r["finite"] = bool(torch.isfinite(lp).all()) and all(
        bool(torch.isfinite(x).all()) for x in grads
    )
    if dev == "cuda":
        r["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    ref_model = load_model(ckpt, dtype="float32", device="cpu").model
    with torch.no_grad():
        ref, _ = sequence_logprobs(ref_model, ids[:compare], None, None, temperature=0.7)
        got = lp.detach()[:compare].float().cpu()
    r["rel_vs_fp32_cpu"] = float((got - ref).norm() / ref.norm().clamp_min(1e-12))
    r["tokens"], r["compared_tokens"], r["device"] = tokens, compare, dev
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/gpu_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="")
    ap.add_argument("--dir", default="gpu_out_work/probe", help="the one-layer checkpoint")
    ap.add_argument("--dry", action="store_true", help="CPU, narrowed architecture (CI)")
    a = ap.parse_args(argv)
    t_all = time.perf_counter()
    res: dict[str, Any] = {"status": "running"}
    out = Path(a.json) if a.json else None

    def save() -> None:
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(res, indent=1, default=str))

    res["facts"] = {"versions": versions(), "card": card(), "nvdec": nvdec_library(),
                    "native_cuda_ops": native_cuda()}  # fmt: skip
    save()
    if not (torch.cuda.is_available() or a.dry):
        res.update(status="skipped", reason="no CUDA (--dry runs it on the CPU)")
    else:
        try:
            res["forward"] = f = forward(Path(a.dir), a.dry)
            bad = []
            if not f["finite"]:
                bad.append("a log-prob or gradient is not finite")
            if f["rel_vs_fp32_cpu"] > MAX_REL_VS_FP32:
                bad.append(f"log-probs {f['rel_vs_fp32_cpu']:.3g} from fp32 on the CPU "
                           f"(relative; > {MAX_REL_VS_FP32})")  # fmt: skip
            res["status"] = "failed" if bad else "ok"
            if bad:
                res["error"] = "one-layer forward: " + "; ".join(bad)
        except Exception as e:  # noqa: BLE001 - recorded, the step fails
            res.update(status="failed", error=f"one-layer forward: {type(e).__name__}: {e}",
                       traceback=traceback.format_exc())  # fmt: skip
            print(res["traceback"], file=sys.stderr, flush=True)
    res["wall_s"] = time.perf_counter() - t_all
    save()
    fa = res["facts"]
    print(f"[probe] {res['status']} in {res['wall_s']:.1f} s: {json.dumps(fa['versions'])}")
    print(f"[probe] card: {json.dumps(fa['card'])}; native CUDA ops: {fa['native_cuda_ops']}")
    print(f"[probe] nvdec: {json.dumps(fa['nvdec'])}")
    if "forward" in res:
        print(f"[probe] one-layer forward: {json.dumps(res['forward'])}")
    if res.get("error"):
        print(f"[probe] error: {res['error']}")
    return 1 if res["status"] == "failed" else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
