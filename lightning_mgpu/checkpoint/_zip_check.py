"""Check torch zip archives against the CRC-32 they store for each record, through ``zipfile``.

``torch.load`` does not check them, so a flipped bit in a tensor's bytes loads as a wrong value
without a word. ``zipfile`` does, for stored and compressed records alike, reading each one in
pieces of 1 MiB; the checks here only say which tensors a damaged record
holds:

- :class:`RecordCheck`: a ``.pt`` / ``.ckpt`` file; a damaged record is named by the tensors whose
  storage it holds (``model.3.weight``), found by where the memory-mapped tensors lie in the file;
- :class:`ArchiveCheck`: the archives a sharded checkpoint's shard files hold one after another (one
  ``torch.save`` per chunk); a damaged one is named by the entry whose chunk it holds.

An export runs the check in a thread while it writes (``zlib.crc32`` and file reads release the
GIL), and waits for it before renaming the result into place, so the check costs little time and a
damaged source never becomes a clean-looking export. :class:`Window` shows one archive inside a
larger file as a file of its own, so that nothing outside it is ever read; :func:`stored_records`
says where each record's bytes lie, which is what lets the readers copy stored values straight
from the file (``MappedFile``, ``_dcp_chunk``) instead of through ``zipfile``'s copies.
"""

from __future__ import annotations

import io
import logging
import os
import struct
import threading
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch

__all__ = ["Archive", "ArchiveCheck", "Check", "RecordCheck", "StoredRecord", "Window", "stored_records"]

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20  # read, summed, then dropped: the check holds about this much of the file
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length


class _Offsets(Protocol):
    def file_offset(self, address: int) -> int | None: ...


