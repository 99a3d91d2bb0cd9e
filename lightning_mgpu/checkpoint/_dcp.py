"""Checkpoint folders written by ``torch.distributed.checkpoint``, read one tensor at a time.

Lightning's ``ModelParallelStrategy`` and FSDP strategies save a sharded checkpoint as a folder::

    last.ckpt/.metadata        torch's index: every entry's shape, dtype and chunks, and where each chunk lies
    last.ckpt/__0_0.distcp     the chunks rank 0 wrote, each a ``torch.save``'d tensor at an offset
    last.ckpt/__1_0.distcp     ... one file (or more) per rank
    last.ckpt/meta.pt          Lightning's other entries (epoch, global_step, loops, hyperparameters)

- The entries keep the save's nesting: the Trainer saves ``{"state_dict": ..., "optimizer_0": ...}``,
  Fabric the user's names (``{"model": ..., "optimizer": ...}``); :attr:`ShardedFolder.entries` has
  that shape, with ``meta.pt``'s entries beside them, so a folder is told apart like a ``.ckpt``.
- Tensors stand in as meta tensors (shape and dtype, no memory). :meth:`ShardedFolder.copy_to` reads
  one when the safetensors writer reaches it: its chunks, from every rank's file, are assembled into
  the full tensor, written, and dropped, so memory holds about one tensor, whatever the model's size.
  torch's own ``dcp_to_torch_save`` loads the whole folder, optimizer state included, first.
- No process group and no GPU: chunks are read with ``torch.load(weights_only=True)``, to the CPU.
- Everything is checked before anything is written: ``.metadata`` present and readable, every shard
  file present and long enough; the error names what is missing.
"""

from __future__ import annotations

import io
import logging
import math
import pickle
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, BinaryIO, cast

import torch
from torch import nn

from lightning_mgpu.checkpoint._io import read_file

__all__ = ["FORMAT", "ShardedFolder"]

log = logging.getLogger(__name__)

FORMAT = "torch.distributed.checkpoint"
_METADATA = ".metadata"  # torch.distributed.checkpoint.filesystem's name for it
_LIGHTNING_META = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME
# placeholders sit in one meta "storage", each at its own offset, so no two look like tied weights;
# each slot fits its values at the widest element size, so a cast keeps the slot (and its identity)
_SLOT = 16


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles ``.metadata`` and nothing else: only the classes torch writes there are found.

    torch reads this file with a bare ``pickle.load`` (``FileSystemReader.read_metadata``), which
    would run any code a crafted file names, and torch's weights-only unpickler cannot read it (it
    is pickled with protocol 4, whose framing that unpickler refuses). So this is pickle's own
    "restricting globals" recipe: torch's metadata records, ``torch.Size``, dtypes and layouts, and
    the paths ``StorageMeta`` records; any other name is refused before it is imported.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _allowed_globals():
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a torch.distributed.checkpoint index")


