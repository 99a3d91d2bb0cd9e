"""Read a ``torch.distributed.checkpoint`` folder's index (``.metadata``) without running or trusting it.

torch reads this file with a bare ``pickle.load`` (``FileSystemReader.read_metadata``), which would
run any code a crafted file names and allocate any length it claims. Here the file is read into
memory first, so a length it claims can only come up short, then unpickled with only the classes
torch writes there, then checked (:func:`~lightning_mgpu.checkpoint._dcp_plan.check_index`).
"""

from __future__ import annotations

import functools
import io
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch

from lightning_mgpu.checkpoint._dcp_plan import METADATA, Index, check_index, regular_file

__all__ = ["read_index"]


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
    """Read and check ``folder/.metadata`` and the files it names (see the module docstring).

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
