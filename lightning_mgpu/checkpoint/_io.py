"""Reading checkpoint files safely: what kind of file it is, weights-only unpickling, clear errors.

- A file is recognised by its first bytes, not its suffix: a torch zip archive (``torch.save``
  since 1.6), a legacy ``torch.save`` pickle, or safetensors.
- torch files are always unpickled with ``weights_only=True``, memory-mapped when the format allows,
  so a 10 GB checkpoint costs no memory until its tensors are read. The allowlist is widened only for
  what hyperparameters commonly hold, and only while loading: ``pathlib`` paths, and omegaconf
  containers, which Lightning stores when ``save_hyperparameters`` gets a ``DictConfig``.
- ``trust_pickle=True`` is the one way to unpickle anything else, and the refusal names it.
- A torch zip file comes with a check of its records' CRC-32 (``_zip_check``), which whoever
  reads the tensors runs: ``torch.load`` does not.
- A zip file whose records are compressed (``torch.save`` never compresses, a zip tool may) is
  not memory-mapped, which would take the compressed bytes for values. Before ``torch.load``
  inflates anything, a value record claiming to inflate to more than the largest tensor the file
  stores is refused (as an index claiming more than its file holds is), and every record's CRC-32
  is checked through ``zipfile``, which inflates 1 MiB at a time.
- :class:`MappedFile` copies a mapped tensor's bytes file-to-file, so an export of a 10 GB file
  holds about one tensor, not the file (``benchmarks/export.py``); :class:`ReadError` is what failing
  to read a source raises while an export writes: it names the source, so that only errors of
  writing are reported as the target's.
"""

from __future__ import annotations

import collections
import contextlib
import os
import pickle
import re
import struct
import sys
import types
import typing
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PosixPath, PurePosixPath, PureWindowsPath, WindowsPath
from typing import Any, BinaryIO

import torch

from lightning_mgpu._atomic import has_fileno
from lightning_mgpu._compat.torch import records_left_unread
from lightning_mgpu.checkpoint._report import reason
from lightning_mgpu.checkpoint._safetensors import read_safetensors
from lightning_mgpu.checkpoint._zip_check import Archive, ArchiveCheck

__all__ = ["LoadedFile", "MappedFile", "ReadError", "read_file"]

_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_PROTO = 0x80
_UNSAFE_GLOBAL = re.compile(r"GLOBAL (\S+) was not an allowed global")
_BLOCKED = re.compile(r"(\S+) whose module \S+ is blocked")


@dataclass
class LoadedFile:
    """What a checkpoint file holds and how it was read."""

    obj: Any
    format: str  # "torch zip", "torch legacy" or "safetensors"
    metadata: dict[str, str] = field(default_factory=dict)
    mapped: MappedFile | None = None
    check: ArchiveCheck | None = None  # a torch zip file's CRC-32 check, run by who reads the tensors


