"""Atomic file writes: a temporary file in the destination folder, fsync, rename.

Readers see either the old file or the complete new one, never a half-written file, and a failure
at any point (an exception, Ctrl-C, a full disk) leaves the destination as it was and no temporary
file behind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_write"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _check_destination(path: Path) -> None:
    if path.is_dir():
        raise IsADirectoryError(f"cannot write {path}: it is a folder; give a file name inside it")
    parent = path.parent
    if not parent.exists():
        raise FileNotFoundError(f"cannot write {path}: the folder {parent} does not exist")
    if not parent.is_dir():
        raise NotADirectoryError(f"cannot write {path}: {parent} is a file, not a folder")


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Open a temporary file next to ``path``; on success it replaces ``path``.

    Raises:
        IsADirectoryError, FileNotFoundError, NotADirectoryError, PermissionError: the destination
            cannot be written; the message says why.

    Example::

        with atomic_write("out/model.safetensors") as f:
            f.write(data)
    """
    path = Path(path)
    _check_destination(path)
    try:
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except PermissionError:
        raise PermissionError(
            f"cannot write {path}: no permission to create files in {path.parent}"
        ) from None
    except OSError as err:
        error = OSError(f"cannot write {path}: {err.strerror or err}")
        error.errno = err.errno
        raise error from None
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        mode = path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~_umask()
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    # makes the rename itself durable; not every platform can open a folder
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
