"""Check torch zip archives against the CRC-32 they store for each record, through ``zipfile``.

``torch.load`` does not check them, so a flipped bit in a tensor's bytes loads as a wrong value
without a word. ``zipfile`` does, for stored and compressed records alike, reading each one in
pieces of 1 MiB; :class:`ArchiveCheck` only says what a damaged record holds: in a ``.pt`` /
``.ckpt`` file, the tensors whose storage it holds (``model.3.weight``), found by where the
memory-mapped tensors lie in the file; in the archives a sharded checkpoint's shard files hold one
after another (one ``torch.save`` per chunk), the entry whose chunk it holds.

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

__all__ = ["Archive", "ArchiveCheck", "StoredRecord", "Window", "stored_records"]

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


def stored_records(file: BinaryIO, start: int, length: int) -> list[StoredRecord]:
    """Every record of the zip archive at bytes ``[start, start + length)`` of ``file``.

    Where a record begins, and the archive's own directory, are read within those bytes only.

    Raises:
        zipfile.BadZipFile: the bytes are no zip archive, or a record has no local header.
    """
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


@dataclass(frozen=True)
class Archive:
    """A ``torch.save`` archive at bytes ``[start, start + length)`` of ``path``, and what it holds.

    ``length=None``: to the end of the file (a whole ``.pt`` / ``.ckpt`` file). ``holds`` is for the
    message: ``"'state_dict.model.0.weight', chunk at [8, 0]"``.
    """

    path: Path
    start: int = 0
    length: int | None = None
    holds: str = "data"


@dataclass(frozen=True)
class _Damage:
    archive: Archive
    why: str  # "record archive/data/0", or why the archive cannot be read
    crc: bool  # a record that does not match its CRC-32 (else the archive is unreadable)
    start: int | None = None  # where that record's bytes start in the file, when asked for


class ArchiveCheck:
    """Compares every record of torch archives with its CRC-32, in a thread: :meth:`start` it, then
    :meth:`verify` (which starts it if need be).

    Args:
        archives: A whole file (``[Archive(path)]``), or the archives of a sharded checkpoint's
            shard files, each named by the entry whose chunk it holds.
        offsets: Where the memory-mapped tensors of a whole file lie in it (``MappedFile``), so that
            a damaged record is named by the tensors whose storage it holds (``model.3.weight``).
    """

    def __init__(self, archives: Sequence[Archive], offsets: _Offsets | None = None) -> None:
        self._archives, self._offsets = list(archives), offsets
        self._outcome: list[_Damage] | Exception = []  # the damage found, or why it could not be looked for
        self._thread: threading.Thread | None = None

    def start(self) -> threading.Thread:
        """Begin checking in a background thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lightning-mgpu-crc", daemon=True)
            self._thread.start()
        return self._thread

    def verify(self, tensors: Mapping[str, Any] | None = None) -> None:
        """Wait for the check; raise if a record is damaged.

        Args:
            tensors: The state_dict read from the file, to name the damaged tensors.

        Raises:
            ValueError: a record's bytes do not match its CRC-32; the message names what it holds.
        """
        self.start().join()
        if isinstance(self._outcome, Exception):
            files = sorted({str(a.path) for a in self._archives})
            where = ", ".join(files[:3]) + (", ..." if len(files) > 3 else "")
            raise ValueError(f"{where} could not be checked: {self._outcome}") from None
        if self._outcome:
            raise ValueError(self._message(self._outcome, tensors or {}))

    def _run(self) -> None:
        try:
            self._outcome = self._check()
        except Exception as err:  # reported by verify, in the caller's thread, never printed by this one
            self._outcome = err

    def _check(self) -> list[_Damage]:
        damaged: list[_Damage] = []
        by_file: dict[Path, list[Archive]] = {}
        for archive in self._archives:
            by_file.setdefault(archive.path, []).append(archive)
        for path, archives in by_file.items():
            with open(path, "rb") as file:
                size = os.fstat(file.fileno()).st_size
                for archive in sorted(archives, key=lambda a: a.start):
                    damaged += self._archive(file, archive, size)
        logger.debug(
            "%d archives checked against their CRC-32, %d damaged", len(self._archives), len(damaged)
        )
        return damaged

    def _archive(self, file: BinaryIO, archive: Archive, size: int) -> list[_Damage]:
        if size == 0:
            return [_Damage(archive, "the file is empty", crc=False)]
        length = size - archive.start if archive.length is None else archive.length
        try:
            whole = archive.length is None  # a file of its own: read by zipfile directly, buffered
            with zipfile.ZipFile(file if whole else Window(file, archive.start, length)) as opened:
                names = _damaged(opened)
            starts = {}
            if names and self._offsets is not None:  # to name the tensors a record holds
                starts = {r.name: r.start for r in stored_records(file, archive.start, length)}
        except (zipfile.BadZipFile, struct.error, ValueError, OSError) as err:
            return [_Damage(archive, str(err) or type(err).__name__, crc=False)]
        return [_Damage(archive, f"record {name}", True, starts.get(name)) for name in names]

    def _message(self, damaged: list[_Damage], tensors: Mapping[str, Any]) -> str:
        first = damaged[0].archive
        where = "the file" if first.length is None else "the folder"
        again = f"copy {where} again from where it was written, or use another checkpoint"
        if not damaged[0].crc:
            span = "" if first.length is None else f" at bytes {first.start:,}-{first.start + first.length:,}"
            return (
                f"{first.path} is corrupt: {first.holds}{span} is no readable torch archive"
                f" ({damaged[0].why}); {again}"
            )
        held: dict[int | None, list[str]] = {}  # a record's start -> the tensors whose storage it holds
        for key, value in tensors.items():
            if self._offsets is not None and isinstance(value, torch.Tensor) and value.device.type == "cpu":
                position = self._offsets.file_offset(value.untyped_storage().data_ptr())
                held.setdefault(position, []).append(key)
        parts = []
        for damage in [d for d in damaged if d.crc and d.archive.path == first.path][:5]:
            names = held.get(damage.start, []) if damage.start is not None else []
            shown = "tensor " + ", ".join(names[:5]) + ", ..." * (len(names) > 5)
            parts.append(f"{shown if names else damage.archive.holds} ({damage.why})")
        more = f"; and {len(damaged) - len(parts)} more" if len(damaged) > len(parts) else ""
        return (
            f"{first.path} is corrupt: the stored bytes of {'; '.join(parts)}{more} do not match the CRC-32 "
            f"{where} recorded when it was written, so the values are not the ones saved; {again}"
        )
