"""safetensors files: a streaming writer that keeps tied weights and key order, and the matching reader.

safetensors refuses tensors that share memory. Tied weights (``decoder.weight is embedding.weight``)
are written once and the other names recorded as aliases in the header metadata
(``{"decoder.weight": "embedding.weight"}``), the convention of ``safetensors.torch.save_model``;
so ``safetensors.torch.load_model`` and :func:`read_safetensors` both restore them, and
``load_state_dict(..., strict=True)`` sees every name. The state_dict order is recorded too, so
``by_order`` loading works from a safetensors file.

The writer streams one tensor at a time, without building the whole file in memory first: tensors
memory-mapped from a checkpoint are copied file-to-file by the kernel, others straight from their
memory. It is hand-written because the library's ``save_file`` reads every tensor into this
process, where this writer has the kernel copy a tensor memory-mapped from a checkpoint file-to-file
(``_io.MappedFile``): an export's peak RSS is 0.22x a 1 GiB file, the target being <= 0.3x
(``benchmarks/export.py``).

Reading is the library's ``safe_open``; where it refuses a header for a ``__metadata__`` value that is
not a string, it gives only a column, so :func:`_metadata_problem` names the field.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch

from lightning_mgpu._atomic import WRITEBACK_BYTES, start_writeback

__all__ = ["ORDER_KEY", "PREFIXES_KEY", "dedupe", "read_safetensors", "view_key", "write_safetensors"]

ORDER_KEY = "lightning_mgpu.order"
PREFIXES_KEY = "lightning_mgpu.removed_prefixes"
_MAX_HEADER = 100 << 20  # the safetensors library's own limit

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}


def view_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Equal for two tensors exactly when they are the same view of the same memory (tied weights)."""
    return (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())


def dedupe(state_dict: Mapping[str, Any]) -> tuple[OrderedDict[str, torch.Tensor], dict[str, str]]:
    """Keep the first name of every group of identical tensor views; map the others to it.

    Views that only overlap (a slice of another tensor) are kept apart: each is written with its
    own bytes, which loads back to the same values.

    Raises:
        ValueError: a value is not a tensor (a module's ``_extra_state``), which safetensors cannot store.
    """
    kept: OrderedDict[str, torch.Tensor] = OrderedDict()
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(
                f"safetensors stores only tensors, but {name!r} holds a {type(tensor).__name__}; "
                "export with format='pt' instead"
            )
        if tensor.numel() == 0:
            kept[name] = tensor
            continue
        view = view_key(tensor)
        if view in seen:
            aliases[name] = seen[view]
        else:
            seen[view] = name
            kept[name] = tensor
    return kept, aliases


class TensorSource(Protocol):
    """Where tensors memory-mapped from a file can be copied from without reading them into memory."""

    def copy_to(self, tensor: torch.Tensor, file: BinaryIO) -> int: ...


def write_safetensors(
    file: BinaryIO,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    mapped: TensorSource | None = None,
) -> int:
    """Write ``tensors`` (already free of shared views, see :func:`dedupe`) to an open binary file.

    A tensor that ``mapped`` can copy file-to-file is copied so; any other (or the rest of one whose
    copy stopped) is written from memory.

    Returns:
        The number of bytes written.

    Raises:
        ValueError: a dtype safetensors cannot store; the message names the key.
    """
    if sys.byteorder != "little":  # the format is little-endian; let the library byte-swap
        from safetensors.torch import save

        blob = save({k: v.contiguous() for k, v in tensors.items()}, metadata=dict(metadata))
        file.write(blob)
        return len(blob)
    # largest elements first keeps every tensor aligned, as the safetensors library does
    names = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {}
    offset = 0
    for name in names:  # the whole header is made before anything is written
        tensor = tensors[name]
        if tensor.dtype not in _DTYPES:
            raise ValueError(
                f"safetensors cannot store {name!r} of dtype {tensor.dtype}; export with format='pt' instead"
            )
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    file.write(struct.pack("<Q", len(raw)))
    file.write(raw)
    unsynced = 0
    for name in names:
        tensor = tensors[name]
        if not tensor.numel():
            continue
        copied = mapped.copy_to(tensor, file) if mapped is not None else 0
        nbytes = tensor.numel() * tensor.element_size()
        if copied < nbytes:  # a placeholder of a sharded folder (a meta tensor) is always copied whole
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            file.write(data[copied:].numpy().data)
        unsynced += nbytes
        if unsynced >= WRITEBACK_BYTES:
            start_writeback(file)
            unsynced = 0
    return 8 + len(raw) + offset


def _is_alias(name: str, listed: list[str] | None) -> bool:
    """Whether a metadata entry names a tied weight rather than being other metadata.

    Files written here list every name; in other files (``safetensors.torch.save_model``) tied
    weights belong to submodules, so their names are dotted paths, unlike notes such as
    ``{"description": "bias"}``.
    """
    if listed is not None:
        return name in listed
    return "." in name and all(part.isidentifier() or part.isdigit() for part in name.split("."))


def read_safetensors(
    path: str | os.PathLike[str], device: str = "cpu"
) -> tuple[OrderedDict[str, torch.Tensor], dict[str, str]]:
    """Read a safetensors file, restoring aliases of tied weights and the recorded key order.

    The library memory-maps the file: a tensor's pages are read only when it is used, and an
    export copies them file-to-file (``_io.MappedFile``) without faulting them in.

    Returns:
        ``(state_dict, metadata)``.

    Raises:
        ValueError: the file is truncated or corrupt, or its metadata is malformed; the message
            names the file and the field.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        with safe_open(os.fspath(path), framework="pt", device=device) as f:
            metadata: dict[str, str] = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - not a dict
    except SafetensorError as err:
        problem = _metadata_problem(path)
        raise ValueError(
            f"{path} has bad metadata: {problem}; write it again with string metadata values"
            if problem
            else f"{path} is truncated or corrupt: {err}; copy it again from where it was written"
        ) from None
    listed = _listed_names(path, metadata)
    for alias, target in metadata.items():
        if alias not in tensors and target in tensors and _is_alias(alias, listed):
            tensors[alias] = tensors[target]
    order = [k for k in listed or () if k in tensors]
    ordered = OrderedDict((k, tensors[k]) for k in order)
    ordered.update((k, v) for k, v in tensors.items() if k not in ordered)
    return ordered, metadata


def _metadata_problem(path: Path) -> str | None:
    """Which ``__metadata__`` value is not a string, or None when that is not what is wrong."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            metadata = json.loads(f.read(min(length, _MAX_HEADER)))["__metadata__"]
    except (OSError, struct.error, ValueError, TypeError, KeyError):
        return None
    if not isinstance(metadata, dict):
        return f"its header's '__metadata__' is a {type(metadata).__name__}, not a map of names to strings"
    bad = next((item for item in metadata.items() if not isinstance(item[1], str)), None)
    return None if bad is None else f"__metadata__[{bad[0]!r}] is {bad[1]!r}, not a string"


def _listed_names(path: Path, metadata: Mapping[str, str]) -> list[str] | None:
    """The JSON list of names under :data:`ORDER_KEY`, None if absent; a ValueError names a bad one."""
    if ORDER_KEY not in metadata:
        return None
    text = metadata[ORDER_KEY]
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path} has bad metadata: __metadata__[{ORDER_KEY!r}] is not valid JSON ({err}): {text[:60]!r}"
        ) from None
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ValueError(
            f"{path} has bad metadata: __metadata__[{ORDER_KEY!r}] should be a JSON list of tensor names, "
            f"got {text[:60]!r}; remove the field or export the original checkpoint again"
        )
    return value
