"""Turn whatever the user has into one state_dict: a file, a (wrapped) module, a LightningModule, a dict.

- a path is read safely (see ``_io``); a Lightning checkpoint gives its ``"state_dict"``;
- a training checkpoint dict gives the one entry that is a state_dict (``"model_state_dict"``, ...),
  and asks for ``key=`` when several are; an entry of nested dicts of tensors, as a sharded folder
  keeps ``{"model": {"encoder": ...}}``, is one state_dict, its names joined with dots;
- a module gives ``module.state_dict()``, whatever wraps it, and the exact prefixes of its wrappers;
- a LightningModule, or a Lightning checkpoint, marks its keys as starting with the attribute that
  holds the model (``model.``), which export removes when there is one such attribute and keeps
  when the weights lie in several (``embed.``, ``blocks.``, ``head.``);
- an empty state_dict (a model without parameters or buffers) is a state_dict like any other, as
  it is for ``torch.save`` and ``nn.Module.load_state_dict``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_mgpu.checkpoint._dcp import FORMAT, ShardedFolder
from lightning_mgpu.checkpoint._io import MappedFile, read_file
from lightning_mgpu.checkpoint._prefixes import (
    WRAPPERS,
    find_wrappers,
    select,
    split_top,
    strip_wrappers,
    wrapped_child,
)
from lightning_mgpu.checkpoint._report import shown
from lightning_mgpu.checkpoint._safetensors import ORDER_KEY, view_key
from lightning_mgpu.checkpoint._zip_check import ArchiveCheck

__all__ = [
    "PlainWeights",
    "Source",
    "count_values",
    "describe_tops",
    "is_lightning_module",
    "is_state_dict",
    "plain_state_dict",
    "resolve",
]

# training-checkpoint entries that usually hold the weights, most specific first
logger = logging.getLogger(__name__)

_WEIGHT_KEYS = ("state_dict", "model_state_dict", "model", "module", "net", "network", "weights", "params")
_LIGHTNING_KEYS = ("pytorch-lightning_version", "lightning_version")


@dataclass
class Source:
    """One state_dict and where it came from.

    ``wrappers`` holds the exact wrapper prefixes when the source is a module, and is None for a
    file or a dict, whose names alone say where wrappers sat. ``check`` verifies a torch zip file's
    records against their CRC-32: run it before trusting the values.
    """

    state_dict: OrderedDict[str, Any]
    description: str
    kind: str
    lightning: bool = False
    checkpoint: Mapping[str, Any] | None = None
    weights_key: str | None = None
    path: Path | None = None
    format: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    ordered: bool = True
    mapped: MappedFile | ShardedFolder | None = None
    wrappers: list[str] | None = None
    check: ArchiveCheck | None = None


def is_state_dict(obj: Any) -> bool:
    """A non-empty mapping of names to tensors (``_extra_state`` entries may hold anything)."""
    return (
        isinstance(obj, Mapping)
        and len(obj) > 0
        and all(isinstance(k, str) for k in obj)
        and all(isinstance(v, torch.Tensor) or k.endswith("_extra_state") for k, v in obj.items())
    )


def is_lightning_module(module: nn.Module) -> bool:
    """Whether ``module``, under any wrappers, is a LightningModule (without importing Lightning)."""
    module = _innermost(module)
    # if Lightning is not imported, no LightningModule exists
    bases = [sys.modules[name] for name in ("lightning.pytorch", "pytorch_lightning") if name in sys.modules]
    return any(isinstance(module, base.LightningModule) for base in bases)


def _innermost(module: nn.Module) -> nn.Module:
    while (child := wrapped_child(module)) is not None:
        module = module.get_submodule(child)
    return module


def resolve(
    source: Any, *, map_location: Any = "cpu", trust_pickle: bool = False, key: str | None = None
) -> Source:
    """Find the state_dict in ``source``.

    ``key`` names the entry of a training checkpoint that holds the weights (``"ema"``), for a
    checkpoint holding several.

    Raises:
        TypeError: ``source`` is none of the supported kinds.
        ValueError: a file or dict holds no state_dict, or several and no ``key`` says which.
        KeyError: ``key`` is not an entry of the checkpoint; the message lists those that are.
    """
    if key is not None and isinstance(source, nn.Module):
        raise TypeError(f"key={key!r} picks an entry of a checkpoint file or dict; got a module")
    if isinstance(source, (str, os.PathLike)):
        return _from_file(Path(source), map_location, trust_pickle, key)
    if isinstance(source, nn.Module):
        inner = _innermost(source)
        lightning = is_lightning_module(inner)
        kind = "LightningModule" if lightning else "module"
        what = (
            type(inner).__name__ if inner is source else f"{type(inner).__name__} in {type(source).__name__}"
        )
        return Source(
            OrderedDict(source.state_dict()),
            f"{kind} {what}",
            kind,
            lightning=lightning,
            wrappers=find_wrappers(source),
        )
    if isinstance(source, Mapping):
        return _from_mapping(source, "the given dict", key)
    raise TypeError(
        "expected a checkpoint path, an nn.Module or a state_dict (a dict of tensors), "
        f"got {type(source).__name__}"
    )


def _from_file(path: Path, map_location: Any, trust_pickle: bool, key: str | None) -> Source:
    if path.is_dir():  # a sharded checkpoint folder: tensors stay placeholders until read one by one
        folder = ShardedFolder(path, trust_pickle=trust_pickle)
        sharded = _from_mapping(folder.entries, str(path), key)
        # the folder's order is the ranks' save plans', not the model's
        sharded.path, sharded.format, sharded.mapped, sharded.ordered = path, FORMAT, folder, False
        return sharded
    loaded = read_file(path, map_location=map_location, trust_pickle=trust_pickle)
    obj = loaded.obj
    if isinstance(obj, nn.Module):  # torch.save(model): only readable with trust_pickle
        obj = obj.state_dict()
    if not isinstance(obj, Mapping):
        raise ValueError(
            f"{path} is not a checkpoint: it holds a {type(obj).__name__}, not a dict of tensors"
        )
    src = _from_mapping(obj, str(path), key)
    src.path, src.format, src.metadata, src.mapped = path, loaded.format, loaded.metadata, loaded.mapped
    src.check = loaded.check
    src.ordered = loaded.format != "safetensors" or ORDER_KEY in loaded.metadata
    return src


def _weights(value: Any) -> OrderedDict[str, Any] | None:
    """``value`` as a state_dict, nested mappings' names joined with dots; None unless it is one."""
    if not isinstance(value, Mapping):
        return None
    out: OrderedDict[str, Any] = OrderedDict()
    stack = [("", iter(value.items()))]
    while stack:  # not recursive: a crafted file may nest deeper than Python's stack
        prefix, items = stack[-1]
        item = next(items, None)
        if item is None:
            stack.pop()
            continue
        key, inner = item
        if not isinstance(key, str):
            return None
        if isinstance(inner, Mapping):
            stack.append((prefix + key + ".", iter(inner.items())))
        elif isinstance(inner, torch.Tensor) or key.endswith("_extra_state"):
            out[prefix + key] = inner
        else:
            return None
    return out


