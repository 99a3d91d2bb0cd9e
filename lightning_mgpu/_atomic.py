"""Atomic file writes: a temporary file in the destination folder, fsync, rename; URLs through fsspec.

Readers see either the old file or the complete new one, never a half-written file, and a failure
at any point (an exception, Ctrl-C, SIGTERM, a full disk) leaves the destination as it was and no
temporary file behind. A process killed outright (SIGKILL, a lost machine) cannot clean up: its
temporary file carries its host and process id (``.NAME.HOST.PID.RANDOM.tmp``), and the next write
into that folder, whatever file it writes, removes the ones whose process no longer exists on this host.

Writers call :func:`start_writeback` every :data:`WRITEBACK_BYTES` (or write through
:class:`WritebackWriter`), so the disk writes while the rest of the file is produced and the closing
fsync has little left to wait for: on Linux this takes a 1 GiB export from copy-then-flush (about
1.2 s on a small test machine) down to about the disk's own write time (0.8-0.9 s).

A URL of another file system (``s3://bucket/model.safetensors``, ``memory://...``) is written as
Lightning writes checkpoints there: through fsspec (``url_to_fs``, what Lightning's
``get_filesystem`` calls) inside a transaction, so the object appears only once the write is
complete. Local paths keep the writer above, not Lightning's ``_atomic_save`` nor fsspec's local
transaction: the first holds the whole file in memory before writing it (an export streams it in
about one tensor's memory, ``benchmarks/export.py``), the second writes in the system's temporary
folder and moves the file over (a copy, not a rename, across disks) without an fsync, and neither
follows symlinks, keeps permissions or cleans up after a killed writer.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import signal
import socket
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, BinaryIO, cast

import psutil

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

__all__ = [
    "WRITEBACK_BYTES",
    "WritebackWriter",
    "atomic_write",
    "cannot_write",
    "has_fileno",
    "local_path",
    "start_writeback",
]

WRITEBACK_BYTES = 16 << 20
"""How much to write between two :func:`start_writeback` calls: large steps, so the disk does not
get many small writes."""

_SYNC_FILE_RANGE_WRITE = 2  # from <fcntl.h>: start writing dirty pages, do not wait

logger = logging.getLogger(__name__)


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    # the os module does not expose sync_file_range(2); libc has it on Linux
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_sync_file_range = _load_sync_file_range()


def start_writeback(file: BinaryIO) -> None:
    """Ask the kernel to start writing ``file``'s dirty pages to disk now, without waiting.

    Only a hint: a no-op where the platform has no ``sync_file_range`` or the file does not support
    it (a pipe, some network file systems, an fsspec file of a remote store). Durability still comes
    from the fsync in :func:`atomic_write`.
    """
    file.flush()
    if _sync_file_range is not None and has_fileno(file):
        _sync_file_range(file.fileno(), 0, 0, _SYNC_FILE_RANGE_WRITE)  # 0, 0: the whole file


def has_fileno(file: BinaryIO) -> bool:
    """Whether ``file`` is backed by a descriptor of this machine (not a remote store's buffer)."""
    try:
        file.fileno()
    except (OSError, ValueError):  # io.UnsupportedOperation is both
        return False
    return True


class WritebackWriter:
    """A write-only view of a file that calls :func:`start_writeback` every :data:`WRITEBACK_BYTES`.

    For writers that only call ``write`` (``torch.save``).
    """

    def __init__(self, file: BinaryIO) -> None:
        self._file, self._pending = file, 0

    def write(self, data: bytes | memoryview) -> int:
        written = self._file.write(data)
        self._pending += written
        if self._pending >= WRITEBACK_BYTES:
            start_writeback(self._file)
            self._pending = 0
        return written

    def flush(self) -> None:
        self._file.flush()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_NOT_FILES = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
)


def cannot_write(path: str | os.PathLike[str], err: OSError) -> OSError:
    """``err`` (same type and errno) with a message that names the file being written."""
    error = type(err)(f"cannot write {path}: {err.strerror or err}")
    error.errno = err.errno
    return error


