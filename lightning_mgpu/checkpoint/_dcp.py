"""Checkpoint folders written by ``torch.distributed.checkpoint``, read one tensor at a time.

Lightning's ``ModelParallelStrategy`` and FSDP strategies save a sharded checkpoint as a folder::

    last.ckpt/.metadata        torch's index: every entry's shape, dtype and chunks, and where each chunk lies
    last.ckpt/__0_0.distcp     the chunks rank 0 wrote, each a ``torch.save``'d tensor at an offset
    last.ckpt/__1_0.distcp     ... one file (or more) per rank
    last.ckpt/meta.pt          Lightning's other entries (epoch, global_step, loops, hyperparameters)

- The entries keep the save's nesting: the Trainer saves ``{"state_dict": ..., "optimizer_0": ...}``,
  Fabric the user's names (``{"model": ..., "optimizer": ...}``); :attr:`ShardedFolder.entries` has
  that shape, with ``meta.pt``'s entries beside them, so a folder is told apart like a ``.ckpt``.
- Tensors stand in as meta tensors (shape and dtype, no memory), saved objects a module keeps as
  ``_extra_state`` as :class:`Stored`. :meth:`ShardedFolder.copy_to` reads a tensor when the
  safetensors writer reaches it: its chunks, from every rank's file, are assembled into the full
  tensor, written, and dropped, so memory holds about one tensor, whatever the model's size. torch's
  own ``dcp_to_torch_save`` loads the whole folder, optimizer state included, first.
- No process group and no GPU: chunks are read to the CPU, never unpickled beyond ``weights_only``.
- Nothing the folder holds is trusted: the index is read into memory (a length it claims can only
  come up short), unpickled with only the classes torch writes there (:func:`read_index`; torch's own
  reader runs a bare ``pickle.load``) and checked before anything is read or allocated
  (``_dcp_plan``), each chunk's archive before its values are read (``_dcp_chunk``), and every archive
  an export or a load reads against its CRC-32 (``_zip_check``); an error names the file and the entry.
"""

from __future__ import annotations

import functools
import io
import logging
import math
import pathlib
import pickle
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch
from torch import nn

from lightning_mgpu.checkpoint._dcp_chunk import Layout, chunk_layout, read_chunk, signals_held
from lightning_mgpu.checkpoint._dcp_plan import METADATA, Chunk, Index, Record, check_index, regular_file
from lightning_mgpu.checkpoint._io import ReadError, read_file
from lightning_mgpu.checkpoint._report import reason
from lightning_mgpu.checkpoint._zip_check import Archive, ArchiveCheck, Window

__all__ = ["FORMAT", "ShardedFolder", "Stored"]

log = logging.getLogger(__name__)

FORMAT = "torch.distributed.checkpoint"
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
        # Python 3.13 pickles the path classes as pathlib._local's; the same classes are in pathlib anywhere
        if module in ("pathlib", "pathlib._local") and name in _PATHS:
            return getattr(pathlib, name)
        if (module, name) in _allowed_globals():
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a torch.distributed.checkpoint index")


# the paths StorageMeta records
_PATHS = frozenset({"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"})


@functools.cache
def _allowed_globals() -> frozenset[tuple[str, str]]:
    from torch.distributed.checkpoint import metadata

    records = [(metadata.__name__, name) for name in (*metadata.__all__, "_MEM_FORMAT_ENCODING")]
    dtypes = [("torch", name) for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)]
    return frozenset(
        {
            *records,
            *dtypes,
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            ("torch", "Size"),
            ("torch.serialization", "_get_layout"),
            ("collections", "OrderedDict"),
        }
    )


