"""``inspect_checkpoint``: what a checkpoint or weights file holds, and what it loads into."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_mgpu.checkpoint._dcp import ShardedFolder
from lightning_mgpu.checkpoint._prefixes import explain, plain_names, split_top
from lightning_mgpu.checkpoint._report import Shape, human_size, shown
from lightning_mgpu.checkpoint._safetensors import ORDER_KEY, PREFIXES_KEY
from lightning_mgpu.checkpoint._source import count_values, resolve

__all__ = ["CheckpointInfo", "TensorInfo", "inspect_checkpoint", "suggested_output"]

_MAX_GROUP_DEPTH = 3
# training-checkpoint entries shown as details: entry -> label
_DETAILS = {"pytorch-lightning_version": "lightning", "epoch": "epoch", "global_step": "global step"}
# suffixes a suggested export's name drops, after the last one: x.pth.tar -> x
_STRIPPED_SUFFIXES = {".pt", ".pth", ".ckpt", ".bin", ".safetensors", ".tar", ".gz", ".zip"}


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the weights, named as stored.

    Example::

        first = inspect_checkpoint("last.ckpt").tensors[0]
        print(first.name, first.shape, first.dtype)  # model.0.weight [6, 4] float32
    """

    name: str
    shape: Shape
    dtype: str
    values: int


@dataclass
class CheckpointInfo:
    """What :func:`inspect_checkpoint` found. ``str(info)`` is the command line's report.

    Example::

        info = inspect_checkpoint("last.ckpt")
        if not info.loads_into_plain:
            print(info.wrappers, info.lightning_attribute)  # [] 'model.'

    ``loads_into_plain`` and ``loads_into_dataparallel`` say whether the names fit; where
    ``tied_unknown`` is set (a safetensors file from another tool, which may have left tied names
    out) that holds only for a model whose tied weights the file kept.
    """

    source: str
    kind: str
    format: str | None = None
    size: int | None = None
    details: list[str] = field(default_factory=list)
    other_entries: list[str] = field(default_factory=list)
    weights_key: str | None = None
    chosen_key: str | None = None
    tensors: list[TensorInfo] = field(default_factory=list)
    values: int = 0
    dtypes: dict[str, int] = field(default_factory=dict)
    wrappers: list[str] = field(default_factory=list)
    exported_from: list[str] = field(default_factory=list)
    lightning_attribute: str | None = None
    loads_into_plain: bool = False
    loads_into_dataparallel: bool = False
    tied_unknown: bool = False

    def groups(self) -> dict[str, list[TensorInfo]]:
        """Entries grouped by prefix, at the shallowest level that splits them (wrappers skipped)."""
        wrapper_prefixes = set(self.wrappers)
        for depth in range(1, _MAX_GROUP_DEPTH + 1):
            groups: dict[str, list[TensorInfo]] = {}
            for info in self.tensors:
                groups.setdefault(_label(info.name, depth, wrapper_prefixes), []).append(info)
            if len(groups) > 1:
                break
        return groups

    def render(self, max_per_group: int | None = 20) -> str:
        """The report, listing at most ``max_per_group`` entries per group (None: all)."""
        size = f", {human_size(self.size)}" if self.size is not None else ""
        lines = [f"{self.source}: {self.kind} ({self.format or 'in memory'}{size})"]
        if self.details:
            lines.append("  " + ", ".join(self.details))
        if self.other_entries:
            lines.append("  also holds: " + ", ".join(self.other_entries))
        where = f" under {self.weights_key!r}" if self.weights_key else ""
        dtypes = ", ".join(f"{d} x{n}" for d, n in self.dtypes.items())
        dtypes = f" ({dtypes})" if dtypes else ""
        lines.append(f"weights{where}: {len(self.tensors)} tensors, {self.values:,} values{dtypes}")
        through = [explain(p, p) for p in self.wrappers]  # each a wrapper's (plain_names)
        if self.lightning_attribute:
            attribute = self.lightning_attribute
            through.append(explain(attribute, f"{attribute} (LightningModule attribute)"))
        lines.append("saved through: " + (", ".join(through) or "no wrapper"))
        if self.exported_from:
            lines.append("exported by lightning-mgpu, which removed: " + ", ".join(self.exported_from))
        lines += self._loads_lines()
        for label, infos in self.groups().items():
            count = sum(i.values for i in infos)
            lines.append(f"{label} ({len(infos)} tensors, {count:,} values)")
            width = max(len(i.name) for i in infos)
            shown = infos if max_per_group is None else infos[:max_per_group]
            lines += [f"  {i.name:<{width}}  {str(i.shape):<16} {i.dtype}" for i in shown]
            if len(shown) < len(infos):
                lines.append(f"  ... and {len(infos) - len(shown)} more (--all lists every entry)")
        return "\n".join(lines)

    def _loads_lines(self) -> list[str]:
        source = Path(self.source) if self.format else Path("weights")
        entry = f" (its {self.weights_key!r} entry)" if self.weights_key else ""
        key = f" --key {shlex.quote(self.chosen_key)}" if self.chosen_key is not None else ""

        def answer(loads: bool, dataparallel: bool) -> str:
            if loads and self.tied_unknown:
                return "only if the model ties no weights this file left out (see below)"
            if loads:
                return f"yes{entry}"
            flag, tag = (" --dataparallel", "_dp") if dataparallel else ("", "")
            given = shlex.quote(str(source))
            return f"no  -> lightning-mgpu export{key}{flag} {given} {suggested_output(source, tag)}"

        lines = [
            f"loads into a plain model:          {answer(self.loads_into_plain, False)}",
            f"loads into nn.DataParallel(model): {answer(self.loads_into_dataparallel, True)}",
            "  (lightning_mgpu.load_state_dict(model, FILE) loads it into either,"
            " and into DDP or compiled models)",
        ]
        if self.tied_unknown:
            lines.append(
                "  (a safetensors file from another tool, Hugging Face save_pretrained among them, stores "
                "tied weights once and leaves the other names out, lm_head.weight for one; torch's strict "
                "load_state_dict reports those missing, lightning_mgpu.load_state_dict fills them in)"
            )
        return lines

    def __str__(self) -> str:
        return self.render()


