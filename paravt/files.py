"""How paravt reads and writes files in folders it did not create (a run folder, an evaluation's
``--out``, a report's folder, a data set): one helper per idea, used by every module.

* :func:`write_atomic`: a whole file (``run.json``, ``config.yaml``, ``results.jsonl``, the
  viewer's pages, …) is written into a fresh temporary of a random name beside it (created with
  ``O_EXCL``: a symlink planted at that name is never followed) and renamed over the target with
  ``os.replace``. A symlink planted at the target is replaced, not written through (the viewer,
  run as root, would otherwise overwrite any file on the machine); a reader sees the old file or
  the new one, never a torn one; a failed write (a full disk) leaves the old file and no
  temporary.
* :func:`open_append`: a file written a line at a time (``metrics.jsonl``, the evaluation's
  ``results.jsonl``) is opened with ``O_NOFOLLOW`` and must be a regular file: a symlink or a
  FIFO in its place is refused (:class:`NotRegularFile`), never written through or waited on.
* :func:`append_text`: one row (or a few) appended through :func:`open_append`; a write that
  fails (a full disk) cuts the file back to where it was, so it holds whole rows only.
* :func:`write_failure`: what a failed write says (the path, the error, the free bytes), the
  first half of every full-disk message (training's, the evaluation's, the viewer's).
* :func:`read_regular`: the bytes of a regular file, or None when there is none; a FIFO, a
  device or a directory in its place is no file (opened without blocking, checked with
  ``fstat`` on the open file: no race between the check and the read, no reader left waiting
  on a pipe).
* :func:`jsonl_lines`: every JSONL file the project reads is split here, on ``"\\n"`` only.
  Not ``str.splitlines()``: JSON leaves U+2028, U+2029 and U+0085 unescaped inside strings
  and ``splitlines()`` cuts a row there. ``paravt.metrics.read_metrics`` (files the project
  appends to: skips a torn line) and :func:`read_jsonl` (data sets: a bad line is an error
  naming it) read through it.
* :func:`unencodable_text`: the first lone surrogate in a row's strings (valid JSON as a
  ``"\\ud83d"`` escape, no UTF-8 and no tokenizer can encode it): :func:`read_jsonl` refuses
  such a line naming the file, the line and the field, and ``paravt.data.readers`` does the
  same for a parquet row.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, TextIO

_log = logging.getLogger("paravt.files")

# What a full file system raises: no space (ENOSPC) or the user's quota spent (EDQUOT).
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# What a folder that cannot be written raises: a read-only mount (EROFS), no permission
# (EACCES; EPERM for an immutable folder).
UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


class JsonlError(ValueError):
    """A line of a JSONL data file that is no JSON object (``path:line: problem``)."""


class NotRegularFile(OSError):
    """A path paravt reads or writes holds a symlink, a FIFO, a device or a directory where a
    regular file belongs; the message names the path, what it is and the fix."""


def file_kind(mode: int) -> str:
    """What an ``st_mode`` is, in words ("a FIFO (named pipe)", "a symbolic link", …)."""
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def not_regular(path: str | Path, mode: int, doing: str) -> NotRegularFile:
    """The error for ``path`` (of ``st_mode`` ``mode``) found where ``doing`` needs a file."""
    return NotRegularFile(
        f"{path} is {file_kind(mode)}, not a regular file: paravt {doing} regular files only "
        "(never through a link, never waiting on a pipe). Fix: remove it (or replace it with "
        "the file itself) and rerun"
    )


def write_atomic(path: str | Path, data: str | bytes, *, fsync: bool = True) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` through a fresh temporary and ``os.replace``
    (module docstring): never through a symlink, never torn. Raises the ``OSError`` of a failed
    write (a full disk: ``ENOSPC``) with the old ``path`` intact and no temporary left."""
    blob = data.encode("utf-8") if isinstance(data, str) else data
    with atomic_file(path, fsync=fsync) as f:
        f.write(blob)