def read_index(folder: Path, *, trust_pickle: bool = False) -> Index:
    """Read and check ``folder/.metadata`` and the files it names, without running or trusting it.

    Raises:
        FileNotFoundError: ``.metadata`` or a shard file is missing; the message names it.
        IsADirectoryError: the folder holds neither ``.metadata`` nor a shard file.
        ValueError: the index is truncated, corrupt or crafted, or a file it names is too short or
            not a regular file; the message names the file and the entry.
    """
    index = folder / METADATA
    shards = sorted(p.name for p in folder.glob("*.distcp"))
    if not index.exists():
        if not shards:
            raise IsADirectoryError(
                f"{folder} is a folder, not a checkpoint: it holds no {METADATA} and no .distcp "
                "shard files, so torch.distributed.checkpoint did not write it; pass a checkpoint file, "
                "or the folder a sharded save wrote"
            )
        raise FileNotFoundError(
            f"{folder} is an incomplete torch.distributed.checkpoint folder: {METADATA} is "
            f"missing (it is written last, after the shards {', '.join(shards[:4])}"
            f"{', ...' * (len(shards) > 4)}), so the save did not finish; use another checkpoint"
        )
    regular_file(index)
    try:
        data = index.read_bytes()  # from memory: a length the file claims can only come up short
    except MemoryError:
        raise ValueError(
            f"{index} is {index.stat().st_size:,} bytes, more than this machine can hold: it is no index "
            "torch wrote for a checkpoint this machine could export"
        ) from None
    try:
        stream = io.BytesIO(data)
        loaded = pickle.load(stream) if trust_pickle else _MetadataUnpickler(stream).load()
    except pickle.UnpicklingError as err:
        if "is not part of" in str(err):
            raise ValueError(
                f"{index} refers to {str(err).split(' is not')[0]}, which a torch.distributed.checkpoint "
                "index never holds; unpickling it could run code from the file, so it was refused. "
                "If you trust where the folder came from, pass trust_pickle=True "
                "(command line: --trust-pickle)."
            ) from None
        raise ValueError(f"{index} is truncated or corrupt: {err}") from None
    except Exception as err:  # a crafted pickle fails in as many ways as the classes it may call
        raise ValueError(f"{index} is truncated or corrupt: {str(err) or type(err).__name__}") from None
    return check_index(folder, loaded)


@dataclass(frozen=True)
class Stored:
    """A Python object the folder saved (a module's ``_extra_state``), read only when exported or loaded."""

    key: str


