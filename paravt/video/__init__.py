"""Video: probe, frame-accurate decode (PyAV on CPU, DALI on GPU), sampling, decode planner.

Frame rule shared by every backend: the frame returned for time ``t`` (seconds on the file's
timeline, 0 = the container's start, as a player shows it; see ``probe``) is the last frame
whose presentation time is ``<= t``, as displayed (rotation and pixel aspect applied).
"""

from paravt.video.cache import FrameCache
from paravt.video.deadline import DEFAULT_DECODE_TIMEOUT_S, stuck_reads
from paravt.video.errors import VideoError, VideoTimeout, VideoUnsupported
from paravt.video.planner import (
    BACKENDS,
    DecodePlanner,
    crop_request,
    decode,
    overview_request,
)
from paravt.video.probe import (
    StreamIndex,
    clear_probe_cache,
    probe,
    probe_cache_info,
    stream_index,
)
from paravt.video.sampling import (
    crop_timestamps,
    frame_size_for_budget,
    overview_timestamps,
    resize_frames,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_DECODE_TIMEOUT_S",
    "DecodePlanner",
    "FrameCache",
    "StreamIndex",
    "VideoError",
    "VideoTimeout",
    "VideoUnsupported",
    "clear_probe_cache",
    "crop_request",
    "crop_timestamps",
    "decode",
    "frame_size_for_budget",
    "overview_request",
    "overview_timestamps",
    "probe",
    "probe_cache_info",
    "resize_frames",
    "stream_index",
    "stuck_reads",
]
