"""One chunk of a sharded checkpoint: a ``torch.save`` archive inside a shard file, checked, then read.

``torch.distributed.checkpoint`` writes each chunk with ``torch.save`` at some offset of a shard
file. :func:`chunk_layout` learns what the archive holds without reading its values, and refuses
anything but what torch writes there:

- the archive is read within its record's bytes only (:class:`~lightning_mgpu.checkpoint._zip_check.Window`);
- its pickle is read by ``torch.load(weights_only=True, map_location="meta")``, which gives dtype,
  shape, strides and storage size without the values: it must hold one dense tensor of the chunk's
  dtype and shape, whose storage is exactly its values (another dtype is refused, not cast; a view
  that repeats a few values by its strides is refused, not expanded);
- the values are one stored (not compressed) record of the archive, exactly as long as that storage.

:func:`read_chunk` then reads the values straight from the file into the tensor's memory, where
``zipfile`` would first return them as a ``bytes`` copy: one tensor in memory, not two, is how a
sharded export stays within 0.3x the folder's size (``benchmarks/export_sharded.py``). It is
hand-written because torch's own reader does worse at this: ``torch.distributed.checkpoint.load``
of one weight at a time (``no_dist=True``, into a tensor of its size) reads each chunk's archive
into memory, ``torch.load``s it, then copies it into place, and checks none of what is refused
here (a chunk of another dtype is cast, a view expanded). Side by side on a 768 MiB folder whose
largest tensor is 16 MiB, it grew the process by 52 MiB against 21 MiB here, in 2.2 s against
1.4 s.

Ctrl-C and SIGTERM arriving during ``torch.load`` take effect as it returns (:func:`signals_held`):
raised inside the Python reads that torch calls back into, torch would report them as a damaged
archive.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch

from lightning_mgpu.checkpoint._dcp_plan import METADATA, Chunk
from lightning_mgpu.checkpoint._io import ReadError
from lightning_mgpu.checkpoint._report import reason
from lightning_mgpu.checkpoint._zip_check import StoredRecord, Window, stored_records

__all__ = ["Layout", "chunk_layout", "read_chunk", "signals_held"]


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a chunk's values lie in its file (``start``, ``nbytes``) and how to view them."""

    start: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    swap: bool  # saved in the other byte order


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM arriving in the block take effect, as they would have, when it ends.

    Only in the main thread, where Python runs signal handlers; a signal that is ignored, or whose
    handler Python did not install, is left alone.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous: dict[signal.Signals, Any] = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(signum)
        if handler is not None and handler != signal.SIG_IGN:
            previous[signum] = handler
            signal.signal(signum, lambda number, frame: caught.append(number))
    try:
        yield
    finally:
        for held, handler in previous.items():
            signal.signal(held, handler)
        for number in caught:
            signal.raise_signal(number)


