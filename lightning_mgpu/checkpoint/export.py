"""``export_state_dict``: write the weights of any checkpoint or model as a plain state_dict file."""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, cast

import torch

from lightning_mgpu._atomic import WritebackWriter, atomic_write, cannot_write, local_path
from lightning_mgpu.checkpoint._dcp import ShardedFolder
from lightning_mgpu.checkpoint._io import ReadError
from lightning_mgpu.checkpoint._prefixes import add_prefix, explain
from lightning_mgpu.checkpoint._report import human_size
from lightning_mgpu.checkpoint._safetensors import (
    ORDER_KEY,
    PREFIXES_KEY,
    dedupe,
    view_key,
    write_safetensors,
)
from lightning_mgpu.checkpoint._source import count_values, plain_state_dict, resolve
from lightning_mgpu.checkpoint.inspect import suggested_output

__all__ = ["ExportReport", "export_state_dict", "exported_state_dict"]

_FORMATS = {"safetensors": "safetensors", "pt": "pt", "pth": "pt", "bin": "pt", "ckpt": "pt"}
_DTYPES = ("float32", "float16", "bfloat16", "float64")  # dtype= by name: torch's names for them


@dataclass
class ExportReport:
    """What :func:`export_state_dict` wrote; ``str(report)`` is what ``lightning-mgpu export`` prints.

    Attributes:
        path: The file written (as given, a string, for a URL such as ``s3://bucket/w.safetensors``).
        format: ``"safetensors"`` or ``"pt"``.
        tensors: Entries written (tied weights counted under each name).
        values: Number of values, tied weights counted once.
        bytes: Size of the file.
        removed_prefixes: Prefixes taken off, in the source's spelling (``["module.", "model."]``).
        added_prefix: ``"module."`` for the DataParallel form, else ``""``.
        aliases: Tied weights stored once: alias name -> stored name.
        kept_attributes: When a LightningModule holds its weights in several attributes and no
            ``submodule`` was given: each attribute kept (in the names) -> its number of entries.

    Example::

        from torch import nn
        from lightning_mgpu import export_state_dict

        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
        model[1].weight = model[0].weight  # tied weights
        report = export_state_dict(nn.DataParallel(model), "model.safetensors")
        print(report.removed_prefixes, report.aliases)  # ['module.'] {'1.weight': '0.weight'}
    """

    path: Path | str
    format: str
    tensors: int
    values: int
    bytes: int
    removed_prefixes: list[str] = field(default_factory=list)
    added_prefix: str = ""
    aliases: dict[str, str] = field(default_factory=dict)
    kept_attributes: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [
            f"wrote {self.path} ({self.format}, {self.tensors} tensors, {self.values:,} values, "
            f"{human_size(self.bytes)})"
        ]
        if self.removed_prefixes:
            removed = [explain(p, f"{p} (attribute)") for p in self.removed_prefixes]
            lines.append("removed prefixes: " + ", ".join(removed))
        if self.added_prefix:
            lines.append(f"added prefix: {self.added_prefix} (loads into nn.DataParallel(model))")
        if self.aliases:
            tied = ", ".join(f"{a} -> {t}" for a, t in list(self.aliases.items())[:5])
            lines.append(f"tied weights stored once: {tied}" + (" ..." if len(self.aliases) > 5 else ""))
        if self.kept_attributes:
            tops = ", ".join(
                f"{name} ({count} tensor{'s' * (count != 1)})" for name, count in self.kept_attributes.items()
            )
            first = next(iter(self.kept_attributes))
            lines.append(
                f"kept every entry, named as the LightningModule names them: {tops}; to export one alone, "
                f"pass submodule={first!r} (command line: --submodule {first})"
            )
        return "\n".join(lines)


def _choose_format(path: Path | str, format: str | None) -> str:
    suffix = PurePosixPath(path).suffix.lower()
    if format is not None:
        if format not in ("safetensors", "pt"):
            raise ValueError(f"format must be 'safetensors' or 'pt', got {format!r}")
        if format == "pt" and suffix == ".safetensors":
            # torch.load hands files named *.safetensors to the safetensors reader
            raise ValueError(
                f"{path} would hold torch.save data under a .safetensors name, which torch.load and "
                "safetensors both misread; name it .pt, or drop format='pt' to write safetensors"
            )
        return format
    return _FORMATS.get(suffix.lstrip("."), "safetensors")


