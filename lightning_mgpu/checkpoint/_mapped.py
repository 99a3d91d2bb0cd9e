"""The bytes of a source file once it is read: where its memory-mapped tensors lie, and read errors.

- :class:`MappedFile` copies a mapped tensor's bytes file-to-file, so an export of a 10 GB file
  holds about one tensor, not the file (``benchmarks/export.py``);
- :class:`ReadError` is what failing to read a source raises while an export writes: it names the
  source, so that only errors of writing are reported as the target's.
"""

from __future__ import annotations

import contextlib
import os
import sys
import zipfile
from pathlib import Path
from typing import BinaryIO

import torch

from lightning_mgpu._atomic import has_fileno

__all__ = ["MappedFile", "ReadError"]


class ReadError(OSError):
    """Reading a source file failed: the message names that file, never the file being written."""

    @classmethod
    def of(cls, path: str | os.PathLike[str], err: OSError) -> ReadError:
        error = cls(f"cannot read {path}: {err.strerror or err}")
        error.errno = err.errno
        return error


class MappedFile:
    """Where the tensors of a memory-mapped checkpoint lie in their file, so a writer can stream them.

    :meth:`copy_to` copies a tensor's bytes file-to-file in the kernel (``copy_file_range``, else
    ``sendfile``), as ``cp`` does, without faulting them into this process: exporting a 10 GB
    checkpoint then costs this process about one tensor's worth of memory, not 10 GB of mapped pages.

    Only address ranges that ``/proc/self/maps`` shows as mappings of this very file are used, and
    nothing is copied when torch had to byte-swap the file (its mapped pages then differ from the
    file). Elsewhere than Linux it copies nothing and the writer writes from memory.
    """

    def __init__(self, path: Path, *, archive: bool = True) -> None:
        self.path = path
        self._ranges: list[tuple[int, int, int]] = []  # start, end, file offset of start
        self._fd: int | None = None
        if not sys.platform.startswith("linux"):
            return
        # a torch archive records its byte order; safetensors is mapped only where it is native
        if archive and _byteorder(path) not in (None, sys.byteorder):
            return
        real = os.path.realpath(path)
        inode = os.stat(real).st_ino
        with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].strip() == real and int(parts[4]) == inode:
                    start, end = (int(x, 16) for x in parts[0].split("-"))
                    self._ranges.append((start, end, int(parts[2], 16)))

    def file_offset(self, address: int, size: int = 1) -> int | None:
        """Where the ``size`` bytes at ``address`` lie in the file, or None if they are not mapped from it."""
        for lo, hi, offset in self._ranges:
            if lo <= address and address + size <= hi:
                return offset + address - lo
        return None

    def _offset(self, tensor: torch.Tensor) -> int | None:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        return self.file_offset(tensor.data_ptr(), tensor.numel() * tensor.element_size())

    def copy_to(self, tensor: torch.Tensor, file: BinaryIO) -> int:
        """Copy ``tensor``'s bytes from the file into ``file``; returns how many bytes were copied."""
        position = self._offset(tensor)
        if position is None or not has_fileno(file):
            return 0
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except OSError as err:
                raise ReadError.of(self.path, err) from None
        file.flush()
        out, total, done = file.fileno(), tensor.numel() * tensor.element_size(), 0
        copy_range = getattr(os, "copy_file_range", None)
        while done < total:
            try:
                if copy_range is not None:
                    n = copy_range(self._fd, out, total - done, position + done)
                else:
                    n = os.sendfile(out, self._fd, position + done, total - done)
            except OSError:
                if copy_range is None:
                    break
                copy_range = None  # e.g. EXDEV on old kernels: try sendfile
                continue
            if n == 0:
                break
            done += n
        return done

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _byteorder(path: Path) -> str | None:
    """The byte order a torch zip file records (absent in files from torch < 1.13)."""
    try:
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.endswith("/byteorder")), None)
            return archive.read(name).decode().strip() if name else None
    except (zipfile.BadZipFile, OSError, UnicodeDecodeError):
        return "unknown"