def _from_mapping(obj: Mapping[str, Any], where: str, key: str | None = None) -> Source:
    if key is not None:
        return _chosen_entry(obj, where, key)
    if not obj or is_state_dict(obj):  # {}: the state_dict of a model without weights
        return Source(OrderedDict(obj), where, "state_dict")
    if _weights(obj.get("state_dict")) is not None:
        return _chosen_entry(obj, where, "state_dict")
    candidates = _candidates(obj)
    if len(candidates) == 1:
        return _chosen_entry(obj, where, candidates[0])
    keys = ", ".join(shown(k) for k in list(obj)[:12]) + (", ..." if len(obj) > 12 else "")
    if candidates:
        names = ", ".join(repr(k) for k in candidates)
        raise ValueError(
            f"{where} is a training checkpoint holding several state_dicts ({names}); "
            f"pass key={candidates[0]!r} (command line: --key {candidates[0]}) or another of them"
        )
    looks_like = any(k in obj for k in (*_WEIGHT_KEYS, "epoch", "optimizer_states", "optimizer"))
    what = "a training checkpoint dict" if looks_like else "a dict"
    raise ValueError(
        f"{where} is {what} with keys {keys}, and none of them is a state_dict (a dict of names to tensors); "
        "pass model.state_dict(), or the checkpoint entry that holds it"
    )