def _dense(tensor: torch.Tensor) -> bool:
    """Whether the strides lay the values out once each, in some order of the dimensions."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride(), strict=True), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def chunk_layout(file: BinaryIO, path: Path, key: str, chunk: Chunk, dtype: torch.dtype) -> Layout:
    """Check the archive of ``chunk`` (of entry ``key``, a tensor of ``dtype``) in ``file`` at ``path``.

    Raises:
        ValueError: the archive is damaged, or holds anything but the chunk's values; the message
            names the file, the entry and the chunk.
    """
    record = chunk.record
    end = record.offset + record.length
    where = f"{path} is corrupt: {key!r}, chunk at {list(chunk.offsets)} (bytes {record.offset:,}-{end:,}),"
    if record.transforms:
        raise ValueError(
            f"{path} holds {key!r} saved with storage extensions ({', '.join(record.transforms)}), "
            "which this reader does not undo; load the folder with torch.distributed.checkpoint instead"
        )
    try:
        members = stored_records(file, record.offset, record.length)
        with signals_held():
            window = cast(BinaryIO, Window(file, record.offset, record.length))
            meta = torch.load(window, map_location="meta", weights_only=True)
    except Exception as err:  # torch and zipfile report a damaged archive in many ways
        raise ValueError(f"{where} does not load ({reason(err)})") from None
    if not isinstance(meta, torch.Tensor) or meta.layout != torch.strided:
        what = f"a {meta.layout} tensor" if isinstance(meta, torch.Tensor) else f"a {type(meta).__name__}"
        raise ValueError(f"{where} holds {what}, not a tensor's values")
    if meta.dtype != dtype:
        raise ValueError(
            f"{where} holds {_name(meta.dtype)} values, but {METADATA} says {_name(dtype)}: the index "
            "and the data disagree, and neither is cast to the other"
        )
    if tuple(meta.shape) != chunk.sizes:
        raise ValueError(f"{where} holds shape {list(meta.shape)}, but {METADATA} says {list(chunk.sizes)}")
    nbytes = meta.numel() * meta.element_size()
    storage = meta.untyped_storage().nbytes()
    if meta.storage_offset() != 0 or storage != nbytes or not _dense(meta):
        raise ValueError(
            f"{where} holds a view with strides {list(meta.stride())} into {storage:,} bytes, not the "
            f"{nbytes:,} bytes of its values laid out once each; it is refused rather than expanded"
        )
    packed = [m.name for m in members if m.compressed is not None]
    if packed:  # torch.save never compresses; its values are read straight from the file
        raise ValueError(
            f"{where} holds compressed records ({', '.join(packed[:3])}), which torch.save never writes; "
            "load the folder with torch.distributed.checkpoint instead"
        )
    data = [m for m in members if m.name.rsplit("/", 2)[-2:-1] == ["data"]]
    if len(data) != 1 or data[0].size != nbytes or data[0].start + data[0].size > end:
        sizes = ", ".join(f"{m.size:,}" for m in data) or "none"
        raise ValueError(
            f"{where} holds value records of {sizes} bytes (stored within the archive), not one of the "
            f"{nbytes:,} bytes its tensor needs"
        )
    return Layout(
        data[0].start, nbytes, dtype, chunk.sizes, tuple(meta.stride()), _swapped(file, members, where)
    )


def _swapped(file: BinaryIO, members: list[StoredRecord], where: str) -> bool:
    """Whether the archive's ``byteorder`` record names the other byte order (none: this one)."""
    record = next((m for m in members if m.name.endswith("/byteorder")), None)
    if record is None:
        return False
    file.seek(record.start)
    order = file.read(min(record.size, 16))
    if order not in (b"little", b"big"):
        raise ValueError(f"{where} records the byte order {order!r}, neither little nor big")
    return order.decode() != sys.byteorder


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def read_chunk(file: BinaryIO, path: Path, layout: Layout, into: torch.Tensor) -> None:
    """Read the chunk's values from ``file`` (at ``path``) into ``into``.

    Raises:
        ValueError: the file ended before the values did (it changed since it was checked).
    """
    contiguous = torch.empty_strided(layout.shape, layout.stride, device="meta").is_contiguous()
    if into.is_contiguous() and contiguous and not layout.swap:
        _read_into(file, path, layout, into.reshape(-1).view(torch.uint8))
        return
    raw = torch.empty(layout.nbytes, dtype=torch.uint8)
    _read_into(file, path, layout, raw)
    if layout.swap:
        raw.untyped_storage().byteswap(layout.dtype)
    into.copy_(raw.view(layout.dtype).as_strided(layout.shape, layout.stride))


def _read_into(file: BinaryIO, path: Path, layout: Layout, buffer: torch.Tensor) -> None:
    view = memoryview(buffer.numpy().data).cast("B")
    done = 0
    while done < layout.nbytes:
        try:
            file.seek(layout.start + done)
            got = file.readinto(view[done:])  # type: ignore[attr-defined]
        except OSError as err:
            raise ReadError.of(path, err) from None
        if not got:
            raise ValueError(
                f"{path} ended at byte {layout.start + done:,}, within values it held when checked: "
                "it changed while being read"
            )
        done += got
