"""safetensors headers and metadata that the library refuses or that this package misreads, explained.

- A header the library refuses is parsed again here to say which field is wrong, with the file's
  name: ``__metadata__['lr'] is 5, not a string``, not the library's ``invalid type: integer``.
- The metadata fields this package writes (JSON lists of names) are checked when read, so a
  malformed one names itself rather than failing as ``'int' object is not iterable``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["describe_header_problem", "parse_list"]

_MAX_HEADER = 100 << 20  # the safetensors library's own limit


def _header(path: Path) -> Any:
    """The parsed JSON header; raises ValueError naming what is wrong."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is truncated or corrupt: {size} bytes, too short for a header")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, _MAX_HEADER):
            raise ValueError(
                f"{path} is truncated or corrupt: its header claims {length} bytes, the file holds {size - 8}"
            )
        raw = f.read(length)
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is truncated or corrupt: its header is not valid JSON ({err})") from None


def describe_header_problem(path: Path) -> str | None:
    """What is wrong with the header of ``path``, naming the field, or None if nothing is found."""
    try:
        header = _header(path)
    except (ValueError, OSError) as err:
        return str(err)
    if not isinstance(header, dict):
        return f"{path} is truncated or corrupt: its header is a JSON {type(header).__name__}, not an object"
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict):
        return (
            f"{path} has bad metadata: its header's '__metadata__' is a {type(metadata).__name__}, "
            "not a map of names to strings"
        )
    for name, value in metadata.items():
        if not isinstance(value, str):
            return f"{path} has bad metadata: __metadata__[{name!r}] is {value!r}, not a string"
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        problem = _entry_problem(entry)
        if problem:
            return f"{path} is truncated or corrupt: the header entry of tensor {name!r} {problem}"
    return None


def _entry_problem(entry: Any) -> str | None:
    if not isinstance(entry, dict):
        return f"is a {type(entry).__name__}, not an object with dtype, shape and data_offsets"
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        return "has no " + ", ".join(repr(k) for k in missing)
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        return f"has shape {shape!r}, not a list of sizes"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        return f"has data_offsets {offsets!r}, not [begin, end]"
    if not isinstance(entry["dtype"], str):
        return f"has dtype {entry['dtype']!r}, not a dtype name such as 'F32'"
    return None


def parse_list(path: Path, metadata: Mapping[str, str], field: str) -> list[str] | None:
    """The JSON list of names in ``metadata[field]``, None if absent; a ValueError names a bad one."""
    if field not in metadata:
        return None
    text = metadata[field]
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path} has bad metadata: __metadata__[{field!r}] is not valid JSON ({err}): {text[:60]!r}"
        ) from None
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ValueError(
            f"{path} has bad metadata: __metadata__[{field!r}] should be a JSON list of tensor names, "
            f"got {text[:60]!r}; remove the field or export the original checkpoint again"
        )
    return value
