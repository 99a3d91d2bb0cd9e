"""Damaged and crafted copies of a real sharded checkpoint folder, and what reading each must give.

Each :class:`Variant` damages a copy of the folder a 2-rank run saved (``fsdp_run``): its index
(``.metadata``, unpickled with torch's own reader, changed, pickled again), its shard files' bytes,
or the files themselves. ``damage`` returns the entry the error must name, if any.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import shutil
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex

from tests.checkpoint._sharded import Touch

INDEX = ".metadata"
BIAS = "state_dict.model.0.bias"  # [16]: chunk [0] in __0_0.distcp, chunk [8] in __1_0.distcp
WEIGHT = "state_dict.model.0.weight"  # [16, 8]: chunks [0, 0] and [8, 0]
SECRET = "secret.distcp"  # outside every folder: a copy of __1_0.distcp, so reading it would "work"


@dataclass(frozen=True)
class Variant:
    """A damaged folder: how to damage it, the file the error names, whether inspect still works.

    ``refused=False`` marks a control: damage that reading the weights never meets, or a layout
    the reader accepts (a shard linked from elsewhere), whose export must equal the saved weights.
    """

    name: str
    damage: Callable[[Path], str | None]
    file: str
    inspect_ok: bool = False
    refused: bool = True


def read_index(folder: Path) -> Metadata:
    with open(folder / INDEX, "rb") as f:
        return pickle.load(f)  # our own folder: torch's own reader, FileSystemReader.read_metadata, does this


def write_index(folder: Path, metadata: Any) -> None:
    (folder / INDEX).write_bytes(pickle.dumps(metadata))


def storage_key(metadata: Metadata, fqn: str, offsets: tuple[int, ...] | None) -> MetadataIndex:
    return next(
        k
        for k in metadata.storage_data
        if k.fqn == fqn and (k.offset is None if offsets is None else tuple(k.offset or ()) == offsets)
    )


def edit(change: Callable[[Metadata], Any], entry: str | None = BIAS) -> Callable[[Path], str | None]:
    """Change the index in place; the error must name ``entry``."""

    def damage(folder: Path) -> str | None:
        metadata = read_index(folder)
        change(metadata)
        write_index(folder, metadata)
        return entry

    return damage


def replace_index(make: Callable[[Metadata], Any]) -> Callable[[Path], str | None]:
    """Pickle ``make(index)`` as the index instead."""

    def damage(folder: Path) -> str | None:
        write_index(folder, make(read_index(folder)))
        return None

    return damage


def record(fqn: str = BIAS, offsets: tuple[int, ...] = (8,), **changes: Any) -> Callable[[Path], str | None]:
    """Change the storage record of one chunk (``relative_path``, ``offset``, ``length``, ...)."""

    def change(metadata: Metadata) -> None:
        key = storage_key(metadata, fqn, offsets)
        metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], **changes)

    return edit(change, fqn)


def same_record(fqn: str, offsets: tuple[int, ...], like: tuple[str, tuple[int, ...]]) -> Callable:
    def change(metadata: Metadata) -> None:
        metadata.storage_data[storage_key(metadata, fqn, offsets)] = metadata.storage_data[
            storage_key(metadata, *like)
        ]

    return edit(change, fqn)


def chunk(fqn: str, index: int, offsets: Any = None, sizes: Any = None, rekey: bool = True) -> Callable:
    """Move or resize chunk ``index`` of ``fqn``; ``rekey`` moves its storage record along."""

    def change(metadata: Metadata) -> None:
        old = metadata.state_dict_metadata[fqn].chunks[index]
        new = ChunkStorageMetadata(old.offsets, old.sizes)
        object.__setattr__(new, "offsets", old.offsets if offsets is None else offsets)
        object.__setattr__(new, "sizes", old.sizes if sizes is None else sizes)
        metadata.state_dict_metadata[fqn].chunks[index] = new
        if rekey and offsets is not None:
            key = storage_key(metadata, fqn, tuple(old.offsets))
            moved = MetadataIndex(fqn)
            object.__setattr__(moved, "offset", offsets)
            metadata.storage_data[moved] = metadata.storage_data.pop(key)

    return edit(change, fqn)


def tensor(fqn: str = WEIGHT, **changes: Any) -> Callable:
    """Change a tensor entry's ``dtype``, ``size``, ``chunks`` or ``properties``."""

    def change(metadata: Metadata) -> None:
        entry = metadata.state_dict_metadata[fqn]
        for name, value in changes.items():
            target = entry.properties if name == "dtype" else entry
            object.__setattr__(target, name, value)

    return edit(change, fqn)


def planner(fqn: str, path: Any) -> Callable:
    def change(metadata: Metadata) -> None:
        metadata.planner_data[fqn] = path

    return edit(change, fqn)


