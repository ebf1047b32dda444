"""NVIDIA DALI decoding of given display-order frame indices.

``fn.decoders.video`` takes the encoded file bytes and a list of frame indices (``frames=``)
and seeks internally, so this backend hands DALI the exact indices computed by the shared
timestamp→index rule (``StreamIndex.indices_at``); frames therefore match the PyAV backend
index for index (pixels differ only by the YUV→RGB conversion).

Device: ``mixed`` (NVDEC) when CUDA is available, else ``cpu``. DALI's CPU decoder handles
VP8/VP9/MJPEG only; H.264/HEVC/AV1/MPEG-4 need the GPU, and asking for them on CPU is a
``VideoError`` that says so. ``frames_decoded`` counts frames returned (DALI does not report
the reference frames it decodes internally).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np

from paravt.video.display import to_display
from paravt.video.errors import VideoError
from paravt.video.probe import StreamIndex

CPU_CODECS = frozenset({"vp8", "vp9", "mjpeg"})
GPU_CODECS = CPU_CODECS | {"h264", "hevc", "av1", "mpeg4"}

_pipes: dict[str, object] = {}
_lock = threading.Lock()


def available() -> bool:
    """True when ``nvidia.dali`` imports."""
    try:
        import nvidia.dali  # noqa: F401
    except Exception:
        return False
    return True


def _device() -> str:
    try:
        import torch

        return "mixed" if torch.cuda.is_available() else "cpu"
    except Exception:
        return "cpu"


def _pipeline(device: str):
    # One pipeline per device, built once: building costs ~100 ms, running a few ms.
    pipe = _pipes.get(device)
    if pipe is not None:
        return pipe
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(
        batch_size=1,
        num_threads=1,
        device_id=0 if device == "mixed" else None,
        prefetch_queue_depth=1,
    )
    def _decode_pipe():
        encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1, device="cpu")
        frames = fn.external_source(name="frames", dtype=types.INT32, ndim=1, device="cpu")
        return fn.decoders.video(encoded, frames=frames, device=device)

    pipe = _decode_pipe()
    pipe.build()
    _pipes[device] = pipe
    return pipe


# Frames per DALI run: bounds the host copy of native frames (64 x 1080p RGB = 400 MB).
CHUNK_FRAMES = 64


def iter_indices(
    sidx: StreamIndex, indices: list[int], stats: dict[str, int] | None = None
) -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(index, (H, W, 3) uint8 RGB)`` for sorted unique ``indices``, decoded by DALI
    ``CHUNK_FRAMES`` at a time."""
    path = sidx.meta.path
    if not indices:
        return
    with open(path, "rb") as f:
        data = np.frombuffer(f.read(), dtype=np.uint8)
    if stats is not None:
        stats["files_opened"] = stats.get("files_opened", 0) + 1
    for c in range(0, len(indices), CHUNK_FRAMES):
        yield from decode_indices(sidx, indices[c : c + CHUNK_FRAMES], stats, _data=data).items()


def decode_indices(
    sidx: StreamIndex,
    indices: list[int],
    stats: dict[str, int] | None = None,
    *,
    _data: np.ndarray | None = None,
) -> dict[int, np.ndarray]:
    """Decode display-order frames ``indices`` with DALI. Returns ``{index: (H, W, 3) uint8}``."""
    path = sidx.meta.path
    st = stats if stats is not None else {}
    if not indices:
        return {}
    if not available():
        raise VideoError(path, "backend 'dali' needs nvidia-dali (pip install nvidia-dali-cuda130)")
    device = _device()
    codec = sidx.meta.codec
    supported = GPU_CODECS if device == "mixed" else CPU_CODECS
    if codec not in supported:
        where = (
            "without a GPU (DALI's CPU decoder handles VP8/VP9/MJPEG only)"
            if device == "cpu"
            else "by DALI"
        )
        raise VideoError(
            path, f"codec '{codec}' cannot be decoded {where}; use backend='pyav' or re-encode"
        )
    if _data is None:
        with open(path, "rb") as f:
            _data = np.frombuffer(f.read(), dtype=np.uint8)
        st["files_opened"] = st.get("files_opened", 0) + 1
    data = _data
    with _lock:
        try:
            pipe = _pipeline(device)
            pipe.feed_input("encoded", [data])
            pipe.feed_input("frames", [np.asarray(indices, dtype=np.int32)])
            (out,) = pipe.run()
            if device == "mixed":
                out = out.as_cpu()
            arr = np.array(out[0])
        except Exception as e:  # DALI raises RuntimeError with the FFmpeg/NVDEC message
            # A failed run leaves the pipeline unusable; rebuild it next time.
            _pipes.pop(device, None)
            raise VideoError(
                path, f"DALI ({device}) failed to decode: {str(e).splitlines()[0]}"
            ) from None
    if arr.ndim != 4 or arr.shape[0] != len(indices) or arr.shape[-1] != 3:
        raise VideoError(
            path, f"DALI returned frames of shape {arr.shape}, expected ({len(indices)}, H, W, 3)"
        )
    st["frames_decoded"] = st.get("frames_decoded", 0) + len(indices)
    st["seeks"] = st.get("seeks", 0) + 1
    # Stored -> displayed (pixel aspect, rotation), as the PyAV backend does.
    return {i: to_display(np.ascontiguousarray(arr[j]), sidx.meta) for j, i in enumerate(indices)}
