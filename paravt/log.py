"""paravt's one logger: the standard ``logging`` module, rank-aware, with levels.

Every module logs through ``get_logger(__name__)`` (a child of the ``paravt`` logger) instead of
``print``. What a user sees is unchanged in form: the message alone, INFO and DEBUG on stdout,
WARNING and above on stderr, flushed at once. What changes:

* **Rank 0 by default.** Under torchrun only global rank 0 (``RANK``, counted when
  ``WORLD_SIZE`` is above 1) says its INFO and DEBUG lines; an INFO line every rank must say
  (a rollout worker's) passes ``extra=ALL_RANKS``.
  Warnings and errors come from every rank (rank k's unreadable video or decode timeout is its
  own): code that warns about the run as a whole warns on rank 0 only (``ctx.is_main``).
* **Levels.** ``PARAVT_LOG_LEVEL`` (``DEBUG``, ``INFO``: the default, ``WARNING``, ``ERROR``)
  sets how much is said; ``WARNING`` leaves a run's warnings and errors only.
* **Libraries stay quiet.** vLLM's own INFO chatter (engine start-up, every weight reload) is
  raised to WARNING unless ``PARAVT_LOG_LEVEL=DEBUG`` or ``VLLM_LOGGING_LEVEL`` asks for it
  (``quiet_libraries``, called by ``paravt.engines.vllm`` before vLLM is imported).

The handlers look up ``sys.stdout`` / ``sys.stderr`` when they write, not when they are made,
so a redirected stream (pytest's capture, ``contextlib.redirect_stdout``) gets the messages.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

#: ``extra=`` of a message every rank says (not only rank 0).
ALL_RANKS = {"all_ranks": True}

_ROOT = "paravt"


class _CurrentStream(logging.StreamHandler):
    """A stream handler bound to ``sys.stdout`` or ``sys.stderr`` as they are at each write."""

    def __init__(self, err: bool) -> None:
        self._err = err
        super().__init__()

    @property
    def stream(self) -> TextIO:
        return sys.stderr if self._err else sys.stdout

    @stream.setter
    def stream(self, value: TextIO) -> None:  # logging sets it in __init__; the property wins
        pass


class _StdoutFilter(logging.Filter):
    """stdout's records: below WARNING (stderr's handler takes those, from every rank), and
    only rank 0's unless a record says ``ALL_RANKS``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return False
        return getattr(record, "all_ranks", False) or _rank0()


def _rank0() -> bool:
    """Rank 0 of the job, or no job: ``RANK`` unset or 0, or ``WORLD_SIZE`` not above 1 (a
    ``RANK=1`` left in a shell inside a torchrun or Kubernetes job runs one process, rank 0,
    which must say its lines; ``paravt.files.writes_as_rank0``, the same rule, which this
    module cannot import)."""
    if os.environ.get("RANK", "0").strip() in ("", "0"):
        return True
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) <= 1
    except ValueError:
        return True


def level() -> int:
    """The level ``PARAVT_LOG_LEVEL`` names (INFO when unset); a bad name is INFO too, with a
    warning (logging must never be why a run does not start)."""
    name = os.environ.get("PARAVT_LOG_LEVEL", "INFO").strip().upper()
    lvl = logging.getLevelName(name)
    if not isinstance(lvl, int):
        sys.stderr.write(
            f"warning: PARAVT_LOG_LEVEL={name!r} is not a level (DEBUG, INFO, WARNING, ERROR); "
            "using INFO\n"
        )
        return logging.INFO
    return lvl


def _configure() -> logging.Logger:
    root = logging.getLogger(_ROOT)
    if not any(isinstance(h, _CurrentStream) for h in root.handlers):
        out, err = _CurrentStream(err=False), _CurrentStream(err=True)
        out.addFilter(_StdoutFilter())
        err.setLevel(logging.WARNING)  # every rank's warnings and errors
        for h in (out, err):
            h.setFormatter(logging.Formatter("%(message)s"))
            root.addHandler(h)
        root.propagate = False  # not twice through a handler an application put on the root
    root.setLevel(level())
    return root


def get_logger(name: str) -> logging.Logger:
    """The logger of module ``name`` (``__name__``), under the configured ``paravt`` logger."""
    _configure()
    return logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")


def quiet_libraries() -> None:
    """vLLM's INFO lines raised to WARNING unless asked for (``PARAVT_LOG_LEVEL=DEBUG`` or an
    explicit ``VLLM_LOGGING_LEVEL``); read by vLLM when it is first imported."""
    if level() > logging.DEBUG:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