def where(folder: Path, fqn: str, offsets: tuple[int, ...]) -> tuple[Path, int, int]:
    info = read_index(folder).storage_data[storage_key(read_index(folder), fqn, offsets)]
    return folder / info.relative_path, info.offset, info.length


def flip(fqn: str, offsets: tuple[int, ...], member: str, at: float = 0.5) -> Callable:
    """Flip one bit of a chunk's archive: in its record ``member`` (``data/0``, ``data.pkl``), or
    at a fraction of the archive itself (``member=""``: ``at=0.97`` lands in its directory)."""

    def damage(folder: Path) -> str | None:
        path, start, length = where(folder, fqn, offsets)
        data = bytearray(path.read_bytes())
        position = start + int(length * at)
        if member:
            with zipfile.ZipFile(io.BytesIO(bytes(data[start : start + length]))) as archive:
                info = next(i for i in archive.infolist() if i.filename.endswith("/" + member))
            header = start + info.header_offset
            name, extra = (int.from_bytes(data[header + n : header + n + 2], "little") for n in (26, 28))
            position = header + 30 + name + extra + int(info.file_size * at)
        data[position] ^= 0x10
        path.write_bytes(bytes(data))
        return fqn

    return damage


def appended(fqn: str, offsets: tuple[int, ...], value: Any, **index: Any) -> Callable:
    """Append ``torch.save(value)`` to the chunk's shard file and point the chunk there; ``index``
    changes the tensor entry too (``size=``, ``chunks=``)."""

    def damage(folder: Path) -> str | None:
        path, _, _ = where(folder, fqn, offsets)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        start = path.stat().st_size
        with open(path, "ab") as f:
            f.write(buffer.getvalue())
        metadata = read_index(folder)
        key = storage_key(metadata, fqn, offsets)
        metadata.storage_data[key] = dataclasses.replace(
            metadata.storage_data[key], offset=start, length=len(buffer.getvalue())
        )
        for name, new in index.items():
            object.__setattr__(metadata.state_dict_metadata[fqn], name, new)
        write_index(folder, metadata)
        return fqn

    return damage


def files(change: Callable[[Path], Any], entry: str | None = None) -> Callable[[Path], str | None]:
    def damage(folder: Path) -> str | None:
        change(folder)
        return entry

    return damage


def raw_index(data: bytes) -> Callable[[Path], str | None]:
    return files(lambda folder: (folder / INDEX).write_bytes(data))


def replace_with(name: str, make: Callable[[Path], Any]) -> Callable[[Path], str | None]:
    def change(folder: Path) -> None:
        (folder / name).unlink()
        make(folder / name)

    return files(change)


def truncate(name: str, keep: Callable[[int], int]) -> Callable[[Path], str | None]:
    def change(folder: Path) -> str | None:
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: keep(len(data))])
        return None

    return files(change)


def marker_of(folder: Path) -> Path:
    """Where a payload in ``folder`` would leave its mark: beside the variants."""
    return folder.parent.parent / f"ran-{folder.name}"


def payload_chunk(folder: Path) -> str | None:
    return appended(WEIGHT, (0, 0), {"x": Touch(marker_of(folder))})(folder)


def transposed(folder: Path) -> str | None:
    # the same values, saved with the strides of a transposed tensor: dense, so read as they are
    path, start, length = where(folder, WEIGHT, (8, 0))
    with open(path, "rb") as f:
        f.seek(start)
        values = torch.load(io.BytesIO(f.read(length)), weights_only=True)
    return appended(WEIGHT, (8, 0), values.t().contiguous().t())(folder)


def linked_from_outside(name: str) -> Callable[[Path], str | None]:
    """``name`` moved out of the folder, and a link to it left in its place: reading it would "work"."""

    def change(folder: Path) -> None:
        target = outside(folder) / f"{folder.name}-{name}"
        (folder / name).rename(target)
        (folder / name).symlink_to(target)

    return files(change)


def outside(folder: Path) -> Path:
    """The folder beside the variants' (``root/outside``), holding :data:`SECRET`."""
    return folder.parent.parent / "outside"


def build(source: Path, root: Path, variants: list[Variant]) -> dict[str, tuple[Path, str | None]]:
    """Each variant as its own damaged copy of ``source``, ``root/variants/NAME``: name -> (folder,
    the entry its error must name)."""
    (root / "outside").mkdir()
    shutil.copyfile(source / "__1_0.distcp", root / "outside" / SECRET)
    built = {}
    for variant in variants:
        folder = Path(shutil.copytree(source, root / "variants" / variant.name))
        built[variant.name] = folder, variant.damage(folder)
    return built