@contextlib.contextmanager
def atomic_file(path: str | Path, *, fsync: bool = True) -> Iterator[BinaryIO]:
    """:func:`write_atomic` for a writer that streams (``torch.save(state, f)``): the block
    writes into a binary file that becomes ``path`` when it ends, or is removed (the old
    ``path`` intact) when it raises."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        # "x": O_CREAT | O_EXCL, which fails on anything already at tmp (a planted link
        # included) and gives 0o666 less the umask, as "w" would.
        with open(tmp, "xb") as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()  # the old ``path`` is untouched
        if isinstance(e, OSError):
            e.filename = str(path)  # the file that was not written, not its temporary
        raise


def _append_opener(path: str, flags: int) -> int:
    """``os.open`` for :func:`open_append`: no link followed, no FIFO waited on, and only a
    regular file kept open (checked on the open file: no race between check and write)."""
    extra = os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags | extra, 0o666)
    except OSError as e:
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            raise e from None
        if stat.S_ISREG(mode):
            raise
        raise not_regular(path, mode, "appends to") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise not_regular(path, mode, "appends to")
    os.set_blocking(fd, True)
    return fd


def open_append(path: str | Path, encoding: str = "utf-8") -> TextIO:
    """``path`` opened to append text, created if absent; raises :class:`NotRegularFile` for a
    symlink, FIFO or other non-file in its place (module docstring)."""
    return open(path, "a", encoding=encoding, opener=_append_opener)


def append_text(path: str | Path, text: str, *, fsync: bool = False) -> None:
    """Append ``text`` to ``path`` (:func:`open_append`: never through a link); on a failed
    write cut the file back to where it was, so a row cut short by a full disk never glues
    itself to the next one (``OSError.filename``: ``path``). ``fsync``: on disk before this
    returns (a kill loses no row written)."""
    path = Path(path)
    start = path.stat().st_size if path.is_file() else 0
    f = open_append(path)  # a link or a FIFO in its place: refused, never written through
    try:
        with f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    except OSError as e:
        with contextlib.suppress(OSError):
            os.truncate(path, start)  # needs no free space
        e.filename = e.filename or str(path)
        raise


def write_failure(what: str, path: str | Path, e: OSError, folder: str | Path) -> str:
    """``the {what} {path} could not be written: {error} ({code}); N bytes are free on the
    file system of {folder}.``: the first half of a full-disk message, the fix its caller's."""
    try:
        free = int(shutil.disk_usage(folder).free)
    except OSError:
        free = -1
    code = errno.errorcode.get(e.errno or 0, str(e.errno))
    return (
        f"the {what} {path} could not be written: {e.strerror or e} ({code}); {free} bytes "
        f"are free on the file system of {folder}."
    )


def read_regular(path: str | Path) -> bytes | None:
    """The bytes of the regular file at ``path`` (symlinks followed), or None when nothing, or
    something other than a regular file (a FIFO, a directory, a device), is there: opened with
    ``O_NONBLOCK`` so that a FIFO never blocks the reader, and checked on the open file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return None  # nothing there (or a link loop): no file, as Path.is_file() says
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as f:
            fd = -1
            return f.read()
    finally:
        if fd >= 0:
            os.close(fd)


def read_text_regular(path: str | Path) -> str | None:
    """:func:`read_regular` decoded as UTF-8 (undecodable bytes replaced): a page shows it."""
    blob = read_regular(path)
    return None if blob is None else blob.decode("utf-8", errors="replace")


def jsonl_lines(blob: bytes) -> Iterator[tuple[int, bytes]]:
    """``(line number from 1, line)`` of each non-blank line of a JSONL file's bytes, split on
    ``b"\\n"`` only (module docstring). Bytes, not text: a line cut inside a multi-byte UTF-8
    character by a kill costs that line only (a continuation byte is never ``0x0A``)."""
    for n, raw in enumerate(blob.split(b"\n"), 1):
        if raw.strip():
            yield n, raw


def unencodable_text(value: Any, field: str = "") -> str | None:
    """What is wrong with the first string in ``value`` (a row: dicts, lists, strings, keys
    included) that UTF-8 cannot encode, or None. The only such code points a Python string can
    hold are the surrogates U+D800..U+DFFF: ``json.loads`` joins an escaped pair
    (``"\\ud83d\\ude00"``) into one character and leaves a lone half as it is, which every
    tokenizer then refuses (``TypeError``) at whatever step draws the row. The answer names
    the field as a path (``question``, ``options[2]``, ``extra_info.notes``), the code point
    and its position: ``"field 'question' holds a lone surrogate U+D83D at character 7 ..."``.
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            cp = ord(value[e.start])
            return (
                f"field '{field or '(value)'}' holds a lone surrogate U+{cp:04X} at character "
                f"{e.start} (half of a UTF-16 pair, e.g. a JSON '\\u{cp:04x}' escape without its "
                "partner), which no UTF-8 text or tokenizer can hold; write the whole character "
                "or remove it"
            )
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            key = str(k).encode("utf-8", "backslashreplace").decode()  # printable in a message
            name = f"{field}.{key}" if field else key
            if (bad := unencodable_text(k, f"{name} (its key)")) or (
                bad := unencodable_text(v, name)
            ):
                return bad
    elif isinstance(value, (list, tuple)):
        for j, v in enumerate(value):
            if bad := unencodable_text(v, f"{field}[{j}]"):
                return bad
    return None