def _destination(path: Path) -> Path:
    """The regular file to replace: ``path``, or the file a symlink at ``path`` points to."""
    try:
        mode = path.stat().st_mode  # follows links, /dev/stdout's too
    except (FileNotFoundError, NotADirectoryError):
        mode = None
    except OSError as err:  # a link loop, a folder we may not search
        raise cannot_write(path, err) from None
    if mode is not None and stat.S_ISDIR(mode):
        raise IsADirectoryError(f"cannot write {path}: it is a folder; give a file name inside it")
    if mode is not None and not stat.S_ISREG(mode):
        kind = next((name for test, name in _NOT_FILES if test(mode)), "not a regular file")
        raise OSError(
            f"cannot write {path}: it is {kind}, not a regular file, and an export replaces its destination "
            "with a new file rather than writing into it; give the name of a file to create or overwrite "
            "instead (e.g. model.safetensors)"
        )
    if mode is not None and not os.access(path, os.W_OK):
        raise PermissionError(
            f"cannot write {path}: it is read-only (mode {stat.S_IMODE(mode):o}); make it writable "
            "(chmod u+w) or remove it first, or give another name"
        )
    if path.is_symlink():  # replace the target, so the link stays a link to the new file
        path = Path(os.path.realpath(path))
    parent = path.parent
    if not parent.exists():
        raise FileNotFoundError(f"cannot write {path}: the folder {parent} does not exist")
    if not parent.is_dir():
        raise NotADirectoryError(f"cannot write {path}: {parent} is a file, not a folder")
    return path


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Open a temporary file next to ``path``; on success it replaces ``path``.

    - A symlink at ``path`` is followed: its target is replaced, and the link stays a link to the
      new file.
    - A device, named pipe or socket at ``path`` is refused before anything is written: it would
      be replaced by an ordinary file, not written into.
    - A file the caller may not write is refused, as ``cp`` or ``open`` would refuse it, although
      renaming over it would work. A file the caller may write keeps its permissions (a private
      ``0o600`` file stays private), unless it was read-only (root may replace one): the new file
      then gets the mode a fresh file gets under the umask, not a read-only mode.

    - A URL of another file system (``s3://...``, see :func:`local_path`) is written through fsspec
      in a transaction: nothing appears there unless the block completes.

    Raises:
        IsADirectoryError, FileNotFoundError, NotADirectoryError, PermissionError, OSError: the
            destination cannot be written; the message says why and what to give instead.
        ValueError: a URL whose protocol fsspec cannot open here (``s3://`` without ``s3fs``).

    Example::

        with atomic_write("out/model.safetensors") as f:
            f.write(data)
    """
    local = local_path(path)
    if local is None:
        fs, url = _filesystem(os.fspath(path))
        with fs.transaction, fs.open(url, "wb") as remote:
            yield cast(BinaryIO, remote)
        return
    path = _destination(local)
    _remove_orphans(path)
    try:
        fd, tmp_name = tempfile.mkstemp(
            dir=path.parent, prefix=f".{path.name}.{_HOST}.{os.getpid()}.", suffix=".tmp"
        )
    except PermissionError:
        raise PermissionError(
            f"cannot write {path}: no permission to create files in {path.parent}"
        ) from None
    except OSError as err:
        raise cannot_write(path, err) from None
    tmp = Path(tmp_name)
    try:
        with _terminate_as_exception():
            with os.fdopen(fd, "wb") as file:
                yield file
                file.flush()
                os.fsync(file.fileno())
            os.chmod(tmp, _new_mode(path))
            os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        if isinstance(err, _Terminated):
            err.deliver()  # ends the process as SIGTERM would have, now that nothing is left behind
        raise
    _fsync_folder(path.parent)


def local_path(path: str | os.PathLike[str]) -> Path | None:
    """``path`` as a path of this machine (a ``file://`` URL too), or None for another file system's URL."""
    if isinstance(path, str) and "://" in path:
        from fsspec.implementations.local import LocalFileSystem

        fs, url = _filesystem(path)
        return Path(url) if isinstance(fs, LocalFileSystem) else None
    return Path(path)


def _filesystem(url: str) -> tuple[AbstractFileSystem, str]:
    # fsspec is imported for URLs only: local writes (plot-memory, callbacks) need not pay its import
    from fsspec.core import url_to_fs

    try:
        return cast("tuple[AbstractFileSystem, str]", url_to_fs(url))
    except (ImportError, ValueError) as err:
        raise ValueError(
            f"cannot write {url}: fsspec cannot open it ({err}); install the fsspec package for its "
            "protocol (s3fs for s3://, gcsfs for gs://, adlfs for az://) or give a local path"
        ) from None


# the host in temporary names: a process id means something only on the machine that ran it
_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname().split(".")[0])[:32] or "host"


def _remove_orphans(path: Path) -> None:
    """Remove temporary files in ``path``'s folder left by processes of this host that no longer exist.

    Any name's, not only ``path``'s: checkpoint names change every epoch, so a file killed while
    writing ``epoch=3.safetensors`` is seldom written again. A live process's files are left alone,
    and so are another host's (on a shared file system), whose process ids mean nothing here.
    """
    pattern = re.compile(r"\.(.+)\." + re.escape(_HOST) + r"\.(\d+)\.[A-Za-z0-9_]+\.tmp")
    with contextlib.suppress(OSError):
        for entry in os.scandir(path.parent):
            match = pattern.fullmatch(entry.name)
            if match is None or psutil.pid_exists(int(match.group(2))):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                logger.warning(
                    "removed %s, left by an earlier write of %s whose process (%s) was killed",
                    entry.path,
                    match.group(1),
                    match.group(2),
                )


class _Terminated(BaseException):
    """SIGTERM arrived during an atomic write: raised to unwind it, then the signal is delivered again."""

    def deliver(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def _terminate_as_exception() -> Iterator[None]:
    """While the block runs, SIGTERM raises :class:`_Terminated`, if SIGTERM would otherwise kill.

    A handler the program installed (Lightning's, which saves and exits cleanly) is left alone, as
    is an ignored SIGTERM; only the default action, which would kill the process mid-write and
    leave the temporary file, is replaced, and only in the main thread, where handlers run.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
    ):
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> Any:
        raise _Terminated()

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _new_mode(path: Path) -> int:
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        mode = 0
    return mode if mode & stat.S_IWUSR else 0o666 & ~_umask()


def _fsync_folder(folder: Path) -> None:
    # makes the rename itself durable; not every platform can open a folder
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