def _choose_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    return getattr(torch, dtype)


def export_state_dict(
    source: Any,
    path: str | os.PathLike[str],
    *,
    submodule: str | None = None,
    prefix: str = "",
    format: str | None = None,
    dtype: torch.dtype | str | None = None,
    trust_pickle: bool = False,
    key: str | None = None,
) -> ExportReport:
    """Write the plain weights of ``source`` to ``path``, atomically.

    - ``source`` is a checkpoint path (Lightning ``.ckpt``, ``.pt``, ``.safetensors``, or the
      folder of a sharded checkpoint that FSDP or ``ModelParallelStrategy`` saved), an
      ``nn.Module`` (wrapped in DataParallel, DDP or ``torch.compile`` in any order), a
      LightningModule, or a state_dict / training checkpoint dict;
    - wrapper prefixes (``module.``, ``_orig_mod.``, ``_forward_module.``) are removed, and a
      LightningModule's attribute prefix (``model.``) too when it holds one submodule; a module
      whose layers are its own attributes (``self.embed``, ``self.head``) keeps every entry as it
      names them, and the report says how to pick one. A module's
      wrappers are found by type (DataParallel, DDP, ``torch.compile``, Lightning and DeepSpeed
      wrappers), so a user's block that keeps its layer in ``self.module`` keeps its names. A file
      or dict shows only names: ``_orig_mod.`` goes wherever it is the only child, ``module.`` and
      ``_forward_module.`` only at the top, directly under one top-level name (``model.module.``)
      or directly after another wrapper, so ``blocks.0.module.weight`` is kept;
    - the file is written to a temporary file in the same folder, fsynced, then renamed over
      ``path``: on any error ``path`` is unchanged and no temporary file is left; a URL of another
      file system (``s3://bucket/model.safetensors``) is written through fsspec in a transaction,
      which needs that file system's fsspec package (``s3fs``);
    - a checkpoint file is memory-mapped and streamed, so memory stays near one tensor, not one
      copy of the weights (safetensors output); a sharded folder's tensors are assembled from
      their shards and written one at a time, its optimizer state left unread.

    Args:
        source: What to export (see above).
        path: Destination file or fsspec URL. The format follows the suffix unless ``format`` is given.
        submodule: Attribute to export (``"model"``, ``"model.encoder"``); ``""`` keeps everything,
            which is also what a LightningModule holding several submodules gets by default.
        prefix: Put this in front of every key; ``"module."`` gives the form that loads into
            ``nn.DataParallel(model)``.
        format: ``"safetensors"`` (default) or ``"pt"`` (``torch.save``). Tied weights are stored once
            in safetensors and come back under every name with :func:`load_state_dict`.
        dtype: Cast floating-point tensors, e.g. ``torch.bfloat16`` or ``"float16"``.
        trust_pickle: Unpickle arbitrary Python objects from a legacy file. Only for files you trust.
        key: The entry of a training checkpoint that holds the weights, when it holds several
            (``{"model": ..., "ema": ...}``).

    Returns:
        An :class:`ExportReport` of what was written and which prefixes were removed.

    Raises:
        FileNotFoundError, IsADirectoryError, PermissionError: a path cannot be read or written.
        OSError: writing failed (a full disk, ...); ``path`` is left as it was.
        ValueError: the source is not a checkpoint, is corrupt, unsafe, or ambiguous, or ``path`` is a
            URL fsspec cannot open here; the message says what to pass or install.
        KeyError: ``submodule`` does not exist; the message lists what does.

    Example::

        import safetensors.torch
        import torch
        from torch import nn
        from lightning_mgpu import export_state_dict

        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        torch.save({"state_dict": nn.DataParallel(model).state_dict()}, "last.ckpt")
        report = export_state_dict("last.ckpt", "model.safetensors")
        print(report.removed_prefixes)  # ['module.']
        safetensors.torch.load_model(model, "model.safetensors")  # strict: every name fits
    """
    local = local_path(path)
    path = os.fspath(path) if local is None else local
    fmt = _choose_format(path, format)
    to_dtype = _choose_dtype(dtype)
    if isinstance(source, (str, os.PathLike)) and local is not None:
        _refuse_writing_into(Path(source), local)
    src = resolve(source, trust_pickle=trust_pickle, key=key)
    plain = plain_state_dict(src, submodule)
    state_dict, removed = plain.state_dict, plain.removed
    if isinstance(src.mapped, ShardedFolder):  # placeholders: the writer reads them one by one
        src.check = src.mapped.record_check(state_dict)
        state_dict = src.mapped.prepare(state_dict, to_dtype, stream=fmt == "safetensors")
    if to_dtype is not None:
        state_dict = _cast(state_dict, to_dtype)
    if prefix:
        prefix = prefix if prefix.endswith(".") else prefix + "."
        state_dict = add_prefix(state_dict, prefix)
    values = count_values(state_dict)
    aliases: dict[str, str] = {}
    if src.check is not None:
        src.check.start()  # alongside the writing; waited for before the file is renamed into place
    try:
        with atomic_write(path) as file:
            if fmt == "safetensors":
                kept, aliases = dedupe(state_dict)
                metadata = {"format": "pt", ORDER_KEY: json.dumps(list(state_dict)), **aliases}
                if removed:
                    metadata[PREFIXES_KEY] = ",".join(removed)
                size = write_safetensors(file, kept, metadata, mapped=src.mapped)
            else:
                torch.save(state_dict, cast(BinaryIO, WritebackWriter(file)))  # it only needs write()
                size = file.tell()
            if src.check is not None:
                src.check.verify(src.state_dict)
    except (OSError, RuntimeError) as err:
        # torch.save reports a failed write as a RuntimeError raised while handling the OSError;
        # what failed reading a source says so itself (ReadError), the rest is the target's
        cause = err if isinstance(err, OSError) else err.__context__
        if not isinstance(cause, OSError) or isinstance(cause, ReadError) or str(path) in str(cause):
            raise
        raise cannot_write(path, cause) from None
    finally:
        if src.mapped is not None:
            src.mapped.close()
    return ExportReport(path, fmt, len(state_dict), values, size, removed, prefix, aliases, plain.kept)