def _candidates(obj: Mapping[str, Any]) -> list[str]:
    """The entries of a training checkpoint that hold a non-empty state_dict."""
    return [k for k in obj if isinstance(k, str) and _weights(obj[k])]


def _chosen_entry(obj: Mapping[str, Any], where: str, key: str) -> Source:
    state_dict = _weights(obj.get(key))
    if state_dict is None:
        holds = ", ".join(repr(k) for k in _candidates(obj)) or "none"
        if key not in obj:
            raise KeyError(f"{where} has no entry {key!r}; the entries holding weights are: {holds}")
        raise ValueError(
            f"{where}[{key!r}] holds a {type(obj[key]).__name__}, not a state_dict; "
            f"the entries holding weights are: {holds}"
        )
    lightning = key == "state_dict" and any(k in obj for k in _LIGHTNING_KEYS)
    kind = "Lightning checkpoint" if lightning else "checkpoint"
    return Source(state_dict, where, kind, lightning, obj, key)


def count_values(state_dict: Mapping[str, Any]) -> int:
    """Number of values in the tensors, tied weights counted once."""
    views = {view_key(t): t.numel() for t in state_dict.values() if isinstance(t, torch.Tensor)}
    return sum(views.values())


def describe_tops(state_dict: Mapping[str, Any]) -> str:
    """``"model (4 tensors, 1,234 values), loss_fn (1 tensor, 10 values)"``."""
    parts = []
    for top, count in split_top(state_dict).items():
        values = count_values({k: v for k, v in state_dict.items() if k == top or k.startswith(top + ".")})
        parts.append(f"{top} ({count} tensor{'s' * (count != 1)}, {values:,} values)")
    return ", ".join(parts)


@dataclass(frozen=True)
class PlainWeights:
    """What :func:`plain_state_dict` gives: the weights, the prefixes removed, the attributes kept.

    Attributes:
        state_dict: The weights as a plain model holds them.
        removed: The prefixes removed, in the keys' spelling (``["module.", "model."]``).
        kept: When a LightningModule holds its weights in several attributes and no submodule was
            asked for: those attributes, kept in the names (what a report offers to pick), and
            how many entries each holds.
        ignored: The source's names outside the submodule picked.
    """

    state_dict: OrderedDict[str, Any]
    removed: list[str]
    kept: dict[str, int] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)


def plain_state_dict(
    src: Source, submodule: str | None = None, kinds: Collection[str] = tuple(WRAPPERS)
) -> PlainWeights:
    """The weights as a plain model holds them: wrappers removed, one submodule picked.

    - every wrapper prefix is removed: exactly the wrappers' for a module, for a file or a dict
      those the names show (see ``_prefixes``), of the ``kinds`` given;
    - ``submodule="name"`` keeps the entries under ``name.`` and removes that prefix;
      ``submodule=""`` keeps everything;
    - by default a LightningModule (or a Lightning checkpoint) that holds one submodule loses its
      attribute prefix; one whose weights lie in several attributes (``embed``, ``blocks``,
      ``head``) keeps them all, named as the module names them: nothing is lost, and
      :attr:`PlainWeights.kept` counts them (never the names inside the one attribute removed).
    """
    state_dict, removed = strip_wrappers(src.state_dict, src.wrappers, kinds, lightning=src.lightning)
    kept: dict[str, int] = {}
    if submodule is None and src.lightning and state_dict:
        tops = split_top(state_dict)
        only = next(iter(tops)) if len(tops) == 1 else None
        if only is not None and only not in state_dict:  # every entry lies below ``only.``
            logger.debug(
                "removed %r: the LightningModule's weights all lie in that one attribute", only + "."
            )
            submodule = only
        else:
            logger.debug("kept every entry: the LightningModule's weights lie in %s", ", ".join(tops))
            kept = tops if len(tops) > 1 else {}
    ignored: list[str] = []
    if submodule:
        prefix = submodule.rstrip(".") + "."
        ignored = [k for k in state_dict if not k.startswith(prefix)]
        state_dict = select(state_dict, submodule)
        removed.append(prefix)
    return PlainWeights(state_dict, removed, kept, ignored)