def suggested_output(source: Path, tag: str) -> str:
    """A safetensors file next to ``source`` for the suggested export, quoted for a shell.

    Every weights or archive suffix goes (``x.pth.tar`` -> ``x``), and the result never names
    ``source`` itself, so running the suggestion cannot write over the file it reads.
    """
    stem = source.stem
    while Path(stem).suffix.lower() in _STRIPPED_SUFFIXES:
        stem = Path(stem).stem
    out = source.with_name(f"{stem}{tag}.safetensors")
    if out.name == source.name:
        out = source.with_name(f"{stem}{tag}_plain.safetensors")
    return shlex.quote(str(out))


def _label(name: str, depth: int, wrapper_prefixes: set[str]) -> str:
    parts = name.split(".")
    label, taken = "", 0
    for part in parts[:-1]:
        label += part + "."
        if label not in wrapper_prefixes:
            taken += 1
        if taken == depth:
            break
    return label or "(top level)"


def inspect_checkpoint(source: Any, *, trust_pickle: bool = False, key: str | None = None) -> CheckpointInfo:
    """Describe a checkpoint or weights file (or a module / state_dict) without changing anything.

    Reports the kind of file, the other entries of a training checkpoint, every tensor's name,
    shape and dtype grouped by prefix, the number of values, the wrappers the weights were saved
    through, and whether ``model.load_state_dict`` of a plain or a DataParallel model takes it as is.
    A file's wrappers are read from where ``module.`` / ``_orig_mod.`` sit in its names, as
    :func:`export_state_dict` describes: ``0.module.weight`` is a block's own attribute.
    Files are memory-mapped, so inspecting a large checkpoint reads little of it.

    Args:
        source: A checkpoint path (a sharded checkpoint's folder too), a module or a state_dict.
        trust_pickle: Unpickle arbitrary Python objects from a legacy file. Only for files you trust.
        key: The entry of a training checkpoint that holds the weights, when it holds several.

    Raises:
        FileNotFoundError, ValueError: as :func:`load_state_dict`.

    Example::

        from lightning_mgpu import inspect_checkpoint

        info = inspect_checkpoint("epoch=3.ckpt")
        print(info)                  # the report of ``lightning-mgpu inspect``
        info.loads_into_plain        # False: the keys start with 'model.'
    """
    src = resolve(source, trust_pickle=trust_pickle, key=key)
    info = CheckpointInfo(src.description, src.kind, src.format, weights_key=src.weights_key, chosen_key=key)
    if isinstance(src.mapped, ShardedFolder):  # a sharded folder: all its files, and who wrote them
        info.size = src.mapped.size
        info.details.append(src.mapped.describe())
    elif src.path is not None:
        info.size = src.path.stat().st_size
    if src.checkpoint is not None:
        _describe_checkpoint(src.checkpoint, src.weights_key, info)
    for name, value in src.state_dict.items():
        if isinstance(value, torch.Tensor):
            dtype = str(value.dtype).removeprefix("torch.")
            info.tensors.append(TensorInfo(name, Shape(value.shape), dtype, value.numel()))
            info.dtypes[dtype] = info.dtypes.get(dtype, 0) + 1
    info.values = count_values(src.state_dict)
    names, info.wrappers = plain_names(src.state_dict, src.wrappers, lightning=src.lightning)
    if src.lightning:
        tops = split_top(names.values())
        if len(tops) == 1:
            info.lightning_attribute = next(iter(tops)) + "."
    if PREFIXES_KEY in src.metadata:
        info.exported_from = src.metadata[PREFIXES_KEY].split(",")
    # an empty state_dict (a model without weights) loads into any model without weights
    empty = not src.state_dict
    info.loads_into_plain = empty or (not info.wrappers and not src.lightning)
    info.loads_into_dataparallel = empty or (not src.lightning and info.wrappers == ["module."])
    info.tied_unknown = src.format == "safetensors" and not empty and not _records_ties(src.metadata, names)
    if isinstance(src.mapped, ShardedFolder):  # no model.load_state_dict(torch.load(...)) reads a folder
        info.loads_into_plain = info.loads_into_dataparallel = False
    return info


def _records_ties(metadata: Mapping[str, str], names: Mapping[str, str]) -> bool:
    """Whether a safetensors file says how it stored tied weights: written here, or with aliases."""
    return ORDER_KEY in metadata or any(
        value in names and key not in names for key, value in metadata.items()
    )


def _describe_checkpoint(
    checkpoint: Mapping[str, Any], weights_key: str | None, info: CheckpointInfo
) -> None:
    info.details += [
        f"{label} {shown(checkpoint[key])}" for key, label in _DETAILS.items() if key in checkpoint
    ]
    for key, value in checkpoint.items():
        if key == weights_key or key in _DETAILS:
            continue
        kind = value.__name__ if isinstance(value, type) else type(value).__name__
        info.other_entries.append(
            f"{key} ({kind})" if kind not in ("dict", "list", "str", "int", "float") else str(key)
        )