def exported_state_dict(
    source: Any, *, submodule: str | None = None, key: str | None = None, trust_pickle: bool = False
) -> OrderedDict[str, Any]:
    """The state_dict :func:`export_state_dict` would write for ``source``, without writing it.

    Wrappers and a LightningModule's single attribute are removed as the export removes them, and a
    bad ``submodule`` fails the same way, so a caller can check its arguments before any file
    exists (``PlainStateDictExport`` does so at the start of fit).

    Raises:
        KeyError: ``submodule`` does not exist; the message lists what does.
        ValueError, TypeError: as :func:`export_state_dict`.

    Example::

        from torch import nn
        from lightning_mgpu.checkpoint.export import exported_state_dict

        print(list(exported_state_dict(nn.DataParallel(nn.Linear(2, 1)))))  # ['weight', 'bias']
    """
    return plain_state_dict(resolve(source, trust_pickle=trust_pickle, key=key), submodule).state_dict


def _refuse_writing_into(source: Path, path: Path) -> None:
    """Refuse an output that is the source file, or lies inside the source folder: writing it would
    replace part of what is being read (a shard of a sharded folder), and the source would be lost."""
    real_source, real_path = Path(os.path.realpath(source)), Path(os.path.realpath(path))
    same = real_path == real_source or (path.exists() and source.exists() and os.path.samefile(path, source))
    if same or (source.is_dir() and real_source in real_path.parents):
        where = "is the checkpoint" if same else "lies inside the checkpoint folder"
        raise ValueError(
            f"{path} {where} {source} that it would be exported from: writing it would replace "
            "what is being read, and lose the checkpoint; give an output outside it "
            f"(e.g. {suggested_output(source, '')})"
        )


def _cast(state_dict: OrderedDict[str, Any], dtype: torch.dtype) -> OrderedDict[str, Any]:
    """Floating-point tensors in ``dtype``; tied weights are cast once and stay tied."""
    cast_views: dict[tuple[Any, ...], torch.Tensor] = {}
    out: OrderedDict[str, Any] = OrderedDict()
    for name, value in state_dict.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            if not value.numel():
                value = value.to(dtype)
            else:
                key = view_key(value)
                value = cast_views[key] = cast_views[key] if key in cast_views else value.to(dtype)
        out[name] = value
    return out
