"""What a ``torch.distributed.checkpoint`` index (``.metadata``) says to read, checked before anything is.

The index says where every chunk of every tensor lies: in which file, at which bytes, which part of
the tensor. A reader that follows it blindly opens any path it names, allocates any size it claims
and fills a tensor from chunks that overlap or leave holes. :func:`check_index` turns the unpickled
index into an :class:`Index` of small frozen records, or raises naming the file and the entry:

- every record's file is a plain name of a regular file in the folder (no separator, no ``..``, no
  absolute path), the record lies within that file, and no two records share a byte;
- every tensor has a plain dtype and a shape of non-negative sizes, its chunks lie inside it, do not
  overlap and cover it exactly (checked in time linear in the chunks, whatever their layout: an
  N x N grid as fast as a row), and each chunk's record is long enough for its values: a tensor is
  never larger than the bytes the folder holds for it, so nothing larger is ever allocated;
- no two entries are placed at the same nested name, nor one inside another.

A folder reads only itself: a shard, ``.metadata`` or ``meta.pt`` that is a symbolic link resolving
outside the folder is refused (:func:`regular_file`), naming the link; a link to another file of the
folder is followed. The unpickled objects are dropped once checked: time and memory grow about
linearly with the number of entries (the entries' names are sorted once).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_mgpu._compat.torch import storage_info_type
from lightning_mgpu.checkpoint._report import shown

__all__ = ["DTYPES", "METADATA", "Chunk", "Index", "Record", "TensorEntry", "check_index", "regular_file"]

log = logging.getLogger(__name__)

METADATA = ".metadata"  # torch.distributed.checkpoint.filesystem's name for it
AGAIN = "copy the checkpoint again from where it was written, or use another one"
_DTYPE_NAMES = [
    *("float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32"),
    *("int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool"),
    *("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"),
]
DTYPES: frozenset[torch.dtype] = frozenset(
    getattr(torch, name) for name in _DTYPE_NAMES if isinstance(getattr(torch, name, None), torch.dtype)
)
"""The dtypes a chunk may have: numbers, not the quantized or bit-packed types no state_dict saves."""


@dataclass(frozen=True, slots=True)
class Record:
    """Bytes ``[offset, offset + length)`` of the folder's file ``file``: one ``torch.save`` archive."""

    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()  # storage extensions (compression), which this reader does not undo


_SEQUENCES = (tuple, list, torch.Size)  # what torch writes shapes and offsets as
# (entry, chunk offsets or None for a saved object) -> its record
_Records = dict[tuple[str, "tuple[int, ...] | None"], Record]


