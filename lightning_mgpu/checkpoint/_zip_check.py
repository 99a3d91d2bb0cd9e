"""Check a torch zip checkpoint's records against the CRC-32 the archive stores for each of them.

``torch.load`` does not check them, so a flipped bit in a tensor's bytes loads as a wrong value
without a word. :class:`RecordCheck` reads every record once and compares; a damaged record is
named by the tensors whose storage it holds (``model.3.weight``), found by where the memory-mapped
tensors lie in the file.

An export runs the check in a thread while it writes (``zlib.crc32`` and file reads release the
GIL), and waits for it before renaming the result into place, so the check costs little time and a
damaged source never becomes a clean-looking export.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

__all__ = ["RecordCheck"]

logger = logging.getLogger(__name__)

_CHUNK = 8 << 20
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length


class _Offsets(Protocol):
    def file_offset(self, address: int) -> int | None: ...


class _Record:
    """One stored (uncompressed) record: name, where its bytes start, how many, their CRC-32."""

    def __init__(self, name: str, start: int, size: int, crc: int) -> None:
        self.name, self.start, self.size, self.crc = name, start, size, crc


def _release(mapped: mmap.mmap, start: int, size: int) -> None:
    """Drop a summed range's pages from this process (they stay in the page cache)."""
    advise = getattr(mapped, "madvise", None)
    dontneed = getattr(mmap, "MADV_DONTNEED", None)
    if advise is None or dontneed is None:
        return
    aligned = start - start % mmap.PAGESIZE
    advise(dontneed, aligned, start + size - aligned)


class RecordCheck:
    """Compares every stored record of a torch zip file with its CRC-32.

    Call :meth:`start` to run it in a thread, then :meth:`verify`; :meth:`verify` alone runs it
    in the caller.
    """

    def __init__(self, path: Path, offsets: _Offsets | None = None) -> None:
        """``offsets`` tells where memory-mapped tensors lie in the file (``MappedFile``), to name them."""
        self.path, self._offsets = path, offsets
        self._damaged: list[_Record] | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin checking in a background thread."""
        if self._thread is None and self._damaged is None:
            self._thread = threading.Thread(target=self._run, name="lightning-mgpu-crc", daemon=True)
            self._thread.start()

    def verify(self, tensors: Mapping[str, Any]) -> None:
        """Wait for the check; raise if a record is damaged.

        Args:
            tensors: The state_dict read from the file, to name the damaged tensors.

        Raises:
            ValueError: a record's bytes do not match its CRC-32; the message names the tensors.
        """
        if self._thread is not None:
            self._thread.join()
        elif self._damaged is None:
            self._run()
        if self._error is not None:
            raise ValueError(f"{self.path} could not be checked: {self._error}") from None
        if self._damaged:
            raise ValueError(self._message(self._damaged, tensors))

    def _run(self) -> None:
        try:
            self._damaged = self._check()
        except (OSError, zipfile.BadZipFile, struct.error) as err:
            self._error = err

    def _records(self, file: Any) -> list[_Record]:
        with zipfile.ZipFile(self.path) as archive:
            infos = archive.infolist()
        records = []
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED:
                continue  # torch never compresses; zipfile itself checks compressed records
            file.seek(info.header_offset)
            signature, name_length, extra_length = _LOCAL_HEADER.unpack(file.read(_LOCAL_HEADER.size))
            if signature != b"PK\x03\x04":
                raise zipfile.BadZipFile(f"no local header for {info.filename}")
            start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
            records.append(_Record(info.filename, start, info.file_size, info.CRC))
        return records

    def _check(self) -> list[_Record]:
        damaged = []
        with open(self.path, "rb") as file:
            records = self._records(file)
            if not records or os.fstat(file.fileno()).st_size == 0:
                return []
            # CRC straight from a private map of the file: no copy into a buffer; each chunk's pages
            # leave this process once summed, so its memory stays near one chunk
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            view = memoryview(mapped)
            for record in records:
                crc, at, end = 0, record.start, min(record.start + record.size, len(mapped))
                while at < end:
                    step = min(_CHUNK, end - at)
                    crc = zlib.crc32(view[at : at + step], crc)
                    _release(mapped, at, step)
                    at += step
                if end - record.start < record.size or crc != record.crc:
                    damaged.append(record)
            view.release()
        finally:
            mapped.close()
        logger.debug(
            "%s: %d records checked against their CRC-32, %d damaged", self.path, len(records), len(damaged)
        )
        return damaged

    def _message(self, damaged: list[_Record], tensors: Mapping[str, Any]) -> str:
        starts = {record.start: record for record in damaged}
        names: dict[str, list[str]] = {record.name: [] for record in damaged}
        if self._offsets is not None:
            for key, value in tensors.items():
                if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
                    continue
                position = self._offsets.file_offset(value.untyped_storage().data_ptr())
                if position in starts:
                    names[starts[position].name].append(key)
        parts = []
        for record in damaged:
            held = names[record.name]
            what = ("tensor " + ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")) if held else "data"
            parts.append(f"{what} (record {record.name})")
        return (
            f"{self.path} is corrupt: the stored bytes of {'; '.join(parts)} do not match the CRC-32 the "
            "file recorded when it was written, so the values are not the ones saved; copy the file "
            "again from where it was written, or use another checkpoint"
        )