def _allowed_globals() -> set[tuple[str, str]]:
    from torch.distributed.checkpoint import metadata

    records = [(metadata.__name__, name) for name in (*metadata.__all__, "_MEM_FORMAT_ENCODING")]
    dtypes = [("torch", name) for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)]
    paths = [
        ("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
    ]
    return {
        *records,
        *dtypes,
        *paths,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
    }


class _Window(io.RawIOBase):
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


class ShardedFolder:
    """A ``torch.distributed.checkpoint`` folder: its entries as placeholders, each read when written.

    Args:
        path: The folder (Lightning names it like a file: ``epoch=3-step=100.ckpt``).
        trust_pickle: Unpickle ``.metadata``, ``meta.pt`` and saved objects with plain pickle, as torch
            itself does. Only for folders you trust.

    Raises:
        IsADirectoryError: the folder holds no ``.metadata`` and no shard file: it is no checkpoint.
        FileNotFoundError: ``.metadata`` or a shard file is missing; the message names it.
        ValueError: ``.metadata`` or a shard is truncated or corrupt, or names what is no index.
    """

    def __init__(self, path: Path, *, trust_pickle: bool = False) -> None:
        self.path = path
        self._trust_pickle = trust_pickle
        self._metadata = self._read_metadata()
        self._check_shards()
        self._files: dict[str, BinaryIO] = {}
        self._keys: dict[int, str] = {}  # a placeholder's data_ptr -> the entry it stands for
        self.entries: dict[str, Any] = self._build_entries()

    @property
    def size(self) -> int:
        """Bytes in the folder's files."""
        return sum(p.stat().st_size for p in self.path.iterdir() if p.is_file())

    def describe(self) -> str:
        """``"saved by 2 ranks in 2 shard files"``."""
        files = sorted({info.relative_path for info in self._metadata.storage_data.values()})
        ranks = {name.split("_")[2] for name in files if name.startswith("__") and name.count("_") >= 3}
        n = len(ranks) or len(files)
        return f"saved by {n} rank{'s' * (n != 1)} in {len(files)} shard file{'s' * (len(files) != 1)}"

    def _read_metadata(self) -> Any:
        index = self.path / _METADATA
        shards = sorted(p.name for p in self.path.glob("*.distcp"))
        if not index.is_file():
            if not shards:
                raise IsADirectoryError(
                    f"{self.path} is a folder, not a checkpoint: it holds no {_METADATA} and no .distcp "
                    "shard files, so torch.distributed.checkpoint did not write it; pass a checkpoint file, "
                    "or the folder a sharded save wrote"
                )
            raise FileNotFoundError(
                f"{self.path} is an incomplete torch.distributed.checkpoint folder: {_METADATA} is "
                f"missing (it is written last, after the shards {', '.join(shards[:4])}"
                f"{', ...' * (len(shards) > 4)}), so the save did not finish; use another checkpoint"
            )
        try:
            with open(index, "rb") as f:
                loaded = pickle.load(f) if self._trust_pickle else _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as err:
            if "is not part of" in str(err):
                raise ValueError(
                    f"{index} refers to {str(err).split(' is not')[0]}, which a torch.distributed.checkpoint "
                    "index never holds; unpickling it could run code from the file, so it was refused. "
                    "If you trust where the folder came from, pass trust_pickle=True "
                    "(command line: --trust-pickle)."
                ) from None
            raise ValueError(f"{index} is truncated or corrupt: {err}") from None
        except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError, ImportError) as err:
            raise ValueError(f"{index} is truncated or corrupt: {err or type(err).__name__}") from None
        if not all(hasattr(loaded, a) for a in ("state_dict_metadata", "storage_data")):
            what = type(loaded).__name__
            raise ValueError(f"{index} is corrupt: it holds a {what}, not a checkpoint index")
        return loaded

    def _check_shards(self) -> None:
        needed: dict[str, int] = {}
        holds: dict[str, list[str]] = {}
        for where, info in self._metadata.storage_data.items():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
            holds.setdefault(info.relative_path, []).append(where.fqn)
        missing = [name for name in sorted(needed) if not (self.path / name).is_file()]
        if missing:
            what = "; ".join(f"{name} (holds {_some(holds[name])})" for name in missing)
            raise FileNotFoundError(
                f"{self.path} is incomplete: {len(missing)} of its {len(needed)} shard files "
                f"{'is' if len(missing) == 1 else 'are'} missing: {what}. Copy the whole folder, every "
                "rank's files included."
            )
        for name, end in sorted(needed.items()):
            size = (self.path / name).stat().st_size
            if size < end:
                raise ValueError(
                    f"{self.path / name} is truncated: {size:,} bytes, but {_METADATA} places data up "
                    f"to byte {end:,}"
                )

    def _build_entries(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        planner: Mapping[str, Any] = getattr(self._metadata, "planner_data", None) or {}
        saved = self._metadata.state_dict_metadata
        tensors = {k: v for k, v in saved.items() if isinstance(v, TensorStorageMetadata)}
        total = sum(_slot(math.prod(v.size)) for v in tensors.values())
        self._base = torch.empty(_SLOT + total, dtype=torch.uint8, device="meta")
        entries: dict[str, Any] = {}
        start = _SLOT  # not 0, where every fresh meta tensor points
        for key, md in self._metadata.state_dict_metadata.items():
            value: Any = None  # saved objects (an optimizer's param_groups) are only listed
            if key in tensors:
                value = self._placeholder(start, md.properties.dtype, tuple(md.size))
                self._keys[start] = key
                start += _slot(math.prod(md.size))
            elif key.endswith("_extra_state"):
                value = self._read_object(key)
            path = planner.get(key, (key,))
            node = entries
            for part in path[:-1]:
                node = node.setdefault(str(part), {})
            node[str(path[-1])] = value
        if (self.path / _LIGHTNING_META).is_file():
            extra = read_file(self.path / _LIGHTNING_META, trust_pickle=self._trust_pickle).obj
            if isinstance(extra, Mapping):
                entries.update((k, v) for k, v in extra.items() if k not in entries)
        log.debug("%s: %d tensors, top-level entries %s", self.path, len(tensors), list(entries))
        return entries

    def _placeholder(self, start: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        return self._base[start : start + size].view(dtype).view(shape)

    def _key(self, tensor: torch.Tensor) -> str | None:
        ours = self._base.untyped_storage().nbytes()
        if tensor.device.type != "meta" or tensor.untyped_storage().nbytes() != ours:
            return None
        return self._keys.get(tensor.data_ptr())

    def prepare(
        self, state_dict: OrderedDict[str, Any], dtype: torch.dtype | None, *, stream: bool
    ) -> OrderedDict[str, Any]:
        """The state_dict to write: placeholders cast to ``dtype`` if ``stream``, else every tensor read.

        A streamed placeholder keeps its slot, so :meth:`copy_to` still knows what it stands for.
        """
        out: OrderedDict[str, Any] = OrderedDict()
        for name, value in state_dict.items():
            key = self._key(value) if isinstance(value, torch.Tensor) else None
            if key is not None and stream:
                cast = dtype if dtype is not None and value.is_floating_point() else value.dtype
                value = self._placeholder(value.data_ptr(), cast, tuple(value.shape))
            elif key is not None:
                value = self.read(value)
            if dtype is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
                value = value.to(dtype)
            out[name] = value
        return out

    def read(self, placeholder: torch.Tensor) -> torch.Tensor:
        """The full tensor a placeholder stands for, in the placeholder's dtype, on the CPU."""
        key = self._key(placeholder)
        if key is None:
            return placeholder
        md = self._metadata.state_dict_metadata[key]
        chunks = md.chunks
        whole = len(chunks) == 1 and tuple(chunks[0].sizes) == tuple(md.size)
        if whole:
            tensor = self._read_chunk(key, chunks[0])
        else:
            if sum(math.prod(c.sizes) for c in chunks) != math.prod(md.size):
                raise ValueError(f"{self.path / _METADATA} is corrupt: the chunks of {key!r} do not cover it")
            tensor = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            for chunk in chunks:
                part = tensor
                for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
                    part = part.narrow(dim, offset, size)
                part.copy_(self._read_chunk(key, chunk))
        return tensor.to(placeholder.dtype)

    def _read_chunk(self, key: str, chunk: Any) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self._metadata.storage_data[MetadataIndex(key, chunk.offsets)]
        window = self._window(info)
        try:
            tensor = torch.load(window, map_location="cpu", weights_only=True)
        except Exception as err:  # torch reports a damaged archive in many ways
            raise ValueError(
                f"{self.path / info.relative_path} is corrupt: {key!r} at bytes {info.offset:,}-"
                f"{info.offset + info.length:,} does not load ({str(err).strip().splitlines()[0]})"
            ) from None
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(chunk.sizes):
            raise ValueError(
                f"{self.path / info.relative_path} is corrupt: {key!r} at byte {info.offset:,} holds "
                f"{getattr(tensor, 'shape', type(tensor).__name__)}, {_METADATA} says {list(chunk.sizes)}"
            )
        return tensor

    def _window(self, info: Any) -> IO[bytes]:
        if getattr(info, "transform_descriptors", None):
            raise ValueError(
                f"{self.path} was saved with storage extensions ({', '.join(info.transform_descriptors)}), "
                "which this reader does not undo; load it with torch.distributed.checkpoint instead"
            )
        if info.relative_path not in self._files:
            self._files[info.relative_path] = open(self.path / info.relative_path, "rb", buffering=0)  # noqa: SIM115
        return cast(IO[bytes], _Window(self._files[info.relative_path], info.offset, info.length))

    def _read_object(self, key: str) -> Any:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self._metadata.storage_data[MetadataIndex(key)]
        try:
            return torch.load(self._window(info), weights_only=not self._trust_pickle)
        except pickle.UnpicklingError as err:
            raise ValueError(
                f"{self.path}: {key!r} holds Python objects that safe loading refused ({err}); if you "
                "trust the folder, pass trust_pickle=True (command line: --trust-pickle)"
            ) from None
        finally:
            self.close()

    def copy_to(self, tensor: torch.Tensor, file: BinaryIO) -> int:
        """Write the tensor a placeholder stands for into ``file``; the bytes written, 0 if not ours."""
        if self._key(tensor) is None:
            return 0
        data = self.read(tensor).reshape(-1).view(torch.uint8)
        file.write(data.numpy().data)
        return data.numel()

    def load_into(self, model: nn.Module, state_dict: Mapping[str, Any]) -> None:
        """``model.load_state_dict(state_dict, strict=False)``, reading one placeholder at a time."""
        try:
            for name, value in state_dict.items():
                if isinstance(value, torch.Tensor):
                    value = self.read(value)
                model.load_state_dict({name: value}, strict=False)
        finally:
            self.close()

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()


def _slot(numel: int) -> int:
    return max(numel, 1) * _SLOT


def _some(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:3])
    return f"{len(keys)} entries: {shown}{', ...' * (len(keys) > 3)}" if len(keys) > 1 else shown