@dataclass(frozen=True, slots=True)
class Chunk:
    """The part of a tensor at ``offsets`` of size ``sizes``, and the record holding its values."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    record: Record


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor of the index: dtype, shape, and chunks that cover it exactly once."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class Index:
    """What a checked ``.metadata`` holds, in its order.

    Attributes:
        tensors: Entry -> its tensor.
        objects: Entry -> the record of a saved Python object (an optimizer's ``param_groups``).
        paths: Entry -> the nested names it is saved under (``("state_dict", "model.0.weight")``).
        files: The folder's files the records lie in.
    """

    tensors: dict[str, TensorEntry]
    objects: dict[str, Record]
    paths: dict[str, tuple[str, ...]]
    files: list[str]


def check_index(folder: Path, loaded: Any) -> Index:
    """The :class:`Index` of ``folder``, whose unpickled ``.metadata`` is ``loaded``.

    Raises:
        FileNotFoundError: a file the index names is missing; the message names it and its entries.
        ValueError: the index is corrupt or crafted, or a file it names is too short or not a
            regular file; the message names the file and the entry.
    """
    return _Checker(folder, loaded).index()


def regular_file(path: Path, holds: str = "") -> os.stat_result:
    """``path``'s status, following a link within its folder; raises ValueError unless it is a
    regular file there. ``holds`` says what the index places in it (``"'model.0.weight'"``).
    """
    held = f" (where {METADATA} places {holds})" if holds else ""
    folder, real = Path(os.path.realpath(path.parent)), Path(os.path.realpath(path))
    if folder not in real.parents:
        raise ValueError(
            f"{path} is a link to {real}, outside {path.parent}: a checkpoint folder is read only from its "
            "own files, so it was not followed; copy that file into the folder in place of the link"
        )
    try:
        status = path.stat()
    except FileNotFoundError:
        raise
    except OSError as err:  # a link loop, a name too long
        raise ValueError(f"{path} cannot be read{held}: {err.strerror or err}") from None
    if not stat.S_ISREG(status.st_mode):
        kind = "a folder" if stat.S_ISDIR(status.st_mode) else "not a regular file"
        raise ValueError(f"{path} is {kind}{held}, so it is no part of a checkpoint; {AGAIN}")
    return status


class _Checker:
    """Turns an unpickled index into an :class:`Index`, or raises naming what is wrong."""

    def __init__(self, folder: Path, loaded: Any) -> None:
        from torch.distributed.checkpoint import metadata

        self.folder, self.index_path, self.loaded = folder, folder / METADATA, loaded
        self.md, self.storage_info = metadata, storage_info_type()
        self._names: set[str] = set()  # file names found plain

    def corrupt(self, problem: str) -> ValueError:
        return ValueError(f"{self.index_path} is corrupt: {problem}; {AGAIN}")

    def fail(self, key: Any, problem: str) -> ValueError:
        return self.corrupt(f"entry {shown(key)} {problem}")

    def index(self) -> Index:
        loaded = self.loaded
        if not isinstance(loaded, self.md.Metadata):
            raise self.corrupt(f"it holds a {type(loaded).__name__}, not a checkpoint index")
        parts: dict[str, Any] = {
            name: getattr(loaded, name, None) or ({} if name == "planner_data" else None)
            for name in ("state_dict_metadata", "storage_data", "planner_data")
        }
        for name, value in parts.items():
            if not isinstance(value, dict):
                raise self.corrupt(f"its {name} is a {type(value).__name__}, not a dict")
        saved, storage, planner = parts["state_dict_metadata"], parts["storage_data"], parts["planner_data"]
        records = self._records(storage)
        self._files(records)
        tensors: dict[str, TensorEntry] = {}
        objects: dict[str, Record] = {}
        for key, entry in saved.items():
            if not isinstance(key, str):
                raise self.fail(key, "is not named by a string")
            if isinstance(entry, self.md.TensorStorageMetadata):
                tensors[key] = self._tensor(key, entry, records)
            elif isinstance(entry, self.md.BytesStorageMetadata):
                if (key, None) not in records:
                    raise self.fail(key, "has no storage record")
                objects[key] = records[key, None]
            else:
                raise self.fail(key, f"is a {type(entry).__name__}, neither a tensor nor a saved object")
        paths = self._paths(saved, planner)
        files = sorted({record.file for record in records.values()})
        log.debug(
            "%s: %d tensors, %d objects in %d files", self.index_path, len(tensors), len(objects), len(files)
        )
        return Index(tensors, objects, paths, files)

    def _records(self, storage: dict[Any, Any]) -> _Records:
        records: _Records = {}
        for where, info in storage.items():
            key = getattr(where, "fqn", where)
            if not isinstance(where, self.md.MetadataIndex) or not isinstance(key, str):
                raise self.fail(key, f"is keyed by a {type(where).__name__}, not a storage index")
            offsets = None if where.offset is None else self._counts(key, where.offset, "chunk offset")
            if not isinstance(info, self.storage_info):
                raise self.fail(key, f"has a {type(info).__name__} for its storage, not a storage record")
            name = self._file_name(key, getattr(info, "relative_path", None))
            start = self._count(key, getattr(info, "offset", None), "byte offset")
            length = self._count(key, getattr(info, "length", None), "byte length")
            transforms = getattr(info, "transform_descriptors", None) or ()
            if not isinstance(transforms, (list, tuple)) or not all(isinstance(t, str) for t in transforms):
                raise self.fail(key, f"has storage extensions {shown(transforms)}, not a list of names")
            records[key, offsets] = Record(name, start, length, tuple(transforms))
        return records

    def _file_name(self, key: str, name: Any) -> str:
        if type(name) is str and name in self._names:  # a few files hold every record
            return name
        plain = (
            isinstance(name, str)
            and name not in ("", ".", "..")
            and not any(c in name for c in "/\\:\0")
            and not os.path.isabs(name)
        )
        if not plain:
            raise ValueError(
                f"{self.index_path} is corrupt or crafted: entry {key!r} places its data in {name!r}, which "
                f"is not a file of {self.folder} (an index names the folder's own shard files, such as "
                f"__0_0.distcp), so nothing was read from it; {AGAIN}"
            )
        self._names.add(str(name))
        return str(name)

    def _count(self, key: str, value: Any, what: str) -> int:
        if type(value) is not int or value < 0:  # not a bool either
            raise self.fail(key, f"has a {what} of {shown(value)}, not a count of bytes")
        return value

    def _counts(self, key: str, values: Any, what: str) -> tuple[int, ...]:
        if type(values) not in _SEQUENCES or [v for v in values if type(v) is not int or v < 0]:
            raise self.fail(key, f"has a {what} of {shown(values)}, not a list of non-negative whole numbers")
        return tuple(values)

    def _files(self, records: _Records) -> None:
        """Every file present, a regular file, long enough; no two records sharing a byte."""
        spans: dict[str, list[tuple[int, int, str]]] = {}
        for (key, _), record in records.items():
            spans.setdefault(record.file, []).append((record.offset, record.offset + record.length, key))
        missing = [name for name in sorted(spans) if _missing(self.folder / name)]
        if missing:
            what = "; ".join(f"{name} (holds {_some([k for _, _, k in spans[name]])})" for name in missing)
            raise FileNotFoundError(
                f"{self.folder} is incomplete: {len(missing)} of its {len(spans)} shard files "
                f"{'is' if len(missing) == 1 else 'are'} missing: {what}. Copy the whole folder, every "
                "rank's files included."
            )
        for name, ranges in sorted(spans.items()):
            size = regular_file(self.folder / name, _some([k for _, _, k in ranges])).st_size
            ranges.sort()
            reach, holder = 0, ""
            for start, end, key in ranges:
                if start < reach and start < end:
                    raise self.corrupt(
                        f"entries {holder!r} and {key!r} both place data at byte {start:,} of {name}, "
                        "so one would be read from the other's bytes"
                    )
                if end > reach:
                    reach, holder = end, key
            if size < reach:
                raise ValueError(
                    f"{self.folder / name} is truncated: {size:,} bytes, but {METADATA} places data up "
                    f"to byte {reach:,} (entry {holder!r}); {AGAIN}"
                )

    def _tensor(self, key: str, entry: Any, records: _Records) -> TensorEntry:
        dtype = getattr(getattr(entry, "properties", None), "dtype", None)
        if not isinstance(dtype, torch.dtype) or dtype not in DTYPES:
            raise self.fail(
                key, f"has dtype {shown(dtype)}, not a dtype of plain numbers, which this reader reads"
            )
        shape = self._counts(key, getattr(entry, "size", None), "shape")
        listed = getattr(entry, "chunks", None)
        if not isinstance(listed, (list, tuple)):
            raise self.fail(key, f"lists its chunks as a {type(listed).__name__}")
        size = dtype.itemsize
        chunks = []
        for chunk in listed:
            if not isinstance(chunk, self.md.ChunkStorageMetadata):
                raise self.fail(key, f"lists a {type(chunk).__name__} among its chunks")
            offsets = self._counts(key, getattr(chunk, "offsets", None), "chunk offset")
            sizes = self._counts(key, getattr(chunk, "sizes", None), "chunk size")
            if len(offsets) != len(shape) or len(sizes) != len(shape):
                raise self.fail(
                    key, f"has a chunk at {list(offsets)} of {len(sizes)} dimensions in a shape {list(shape)}"
                )
            if any(o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
                raise self.fail(
                    key,
                    f"has a chunk at {list(offsets)} of size {list(sizes)}, outside its shape {list(shape)}",
                )
            record = records.get((key, offsets))
            if record is None:
                raise self.fail(key, f"has no storage record for its chunk at {list(offsets)}")
            values = math.prod(sizes)
            if not record.transforms and record.length < values * size:
                raise self.fail(
                    key,
                    f"has a chunk at {list(offsets)} of {values:,} values ({values * size:,} bytes), but its "
                    f"record in {record.file} is {record.length:,} bytes long",
                )
            chunks.append(Chunk(offsets, sizes, record))
        fault = _cover_fault(chunks, shape)
        if isinstance(fault, tuple):
            raise self.fail(
                key, f"has chunks at {list(fault[0].offsets)} and {list(fault[1].offsets)} that overlap"
            )
        if fault is not None:
            raise self.fail(
                key, f"has chunks that leave part of its shape {list(shape)} unwritten (the value at {fault})"
            )
        return TensorEntry(dtype, shape, tuple(chunks))

    def _paths(self, saved: dict[str, Any], planner: dict[Any, Any]) -> dict[str, tuple[str, ...]]:
        """Each entry's nested names (``planner_data``), none the same as another's or inside another's."""
        paths: dict[str, tuple[str, ...]] = {}
        for key in saved:
            raw = planner.get(key, (key,))
            if (
                not isinstance(raw, (tuple, list))
                or not raw
                or not all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in raw)
            ):
                raise self.fail(key, f"is placed at {shown(raw)}, not a list of names")
            paths[key] = tuple(str(p) for p in raw)
        # sorted, a path comes right before the paths equal to it or inside it: neighbours tell every clash
        ordered = sorted(paths.items(), key=lambda item: item[1])
        for (outer, path), (key, inner) in itertools.pairwise(ordered):
            if inner[: len(path)] == path:
                where = "/".join(path)
                if inner == path:
                    raise self.fail(
                        key, f"and entry {outer!r} are both saved as {where}, so one would hide the other"
                    )
                raise self.fail(key, f"is saved inside {where}, which is entry {outer!r}")
        return paths