def read_file(
    path: str | os.PathLike[str], *, map_location: Any = "cpu", trust_pickle: bool = False
) -> LoadedFile:
    """Read a checkpoint file without running code from it (a sharded folder is ``_dcp``'s to read).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a checkpoint, truncated or corrupt, or it holds Python objects that only
            ``trust_pickle=True`` would unpickle.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such file: {path}")
    if path.stat().st_size == 0:
        raise ValueError(f"{path} is empty: it is truncated or was never written")
    with open(path, "rb") as f:
        head = f.read(16)
    if head.startswith(_ZIP_MAGIC):
        kind = "torch zip"
    elif head[8:9] == b"{":  # 8-byte header length, then the JSON header
        kind = "safetensors"
    elif head[:1] == bytes([_PICKLE_PROTO]):
        kind = "torch legacy"
    else:
        raise ValueError(
            f"{path} is not a checkpoint: expected a file written by torch.save (.pt, .pth, .ckpt) "
            f"or a .safetensors file, but it starts with {head!r}"
        )
    if kind == "safetensors":
        if map_location is None:  # torch.load's "where it was saved": safetensors keeps CPU tensors
            map_location = "cpu"
        if not isinstance(map_location, (str, torch.device)):
            raise ValueError(f"map_location for a safetensors file must be a device, got {map_location!r}")
        if torch.device(map_location).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"map_location={str(map_location)!r}, but CUDA is not available here")
        tensors, metadata = read_safetensors(path, device=str(map_location))
        return LoadedFile(tensors, kind, metadata, mapped=MappedFile(path, archive=False))
    compressed = _check_zip(path) if kind == "torch zip" else []
    if compressed:  # memory-mapped, the compressed bytes would be taken for the values
        with records_left_unread():
            skeleton = _torch_load(path, "meta", trust_pickle, mmap=False)
        _check_inflated_sizes(path, compressed, skeleton)
        ArchiveCheck([Archive(path)]).verify()
        return LoadedFile(_torch_load(path, map_location, trust_pickle, mmap=False), kind)
    obj = _torch_load(path, map_location, trust_pickle, mmap=kind == "torch zip")
    if kind != "torch zip":
        return LoadedFile(obj, kind)
    mapped = MappedFile(path)
    return LoadedFile(obj, kind, mapped=mapped, check=ArchiveCheck([Archive(path)], mapped))


def _check_zip(path: Path) -> list[zipfile.ZipInfo]:
    """The compressed records of the torch zip file at ``path``."""
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
    except zipfile.BadZipFile as err:
        raise ValueError(f"{path} is truncated or corrupt: {err}") from None
    if not any(info.filename.endswith("data.pkl") for info in infos):
        shown = ", ".join(info.filename for info in infos[:3]) + (", ..." if len(infos) > 3 else "")
        raise ValueError(f"{path} is a zip archive but not a torch checkpoint (it holds {shown})")
    return [info for info in infos if info.compress_type != zipfile.ZIP_STORED]


def _check_inflated_sizes(path: Path, compressed: list[zipfile.ZipInfo], skeleton: Any) -> None:
    """No ``compressed`` value record inflates to more than the largest tensor ``skeleton`` (the file
    loaded onto the meta device) stores: a claim beyond it is refused before anything inflates it."""
    largest, stack = 0, [skeleton]
    while stack:  # not recursive: a crafted file may nest deeper than Python's stack
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            largest = max(largest, value.untyped_storage().nbytes())
        elif isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    for info in compressed:
        if "/data/" in info.filename and info.file_size > largest:
            raise ValueError(
                f"{path} is corrupt or crafted: record {info.filename} claims to inflate "
                f"{info.compress_size:,} bytes to {info.file_size:,}, more than any tensor it stores "
                f"({largest:,} bytes), so it was not read; copy the file again from where it was written, "
                "or use another checkpoint"
            )


class _MissingClassError(Exception):
    """A class the file refers to cannot be imported here."""

    def __init__(self, module: str, name: str, reason: Exception) -> None:
        super().__init__(f"{module}.{name}")
        self.module, self.name, self.reason = module, name, reason


class _NamingUnpickler(pickle.Unpickler):
    """Names the class that cannot be found, where pickle's own error may not."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (AttributeError, ImportError) as err:
            raise _MissingClassError(module, name, err) from None


# what torch.load needs of a pickle_module: Unpickler to subclass, and load
_NAMING_PICKLE = types.SimpleNamespace(__name__="pickle", Unpickler=_NamingUnpickler, load=pickle.load)