class ShardedFolder:
    """A ``torch.distributed.checkpoint`` folder: its entries as placeholders, each read when written.

    Args:
        path: The folder (Lightning names it like a file: ``epoch=3-step=100.ckpt``).
        trust_pickle: Unpickle ``.metadata``, ``meta.pt`` and saved objects with plain pickle, as torch
            itself does. Only for folders you trust.

    Raises:
        IsADirectoryError: the folder holds no ``.metadata`` and no shard file: it is no checkpoint.
        FileNotFoundError: ``.metadata`` or a shard file is missing; the message names it.
        ValueError: ``.metadata`` or a shard is truncated, corrupt or crafted; the message names the
            file and the entry.
    """

    def __init__(self, path: Path, *, trust_pickle: bool = False) -> None:
        self.path = path
        self._trust_pickle = trust_pickle
        self._index = read_index(path, trust_pickle=trust_pickle)
        self._files: dict[str, BinaryIO] = {}
        self._keys: dict[int, str] = {}  # a placeholder's byte offset in the base -> its entry
        self._layouts: dict[tuple[str, tuple[int, ...]], Layout] = {}
        self._buffer = torch.empty(0, dtype=torch.uint8)  # the memory copy_to reads every tensor into
        self.entries: dict[str, Any] = self._build_entries()

    @property
    def size(self) -> int:
        """Bytes in the folder's files."""
        return sum(p.stat().st_size for p in self.path.iterdir() if p.is_file())

    def describe(self) -> str:
        """``"saved by 2 ranks in 2 shard files"``."""
        files = self._index.files
        ranks = {name.split("_")[2] for name in files if name.startswith("__") and name.count("_") >= 3}
        n = len(ranks) or len(files)
        return f"saved by {n} rank{'s' * (n != 1)} in {len(files)} shard file{'s' * (len(files) != 1)}"

    def _build_entries(self) -> dict[str, Any]:
        tensors = self._index.tensors
        total = sum(_slot(math.prod(t.shape)) for t in tensors.values())
        self._base = torch.empty(_SLOT + total, dtype=torch.uint8, device="meta")
        entries: dict[str, Any] = {}
        start = _SLOT  # not 0, where every fresh meta tensor points
        for key, path in self._index.paths.items():
            value: Any = None  # saved objects (an optimizer's param_groups) are only listed
            if key in tensors:
                value = self._placeholder(start, tensors[key].dtype, tensors[key].shape)
                self._keys[start] = key
                start += _slot(math.prod(tensors[key].shape))
            elif path[-1].endswith("_extra_state"):
                value = Stored(key)
            node = entries
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = value
        meta = self.path / _LIGHTNING_META
        if meta.is_symlink():
            regular_file(meta)  # within the folder
        if meta.is_file():
            extra = read_file(meta, trust_pickle=self._trust_pickle).obj
            if isinstance(extra, Mapping):
                entries.update((k, v) for k, v in extra.items() if k not in entries)
        log.debug("%s: %d tensors, top-level entries %s", self.path, len(tensors), list(entries))
        return entries

    def _placeholder(self, start: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        size = math.prod(shape) * dtype.itemsize
        return self._base[start : start + size].view(dtype).view(shape)

    def _key(self, value: Any) -> str | None:
        """The entry ``value`` stands for, if it is one of this folder's placeholders."""
        if not isinstance(value, torch.Tensor) or value.device.type != "meta":
            return None
        if value.untyped_storage().nbytes() != self._base.untyped_storage().nbytes():
            return None
        return self._keys.get(_offset(value))

    def prepare(
        self, state_dict: OrderedDict[str, Any], dtype: torch.dtype | None, *, stream: bool
    ) -> OrderedDict[str, Any]:
        """The state_dict to write: placeholders cast to ``dtype`` if ``stream``, else every tensor read.

        A streamed placeholder keeps its slot, so :meth:`copy_to` still knows what it stands for;
        saved objects are read. Tensors read are left in their dtype, for the caller to cast.
        """
        out: OrderedDict[str, Any] = OrderedDict()
        for name, value in state_dict.items():
            key = self._key(value)
            if key is not None and stream:
                cast = dtype if dtype is not None and value.is_floating_point() else value.dtype
                value = self._placeholder(_offset(value), cast, tuple(value.shape))
            elif key is not None:
                value = self._assemble(key)
            elif isinstance(value, Stored):
                value = self._read_object(value.key)
            out[name] = value
        return out

    def record_check(self, state_dict: Mapping[str, Any]) -> ArchiveCheck:
        """The CRC-32 check of every archive that reading the placeholders of ``state_dict`` reads."""
        archives = []
        for value in state_dict.values():
            key = self._key(value)
            for chunk in self._index.tensors[key].chunks if key is not None else ():
                record = chunk.record
                holds = f"{key!r}, chunk at {list(chunk.offsets)}"
                archives.append(Archive(self.path / record.file, record.offset, record.length, holds))
        return ArchiveCheck(archives)

    def _assemble(self, key: str, *, reuse: bool = False) -> torch.Tensor:
        """The tensor of entry ``key``, its values read from every chunk.

        Every chunk's archive is checked before the tensor is allocated, so it is never larger than
        the values the folder holds for it; the chunks cover it exactly once (``_dcp_plan``).
        ``reuse``: in the memory of the tensor read before (grown when too small), valid until the
        next read; writing one tensor after another then takes no new memory each time.
        """
        entry = self._index.tensors[key]
        chunks = [(c, self._layout(key, c)) for c in entry.chunks if math.prod(c.sizes)]
        if not reuse:
            tensor = torch.empty(entry.shape, dtype=entry.dtype)
        else:
            nbytes = math.prod(entry.shape) * entry.dtype.itemsize
            if self._buffer.numel() < nbytes:
                self._buffer = torch.empty(0, dtype=torch.uint8)  # the old one goes first
                self._buffer = torch.empty(nbytes, dtype=torch.uint8)
            tensor = self._buffer[:nbytes].view(entry.dtype).view(entry.shape)
        for chunk, layout in chunks:
            part = tensor[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))]
            read_chunk(self._file(chunk.record), self.path / chunk.record.file, layout, into=part)
        return tensor

    def _layout(self, key: str, chunk: Chunk) -> Layout:
        """The chunk's checked layout, read once (a few small records) and kept until :meth:`close`."""
        if (key, chunk.offsets) not in self._layouts:
            path, dtype = self.path / chunk.record.file, self._index.tensors[key].dtype
            layout = chunk_layout(self._file(chunk.record), path, key, chunk, dtype)
            self._layouts[key, chunk.offsets] = layout
        return self._layouts[key, chunk.offsets]

    def _file(self, record: Record) -> BinaryIO:
        if record.file not in self._files:  # a plain name of the folder, no link out of it (_dcp_plan)
            try:
                self._files[record.file] = open(self.path / record.file, "rb", buffering=0)  # noqa: SIM115
            except OSError as err:
                raise ReadError.of(self.path / record.file, err) from None
        return self._files[record.file]

    def _read_object(self, key: str) -> Any:
        record = self._index.objects[key]
        window = cast(BinaryIO, Window(self._file(record), record.offset, record.length))
        where = (
            f"{self.path / record.file}: {key!r} (bytes {record.offset:,}-{record.offset + record.length:,})"
        )
        try:
            with signals_held():
                return torch.load(window, weights_only=not self._trust_pickle)
        except pickle.UnpicklingError as err:
            raise ValueError(
                f"{where} holds Python objects that safe loading refused ({err}); if you "
                "trust the folder, pass trust_pickle=True (command line: --trust-pickle)"
            ) from None
        except Exception as err:  # torch reports a damaged archive in many ways
            raise ValueError(f"{where} is corrupt: it does not load ({reason(err)})") from None

    def copy_to(self, tensor: torch.Tensor, file: BinaryIO) -> int:
        """Write the tensor a placeholder stands for into ``file``; the bytes written, 0 if not ours."""
        key = self._key(tensor)
        if key is None:
            return 0
        data = self._assemble(key, reuse=True).to(tensor.dtype).reshape(-1).view(torch.uint8)
        file.write(data.numpy().data)
        return data.numel()

    def load_into(self, model: nn.Module, state_dict: Mapping[str, Any]) -> None:
        """``model.load_state_dict(state_dict, strict=False)``, all or nothing, one tensor read at a time.

        Every archive the load reads is checked first (its layout, and its CRC-32), and saved
        objects are read, so the model changes only once nothing in the folder can be found wrong;
        only the disk failing, or a file changing, while the tensors are read could stop it halfway.
        """
        try:
            objects = {}
            for name, value in state_dict.items():
                key = self._key(value)
                if key is not None:
                    for chunk in self._index.tensors[key].chunks:
                        self._layout(key, chunk)
                if isinstance(value, Stored):
                    objects[name] = self._read_object(value.key)
            self.record_check(state_dict).verify()
            for name, value in state_dict.items():
                key = self._key(value)
                tensor = self._assemble(key) if key is not None else objects.get(name, value)
                model.load_state_dict({name: tensor}, strict=False)
        finally:
            self.close()

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()
        self._layouts.clear()
        self._buffer = torch.empty(0, dtype=torch.uint8)


def _offset(tensor: torch.Tensor) -> int:
    """Where a placeholder starts in the base (its data_ptr, which an empty tensor reports as 0)."""
    return int(tensor.storage_offset()) * tensor.element_size()


def _slot(numel: int) -> int:
    return max(numel, 1) * _SLOT
