"""The one exception type of ``paravt.video``."""

from __future__ import annotations


class VideoError(Exception):
    """Bad video input: missing, empty, truncated or undecodable file, or a time outside it.

    The message always names the file and the problem (and, where there is one, the fix), so a
    failed sample can be logged and skipped without a traceback hunt.
    """

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {problem}")

    def __reduce__(self):  # picklable across worker processes despite the 2-arg __init__
        return (type(self), (self.path, self.problem))


class VideoTimeout(VideoError):
    """A probe or decode of the file passed ``video.decode_timeout_s`` (the read blocks)."""


class VideoUnsupported(VideoError):
    """A readable video the model cannot take, whatever the retry: e.g. an aspect ratio past
    the vision preprocessing's limit (``paravt.video.sampling.frame_size_for_budget``). The
    agent loop skips its sample as for any ``VideoError``; the evaluation records it as an
    error row of kind "unsupported", which a rerun does not retry."""