def _missing(path: Path) -> bool:
    """No file at ``path``, or a link to none (a link loop is not missing: :func:`regular_file` says why)."""
    try:
        path.stat()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False


def _cover_fault(chunks: list[Chunk], shape: tuple[int, ...]) -> tuple[Chunk, Chunk] | list[int] | None:
    """None when ``chunks`` (each inside ``shape``) cover it exactly once; else two that overlap, or
    a value none covers. Linear in the chunks (times 2^ndim), whatever their layout: no two chunks
    are compared. Each marks its corners +1 or -1 (the difference of its indicator, whose running
    sums count the chunks holding each value), so they cover the shape exactly once if and only if
    their marks add up to the shape's; else a value next to a wrong corner is held by none or two.
    """
    signs = [(-1) ** sum(corner) for corner in itertools.product((0, 1), repeat=len(shape))]
    marks: dict[tuple[int, ...], int] = {}
    for weight, offsets, sizes in [(1, c.offsets, c.sizes) for c in chunks] + [
        (-1, (0,) * len(shape), shape)
    ]:
        ends = [(o, o + s) for o, s in zip(offsets, sizes, strict=True)]
        for vertex, sign in zip(itertools.product(*ends), signs, strict=True) if all(sizes) else ():
            marks[vertex] = marks.get(vertex, 0) + weight * sign
    wrong = next((vertex for vertex, count in marks.items() if count), None)
    if wrong is None:
        return None
    for corner in itertools.product((0, 1), repeat=len(shape)):
        point = [v - c for v, c in zip(wrong, corner, strict=True)]
        if not all(0 <= p < d for p, d in zip(point, shape, strict=True)):
            continue
        inside = [
            all(o <= p < o + s for o, s, p in zip(c.offsets, c.sizes, point, strict=True)) for c in chunks
        ]
        holding = [c for c, held in zip(chunks, inside, strict=True) if held]
        if len(holding) > 1:
            return holding[0], holding[1]
        if not holding:
            return point
    raise AssertionError(f"corner {wrong} marks a fault that no value next to it shows")


def _some(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:3])
    return f"{len(keys)} entries: {shown}{', ...' * (len(keys) > 3)}" if len(keys) > 1 else shown