def read_jsonl(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, row)`` of every non-blank line of the JSONL data file ``path`` (an
    annotation file, SFT records, an oracle's ``sft.jsonl``), in order. Strict, unlike
    ``paravt.metrics.read_metrics``: a line that is not UTF-8, not JSON or not an object raises
    :class:`JsonlError` naming ``path:line``; a missing file raises ``FileNotFoundError`` and a
    FIFO or other non-file :class:`NotRegularFile`. A string no UTF-8 can hold (a lone
    surrogate, :func:`unencodable_text`) is a :class:`JsonlError` naming the line and field."""
    blob = read_regular(path)
    if blob is None:
        mode = os.stat(path).st_mode  # FileNotFoundError when nothing is there
        raise not_regular(path, mode, "reads")
    rows = []
    for n, raw in jsonl_lines(blob):
        where = f"{path}:{n}"
        try:
            row = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise JsonlError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise JsonlError(f"{where}: invalid JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(row, dict):
            raise JsonlError(f"{where}: expected a JSON object, got {type(row).__name__}")
        if bad := unencodable_text(row):
            raise JsonlError(f"{where}: {bad}")
        rows.append((n, row))
    return rows


# ------------------------------------------------------------------------- folder claims
class FolderError(RuntimeError):
    """A folder a run, an evaluation or a driver was pointed at cannot be claimed: another
    process holds it (:class:`FolderBusy`), it is not writable (a read-only mount or folder),
    or its file system is full. The message is one line naming the folder and the fix."""


class FolderBusy(FolderError):
    """Another live process holds the folder a run, an evaluation or a driver was pointed at
    (:class:`FolderClaim`); the message names the holder and the ways out."""


#: What ``flock`` raises on a file system that does not support it (NFS without its lock
#: daemon, some FUSE and SMB mounts): the claim then falls back to an exclusive lock file.
NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL)
#: A lock file with no readable record this many seconds old is a holder that died between
#: creating it and writing it (the fallback claim; its record is written right after).
_EMPTY_LOCK_STALE_S = 10.0


def _unwritable(folder: Path, e: OSError, what: str) -> FolderError:
    """The one line for a folder that cannot be written (read-only, no permission, full)."""
    code = errno.errorcode.get(e.errno or 0, str(e.errno))
    if e.errno in DISK_FULL:
        try:
            free = f"{int(shutil.disk_usage(folder).free)} bytes free"
        except OSError:
            free = "free space unknown"
        return FolderError(
            f"{folder}: no space left on its file system ({e.strerror}, {code}; {free}): "
            f"{what} cannot even write its lock file there; free space on that file system "
            "or choose a folder on another"
        )
    return FolderError(
        f"{folder} is not writable ({e.strerror}, {code}): {what} writes its records there; "
        "make it writable (a read-only mount: remount it read-write; a folder: chmod u+w) or "
        "choose another folder"
    )


class FolderClaim:
    """An exclusive claim on a folder for a process's life: ``FOLDER/.lock``, opened without
    following a symlink and held with ``flock(LOCK_EX | LOCK_NB)``, which the kernel drops when
    the process ends however it ends (no stale lock after a ``kill -9``). The file records who
    holds it (``pid``, ``host``, ``what``, the command line, the start time) for the refusal's
    message.

    Taking it is atomic: two processes started at the same moment cannot both hold it (a check
    of the folder followed by a write could both pass), so a caller takes the claim *before* it
    checks what the folder holds. The second raises :class:`FolderBusy` naming the holder.
    On release the file is removed; a claim taken on a file that was removed meanwhile (its
    holder released it between our open and our lock) is retried on the new file.

    A file system without ``flock`` (:data:`NO_FLOCK`: NFS without its lock daemon, some FUSE
    mounts) gets an exclusive lock file instead: ``.lock`` created with ``O_EXCL`` holds the
    folder while it exists. A process killed with ``kill -9`` leaves it behind; a later claim
    on the same host removes it once its ``pid`` is dead, and one from another host is refused
    naming the holder and the host (delete ``.lock`` if that process is gone). Two processes
    that find the same stale file at the same moment can both remove it, the narrow race of
    any pid file: ``flock`` has none.

    A folder that cannot be written (a read-only mount, no permission) or whose file system is
    full raises :class:`FolderError` naming it, and leaves no ``.lock`` behind.

    Users: ``paravt.train.run`` (``train.out_dir``, rank 0), ``paravt.eval`` (``--out``) and
    the experiments' drivers (``paravt.experiments.arms.FolderLock``)."""

    NAME = ".lock"

    def __init__(self, folder: str | Path, what: str, fix: str = "") -> None:
        self.folder, self.what, self.fix = Path(folder), what, fix
        self.path = self.folder / self.NAME
        self.fd: int | None = None
        self.flock = True  # False: the fallback lock file (no flock on this file system)

    def holder(self) -> dict[str, Any]:
        """What the lock file says of its holder ({} when unreadable)."""
        try:
            raw = read_regular(self.path)
            got = json.loads(raw) if raw else {}
        except (OSError, ValueError):
            return {}
        return got if isinstance(got, dict) else {}

    def _busy(self, h: dict[str, Any] | None = None) -> FolderBusy:
        h = self.holder() if h is None else h
        for _ in range(20):  # a holder that has just locked writes its record a moment later
            if h:
                break
            time.sleep(0.05)
            h = self.holder()
        who = f"pid {h.get('pid', '?')}"
        if h.get("host") and h["host"] != os.uname().nodename:
            who += f" on host {h['host']}"
        if h.get("what"):
            who += f", {h['what']}"
        if h.get("since"):
            who += f", since {h['since']}"
        if h.get("argv"):
            who += f": {' '.join(map(str, h['argv']))[:200]}"
        fix = self.fix or "wait for it to end, stop it, or choose another folder"
        if not self.flock:
            fix += f" (if that process is gone, delete {self.path})"
        return FolderBusy(f"{self.folder} is in use by another process ({who}); {fix}")

    def _open(self, flags: int) -> int:
        try:
            return os.open(self.path, flags | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise not_regular(self.path, os.lstat(self.path).st_mode, "lock") from None
            if e.errno in (errno.EEXIST, errno.ENOENT):
                raise
            raise _unwritable(self.folder, e, self.what) from None

    def acquire(self) -> FolderClaim:
        """Take the claim or raise :class:`FolderBusy` (:class:`FolderError` for a folder that
        cannot be written); returns self."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _unwritable(self.folder, e, self.what) from None
        for _ in range(20):
            try:  # O_EXCL first: the fallback needs to know whether the file is ours
                fd, created = self._open(os.O_CREAT | os.O_EXCL), True
            except FileExistsError:
                try:
                    fd, created = self._open(0), False
                except FileNotFoundError:  # its holder released it meanwhile
                    continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise self._busy() from None
            except OSError as e:
                if e.errno not in NO_FLOCK:
                    os.close(fd)
                    raise
                if self._fallback(fd, created, e):
                    return self
                continue
            try:  # the file we locked is still the one at the path: ours
                same = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            self._hold(fd)
            return self
        raise FolderBusy(f"{self.path}: the lock file keeps being replaced; retry")

    def _hold(self, fd: int) -> None:
        """Write the holder's record into the file we now hold; a write that fails (a full
        disk) removes the file and raises :class:`FolderError`."""
        self.fd = fd
        info = {
            "pid": os.getpid(),
            "host": os.uname().nodename,
            "what": self.what,
            "argv": sys.argv,
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        try:
            self.record(info)
        except OSError as e:
            self.release()
            raise _unwritable(self.folder, e, self.what) from None

    def _fallback(self, fd: int, created: bool, e: OSError) -> bool:
        """The claim on a file system without ``flock`` (class docstring): held when we created
        the file; busy when a live (or unknown) holder has it; a stale file is removed and the
        caller retries (False)."""
        if self.flock:
            self.flock = False
            _log.warning(
                f"{self.folder}: its file system does not support flock "
                f"({errno.errorcode.get(e.errno or 0, e.errno)}): claiming it with an exclusive "
                f"lock file {self.path} instead (a holder killed with kill -9 leaves it; a "
                "later claim on this host removes it once that pid is dead)"
            )
        if created:
            self._hold(fd)
            return True
        os.close(fd)
        h = self.holder()
        try:
            age = time.time() - os.stat(self.path, follow_symlinks=False).st_mtime
        except FileNotFoundError:
            return False  # released meanwhile: retry
        if not h:
            if age < _EMPTY_LOCK_STALE_S:
                raise self._busy()
        elif h.get("host") not in (None, os.uname().nodename) or _alive(h.get("pid")):
            raise self._busy(h)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # stale: its holder is dead
        return False

    def record(self, info: dict[str, Any]) -> None:
        """Rewrite what the lock file says of its holder (through the held file: a rename
        would put an unlocked file at the path)."""
        assert self.fd is not None, "record() on a claim not held"
        blob = (json.dumps(info) + "\n").encode()
        os.ftruncate(self.fd, 0)
        if os.pwrite(self.fd, blob, 0) != len(blob):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))

    def release(self) -> None:
        """Remove the lock file and drop the claim (idempotent)."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> FolderClaim:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _alive(pid: Any) -> bool:
    """Whether a process ``pid`` of this host lives (True when unknown: not an int, or one we
    may not signal)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def writes_as_rank0(environ: Any = None) -> bool:
    """Whether this process writes a folder's records as rank 0: ``RANK`` unset or 0, or no
    distributed job to be a rank of (``WORLD_SIZE`` unset, 1 or unreadable). A ``RANK=1`` left
    in the environment of a shell inside a torchrun or Kubernetes job, with no ``WORLD_SIZE``
    above 1, is a stray: ``paravt.distributed.init_distributed`` then runs one process, rank 0,
    which writes every record, so it must hold the claim too (two such runs into one folder
    were both let in)."""
    env = os.environ if environ is None else environ
    if env.get("RANK", "0").strip() in ("", "0"):
        return True
    try:
        return int(env.get("WORLD_SIZE", "1")) <= 1
    except ValueError:
        return True


def claim_folder(folder: str | Path, what: str, fix: str = "") -> FolderClaim | None:
    """The :class:`FolderClaim` on ``folder`` of a command's rank 0 (:func:`writes_as_rank0`:
    the process that writes the folder's records); None on the other ranks of a distributed
    job, which write nothing there before rank 0 has its claim. Raises :class:`FolderError`
    (:class:`FolderBusy` when another process holds it)."""
    if not writes_as_rank0():
        return None
    return FolderClaim(folder, what, fix).acquire()