def _torch_load(path: Path, map_location: Any, trust_pickle: bool, *, mmap: bool) -> Any:
    def load(mmap: bool) -> Any:
        if trust_pickle:
            return _load(path, map_location, mmap, weights_only=False, pickle_module=_NAMING_PICKLE)
        # importing omegaconf costs ~0.2 s: only when it is loaded already, or the file needs it
        imported = "omegaconf" in sys.modules
        try:
            with _hyperparameters_allowed(imported):
                return _load(path, map_location, mmap, weights_only=True)
        except pickle.UnpicklingError as err:
            if imported or "omegaconf" not in str(err):
                raise
        with _hyperparameters_allowed(True):
            return _load(path, map_location, mmap, weights_only=True)

    try:
        try:
            return load(mmap)
        except RuntimeError:
            if not mmap:
                raise
            # some older zip checkpoints cannot be memory-mapped; read those into memory instead
            return load(mmap=False)
    except _MissingClassError as err:
        raise ValueError(_missing_class_message(path, err)) from None
    except pickle.UnpicklingError as err:
        message = str(err)
        unsafe = _UNSAFE_GLOBAL.findall(message) + _BLOCKED.findall(message)
        if unsafe:
            unsafe = _all_unsafe_globals(path) or unsafe
            names = ", ".join(dict.fromkeys(unsafe))
            raise ValueError(
                f"{path} holds Python objects that are not plain weights ({names}); "
                "unpickling them could run code from the file, so safe loading refused. If you trust where "
                "the file came from, pass trust_pickle=True (command line: --trust-pickle)."
            ) from None
        raise ValueError(f"{path} is truncated or corrupt: {reason(err)}") from None
    except (RuntimeError, EOFError, ValueError, OSError, struct.error, IndexError) as err:
        if "TorchScript" in reason(err):
            raise ValueError(
                f"{path} is a TorchScript archive, not a checkpoint: use torch.jit.load"
            ) from None
        raise ValueError(f"{path} is truncated or corrupt: {reason(err)}") from None


def _load(path: Path, map_location: Any, mmap: bool, **options: Any) -> Any:
    """``torch.load``, whatever the file's name: it hands any path named ``*.safetensors`` to safetensors."""
    if not path.name.endswith(".safetensors"):
        return torch.load(path, map_location=map_location, mmap=mmap, **options)
    with open(path, "rb") as file:  # an open file cannot be memory-mapped
        return torch.load(file, map_location=map_location, **options)


def _missing_class_message(path: Path, err: _MissingClassError) -> str:
    qualified = f"{err.module}.{err.name}"
    if err.module == "__main__":
        return (
            f"{path} refers to {qualified}, a class defined in the script that saved it, which is not "
            f"importable here. In Python, define or import {err.name} in your own script (so that "
            f"{qualified} exists) before loading; the command line cannot, so load from Python, or save "
            "hyperparameters as plain values (dict, omegaconf) rather than classes of the script."
        )
    if isinstance(err.reason, ImportError):
        how = (
            f"make {err.module} importable (install it, or add its folder to PYTHONPATH), or in Python "
            "import the module that defines it before loading"
        )
    else:
        how = f"{err.module} has no {err.name} here: use the version of {err.module} that saved the file"
    return f"{path} refers to {qualified}, which cannot be imported here ({err.reason}); {how}."


def _all_unsafe_globals(path: Path) -> list[str]:
    """Every global the weights-only unpickler would refuse (torch only names the first one); none
    for a legacy file, which torch does not look into."""
    try:
        with _hyperparameters_allowed(True):
            return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # a best effort for the message only
        return []


def _omegaconf_types() -> list[Any]:
    """The globals an omegaconf ``DictConfig`` / ``ListConfig`` pickle refers to."""
    try:
        from omegaconf import DictConfig, ListConfig, base, nodes
    except ImportError:
        return []
    node_names = ("AnyNode", "StringNode", "IntegerNode", "FloatNode", "BooleanNode", "BytesNode", "PathNode")
    node_types = [getattr(nodes, name) for name in node_names if hasattr(nodes, name)]
    # Metadata records ref/key/element types, hence the builtins and typing.Any
    plain = [dict, list, int, float, str, bool, collections.defaultdict, typing.Any]
    return [DictConfig, ListConfig, base.ContainerMetadata, base.Metadata, *node_types, *plain]


# what Path(...) and PurePath(...) pickle as on either system, and Path as omegaconf's PathNode type
_PATH_TYPES = [Path, PosixPath, WindowsPath, PurePosixPath, PureWindowsPath]


@contextlib.contextmanager
def _hyperparameters_allowed(omegaconf: bool) -> Iterator[None]:
    """Allow paths, and omegaconf containers if asked, in weights-only loads for the block only.

    Only types not already allowed are added, and only those are removed afterwards, so what the
    user or other libraries allowed (before or meanwhile) stays allowed.
    """
    allowed = set(torch.serialization.get_safe_globals())
    wanted = _PATH_TYPES + (_omegaconf_types() if omegaconf else [])
    added = [t for t in wanted if t not in allowed]
    with torch.serialization.safe_globals(added):
        yield


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