class Window(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file, as a file of their own, read without copies."""

    def __init__(self, file: BinaryIO, start: int, length: int) -> None:
        super().__init__()
        self._file, self._start, self._length, self._pos = file, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = min(max(base + offset, 0), self._length)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        wanted = min(len(buffer), self._length - self._pos)
        if wanted <= 0:
            return 0
        self._file.seek(self._start + self._pos)
        got = self._file.readinto(memoryview(buffer).cast("B")[:wanted]) or 0  # type: ignore[attr-defined]
        self._pos += got
        return got


@dataclass(frozen=True)
class StoredRecord:
    """One record: its name, where its bytes start in the file, how many there are, and its size.

    ``size`` is what the record holds once read; for a compressed record, ``compressed`` is the
    bytes it takes in the file, else None.
    """

    name: str
    start: int
    size: int
    compressed: int | None = None


def stored_records(file: BinaryIO, start: int = 0, length: int | None = None) -> list[StoredRecord]:
    """Every record of the zip archive at bytes ``[start, start + length)`` of ``file``.

    ``length=None``: the archive is the whole file. Where a record begins, and the archive's own
    directory, are read within those bytes only.

    Raises:
        zipfile.BadZipFile: the bytes are no zip archive, or a record has no local header.
    """
    if length is None:
        length = os.fstat(file.fileno()).st_size - start
    window = Window(file, start, length)
    with zipfile.ZipFile(window) as archive:
        infos = archive.infolist()
    records = []
    for info in infos:
        if not 0 <= info.header_offset < length:
            raise zipfile.BadZipFile(f"{info.filename} lies outside the archive")
        window.seek(info.header_offset)
        header = window.read(_LOCAL_HEADER.size)
        if len(header) < _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
            raise zipfile.BadZipFile(f"no local header for {info.filename}")
        _, name_length, extra_length = _LOCAL_HEADER.unpack(header)
        data = start + info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
        compressed = None if info.compress_type == zipfile.ZIP_STORED else info.compress_size
        records.append(StoredRecord(info.filename, data, info.file_size, compressed))
    return records


def _damaged(archive: zipfile.ZipFile) -> list[str]:
    """The records that ``zipfile``, reading each 1 MiB at a time, stored or compressed, finds do not
    match their CRC-32."""
    damaged = []
    for info in archive.infolist():
        try:
            with archive.open(info) as record:
                while record.read(_CHUNK):
                    pass
        except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as err:
            logger.debug("%s: %s", info.filename, err)
            damaged.append(info.filename)
    return damaged


class Check:
    """A CRC-32 check that runs in a thread: :meth:`start` it, then :meth:`verify`; :meth:`verify`
    alone runs it in the caller."""

    def __init__(self) -> None:
        self._damaged: list[Any] | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin checking in a background thread."""
        if self._thread is None and self._damaged is None:
            self._thread = threading.Thread(target=self._run, name="lightning-mgpu-crc", daemon=True)
            self._thread.start()

    def verify(self, tensors: Mapping[str, Any] | None = None) -> None:
        """Wait for the check; raise if a record is damaged.

        Args:
            tensors: The state_dict read from the file, to name the damaged tensors.

        Raises:
            ValueError: a record's bytes do not match its CRC-32; the message names what it holds.
        """
        if self._thread is not None:
            self._thread.join()
        elif self._damaged is None:
            self._run()
        if self._error is not None:
            raise ValueError(f"{self._where()} could not be checked: {self._error}") from None
        if self._damaged:
            raise ValueError(self._message(self._damaged, tensors or {}))

    def _run(self) -> None:
        try:
            self._damaged = self._check()
        except Exception as err:  # reported by verify, in the caller's thread, never printed by this one
            self._error = err

    def _check(self) -> list[Any]:
        raise NotImplementedError

    def _where(self) -> str:
        raise NotImplementedError

    def _message(self, damaged: list[Any], tensors: Mapping[str, Any]) -> str:
        raise NotImplementedError


_ADVICE = (
    "do not match the CRC-32 {what} recorded when it was written, so the values are not the ones saved; "
    "copy {what} again from where it was written, or use another checkpoint"
)


class RecordCheck(Check):
    """Compares every record of a torch zip file with its CRC-32."""

    def __init__(self, path: Path, offsets: _Offsets | None = None) -> None:
        """``offsets`` tells where memory-mapped tensors lie in the file (``MappedFile``), to name them."""
        super().__init__()
        self.path, self._offsets = path, offsets

    def _where(self) -> str:
        return str(self.path)

    def _check(self) -> list[StoredRecord]:
        with zipfile.ZipFile(self.path) as archive:
            damaged = set(_damaged(archive))
            logger.debug(
                "%s: %d records checked, %d damaged", self.path, len(archive.infolist()), len(damaged)
            )
        if not damaged:
            return []
        with open(self.path, "rb") as file:
            return [record for record in stored_records(file) if record.name in damaged]

    def _message(self, damaged: list[StoredRecord], tensors: Mapping[str, Any]) -> str:
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
        advice = _ADVICE.format(what="the file")
        return f"{self.path} is corrupt: the stored bytes of {'; '.join(parts)} {advice}"


@dataclass(frozen=True)
class Archive:
    """A ``torch.save`` archive at bytes ``[start, start + length)`` of ``path``, and what it holds."""

    path: Path
    start: int
    length: int
    holds: str  # for the message: "'state_dict.model.0.weight', chunk at [8, 0]"


class ArchiveCheck(Check):
    """Compares every record of several archives inside larger files with its CRC-32."""

    def __init__(self, archives: Sequence[Archive]) -> None:
        super().__init__()
        self._archives = list(archives)

    def _where(self) -> str:
        files = sorted({str(a.path) for a in self._archives})
        return ", ".join(files[:3]) + (", ..." if len(files) > 3 else "")

    def _check(self) -> list[tuple[Archive, str, bool]]:
        """``(archive, what is wrong, whether it is a CRC mismatch)`` for each damaged archive or record."""
        damaged: list[tuple[Archive, str, bool]] = []
        by_file: dict[Path, list[Archive]] = {}
        for archive in self._archives:
            by_file.setdefault(archive.path, []).append(archive)
        for path, archives in by_file.items():
            with open(path, "rb") as file:
                if os.fstat(file.fileno()).st_size == 0:
                    damaged += [(a, "the file is empty", False) for a in archives]
                    continue
                for archive in sorted(archives, key=lambda a: a.start):
                    damaged += self._archive(file, archive)
        logger.debug(
            "%d archives checked against their CRC-32, %d damaged", len(self._archives), len(damaged)
        )
        return damaged

    @staticmethod
    def _archive(file: BinaryIO, archive: Archive) -> list[tuple[Archive, str, bool]]:
        try:
            with zipfile.ZipFile(Window(file, archive.start, archive.length)) as opened:
                return [(archive, f"record {name}", True) for name in _damaged(opened)]
        except (zipfile.BadZipFile, struct.error, ValueError, OSError) as err:
            return [(archive, str(err) or type(err).__name__, False)]

    def _message(self, damaged: list[tuple[Archive, str, bool]], tensors: Mapping[str, Any]) -> str:
        archive, why, crc = damaged[0]
        if not crc:
            end = archive.start + archive.length
            return (
                f"{archive.path} is corrupt: {archive.holds} at bytes {archive.start:,}-{end:,} is no "
                f"readable torch archive ({why}); copy the folder again from where it was written, or use "
                "another checkpoint"
            )
        here = [(a, w) for a, w, c in damaged if c and a.path == archive.path]
        parts = [f"{a.holds} ({w})" for a, w in here[:5]]
        more = f"; and {len(damaged) - len(parts)} more" if len(damaged) > len(parts) else ""
        advice = _ADVICE.format(what="the folder")
        return f"{archive.path} is corrupt: the stored bytes of {'; '.join(parts)}{more} {advice}"
