"""Cut a batch along dim 0 into parts (replicas, micro-batches) and combine what the parts return.

- ``split_rows(batch, feature)`` finds the rows a batch can be cut into: the first dimension
  shared by every tensor of a nested batch (tuples, lists, dicts, namedtuples, dataclasses).
- ``split_sizes(rows, parts)`` spreads ``rows`` as evenly as possible over at most
  ``parts`` parts (never an empty part).
- ``scatter_batch`` cuts every tensor along dim 0 and places chunk ``i`` on device ``i``;
  0-dim tensors are copied to every device, a list or tuple of one item per row (``default_collate``'s
  list of strings) is cut with the rows, and any other value is handed to every part unchanged; a
  sequence that holds no tensor and not one item per row is refused, naming the LightningModule hook
  that cuts such a batch (``SplitsBatchRows``); ``check_cuttable`` refuses it before any cut is needed.
- ``combine_outputs`` turns the parts' step outputs into one output on the first device.

Across GPUs the chunks move with ``torch.nn.parallel``'s ``Scatter``/``Gather`` functions;
when every replica shares one device (CPU replicas) they are views of the batch.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import numbers
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import torch
from lightning_utilities.core.apply_func import apply_to_collection, is_dataclass_instance, is_namedtuple
from torch import Tensor

from lightning_mgpu._compat.torch import Gather, Scatter
from lightning_mgpu._words import counted

__all__ = [
    "SPLIT_HOOK",
    "SplitsBatchRows",
    "check_cuttable",
    "combine_outputs",
    "scatter_batch",
    "split_rows",
    "split_sizes",
    "weighted_mean",
]


def split_rows(batch: Any, feature: str) -> int | None:
    """The rows ``batch`` can be cut into: the first dimension of its tensors, which must agree.

    Returns ``None`` when the batch holds no tensor with at least one dimension.

    Stricter than ``lightning_mgpu.estimate.batch.batch_rows`` (Lightning's ``extract_batch_size``,
    which reads a size for logging from the first tensor): cutting needs every tensor to agree,
    and 0-dim tensors go whole to every part.

    Args:
        batch: The batch.
        feature: What cuts it, for the error (``"mgpu_dp"``, ``"micro_batch_size under mgpu_ddp"``).

    Raises:
        ValueError: if the tensors disagree on their first dimension, naming ``feature``.
    """
    rows: list[int] = []
    apply_to_collection(batch, Tensor, lambda t: rows.append(t.shape[0]) if t.dim() > 0 else None)
    if not rows:
        return None
    if any(r != rows[0] for r in rows):
        raise ValueError(
            f"{feature} cuts every tensor of the batch along dim 0, but the batch holds tensors whose first"
            f" dimensions differ: {rows}. Give every tensor the batch size as its first dimension, or pass"
            " per-batch constants as Python values or 0-dim tensors (those go whole to every part)."
        )
    return rows[0]


def split_sizes(rows: int, parts: int) -> list[int]:
    """Spread ``rows`` over ``min(parts, rows)`` replicas, the first ones taking one more row when uneven.

    Example::

        split_sizes(7, 3)  # [3, 2, 2]
        split_sizes(2, 4)  # [1, 1]
    """
    if parts < 1:
        raise ValueError(f"expected at least one replica, got {parts}")
    used = max(1, min(parts, rows))
    base, extra = divmod(rows, used)
    return [base + (1 if i < extra else 0) for i in range(used)]


def _split_tensor(tensor: Tensor, sizes: list[int], devices: Sequence[torch.device]) -> Sequence[Tensor]:
    if tensor.dim() == 0:
        return [tensor.to(d) for d in devices]
    if len(set(devices)) > 1:
        return Scatter.apply([d.index for d in devices], sizes, 0, tensor)
    # every replica on one device (CPU replicas, or several on one GPU): views of the batch
    return tensor.to(devices[0]).split(sizes)


SPLIT_HOOK = "split_batch_rows"
"""The LightningModule method that cuts a batch ``scatter_batch``'s rules cannot (``SplitsBatchRows``)."""


@runtime_checkable
class SplitsBatchRows(Protocol):
    """A LightningModule that cuts its own batches into parts (micro-batches, ``mgpu_dp``'s replicas).

    ``split_batch_rows(batch, sizes)`` returns ``len(sizes)`` parts in order, part ``i`` holding the
    next ``sizes[i]`` rows of ``batch`` in the structure the step expects. The strategy moves each
    part's tensors to its device.

    Example::

        def split_batch_rows(self, batch, sizes):
            x, y, names = batch  # names: the dataset's class names, the same for every row
            return [(xs, ys, names) for xs, ys in zip(x.split(sizes), y.split(sizes))]
    """

    def split_batch_rows(self, batch: Any, sizes: list[int]) -> Sequence[Any]: ...


def _holds_tensor(obj: Any) -> bool:
    found: list[bool] = []
    apply_to_collection(obj, Tensor, lambda t: found.append(True))
    return bool(found)


def _entries(obj: Any, init_only: bool) -> dict[Any, Any] | None:
    """The fields, keys or items of a dataclass, mapping, namedtuple, list or tuple; ``None`` for a leaf.

    ``init_only``: a dataclass's fields that ``__init__`` takes (one the class derives itself is kept).
    """
    if is_dataclass_instance(obj):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init or not init_only}
    if isinstance(obj, Mapping):
        return dict(obj)
    if is_namedtuple(obj):
        return dict(zip(obj._fields, obj, strict=True))
    if isinstance(obj, (list, tuple)):
        return dict(enumerate(obj))
    return None


def _rebuilt(like: Any, entries: dict[Any, Any]) -> Any:
    """A collection of ``like``'s type holding ``entries`` (as ``_entries`` gave them)."""
    if is_dataclass_instance(like):
        result = copy.copy(like)
        for name, value in entries.items():
            object.__setattr__(result, name, value)
        return result
    if isinstance(like, defaultdict):
        return type(like)(like.default_factory, entries)
    if isinstance(like, Mapping):
        try:
            return cast(Any, type(like))(entries)
        except TypeError:  # a mapping type that cannot be built from a dict
            return entries
    if is_namedtuple(like):
        return type(like)(**entries)
    return type(like)(entries.values())


def _per_row(obj: Any) -> bool:
    """A list or tuple holding no tensor (``default_collate``'s list of string ids): cut with the rows."""
    return isinstance(obj, (list, tuple)) and not is_namedtuple(obj) and not _holds_tensor(obj)


class _Cutter:
    """One batch cut into ``len(sizes)`` parts: tensors along dim 0, per-row sequences with their rows."""

    def __init__(
        self, rows: int, sizes: list[int], cut_tensor: Callable[[Tensor], Sequence[Tensor]], feature: str
    ) -> None:
        self.rows, self.sizes, self.cut_tensor, self.feature = rows, sizes, cut_tensor, feature
        self.starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def parts(self, obj: Any, path: str) -> list[Any]:
        """``obj`` cut into one value per part; ``path`` names it in errors (``batch[2]``)."""
        n = len(self.sizes)
        if isinstance(obj, Tensor):
            return list(self.cut_tensor(obj))
        if _per_row(obj):
            if len(obj) == self.rows:  # one item per row: each part takes its rows' items
                return [obj[s : s + k] for s, k in zip(self.starts, self.sizes, strict=True)]
            if any(not isinstance(item, (list, tuple)) for item in obj):
                raise self._ambiguous(obj, path)
            # a sequence of per-row sequences (default_collate's transposition of a list field)
        entries = _entries(obj, init_only=True)
        if entries is None:
            return [obj] * n  # a per-batch value (a string, a number): whole to every part
        named = is_dataclass_instance(obj) or is_namedtuple(obj)
        cut = {k: self.parts(v, f"{path}.{k}" if named else f"{path}[{k!r}]") for k, v in entries.items()}
        return [_rebuilt(obj, {k: v[i] for k, v in cut.items()}) for i in range(n)]

    def _ambiguous(self, obj: Sequence[Any], path: str) -> ValueError:
        return ValueError(
            f"{self.feature} cuts the batch's {counted(self.rows, 'row')} into parts, but {path} is a"
            f" {type(obj).__name__} of {counted(len(obj), 'item')}, not one per row, so which items go with"
            f" which rows is unknown. Define `{SPLIT_HOOK}(self, batch, sizes)` on the LightningModule to"
            " return the parts (part i holds the next sizes[i] rows), or make it a tensor or a list of one"
            " item per row."
        )


def check_cuttable(batch: Any, rows: int, feature: str, module: Any = None) -> None:
    """Refuse now a batch ``scatter_batch`` could not cut: a sequence without one item per row.

    Nothing is checked in a batch of one row, which is never cut, or when ``module`` cuts its batches
    itself (``split_batch_rows``).

    Raises:
        ValueError: naming the entry (``batch[2]``) and the hook that would cut it.
    """
    if rows > 1 and getattr(module, SPLIT_HOOK, None) is None:
        _Cutter(rows, [rows], lambda t: [t], feature).parts(batch, "batch")


def scatter_batch(
    batch: Any,
    sizes: list[int],
    devices: Sequence[torch.device],
    feature: str = "mgpu_dp",
    module: Any = None,
) -> list[Any]:
    """Cut ``batch`` into ``len(sizes)`` chunks of ``sizes[i]`` rows; chunk ``i`` lies on ``devices[i]``.

    - tensors are cut along dim 0 (0-dim tensors go whole to every chunk);
    - a list or tuple holding no tensor with one item per row (``default_collate``'s list of strings)
      is cut with the rows; one of per-row lists is cut list by list;
    - any other value (a string, a number) goes whole to every chunk;
    - ``module.split_batch_rows(batch, sizes)`` (``SplitsBatchRows``), where the module has it, cuts
      instead, and its parts' tensors are moved to their devices.

    Raises:
        ValueError: for a list or tuple that holds no tensor and not one item per row (which items
            go with which rows is unknown), naming it and the hook, or a hook that returns the wrong
            number of parts.
    """
    devices = list(devices)[: len(sizes)]
    hook = getattr(module, SPLIT_HOOK, None)  # None for module=None too
    if hook is None:
        cutter = _Cutter(sum(sizes), sizes, lambda t: _split_tensor(t, sizes, devices), feature)
        return cutter.parts(batch, "batch")
    parts = hook(batch, list(sizes))
    if not isinstance(parts, Sequence) or len(parts) != len(sizes):
        got = f"{len(parts)} parts" if isinstance(parts, Sequence) else type(parts).__name__
        raise ValueError(
            f"{type(module).__name__}.{SPLIT_HOOK} returned {got} for sizes {sizes}: return a list of"
            f" {len(sizes)} parts, part i holding the next sizes[i] rows"
        )
    return [
        apply_to_collection(part, Tensor, lambda t, d=device: t.to(d))
        for part, device in zip(parts, devices, strict=True)
    ]


def weighted_mean(values: Sequence[Tensor], weights: Sequence[float], device: torch.device) -> Tensor:
    """``sum(w * v) / sum(w)`` on ``device``; differentiable, so a loss keeps its graph."""
    total = float(sum(weights))
    return functools.reduce(
        torch.add, (v.to(device) * (w / total) for v, w in zip(values, weights, strict=True))
    )


def _combine_tensors(values: list[Tensor], sizes: list[int], device: torch.device) -> Tensor:
    per_sample = all(v.dim() > 0 and v.shape[0] == n for v, n in zip(values, sizes, strict=True))
    if per_sample:
        if any(v.device != device for v in values):
            return Gather.apply(device.index, 0, *values)
        return torch.cat(values)
    if any(v.shape != values[0].shape for v in values):
        raise ValueError(
            "mgpu_dp cannot combine a step output whose shape differs between replicas"
            f" ({[tuple(v.shape) for v in values]}) and is not one row per sample. Return per-sample"
            " tensors (first dimension = batch size), scalars, or tensors of a fixed shape."
        )
    if not (values[0].is_floating_point() or values[0].is_complex()):
        # integer results are counts: the whole batch holds the sum of its chunks, in the dtype one
        # device returns (torch.sum would promote int32 to int64; for booleans the sum is "any")
        return torch.stack([v.to(device) for v in values]).sum(0, dtype=values[0].dtype)
    return weighted_mean(values, sizes, device)


def combine_outputs(values: list[Any], sizes: list[int], device: torch.device) -> Any:
    """One step output from the replicas' outputs, on ``device``.

    - per-sample tensors (first dimension = the replica's chunk) are concatenated in order, and so
      are lists and tuples holding no tensor and one item per row (ids, as ``scatter_batch`` cut them);
    - floating-point tensors of equal shape (a mean loss, a mean metric) are averaged, each
      weighted by its replica's share of the batch, so a mean over chunks equals the mean
      over the whole batch;
    - integer tensors (counts) are summed, keeping their dtype; boolean tensors are or-ed;
    - mappings, sequences, namedtuples and dataclasses are combined entry by entry;
    - Python integers are summed and other Python numbers averaged, like tensors; any other
      value comes from the first replica.

    Raises:
        ValueError: if some replicas return ``None`` and others do not, or the outputs
            have different structures.
    """
    first = values[0]
    if all(v is None for v in values):
        return None
    if any(v is None for v in values) or any(type(v) is not type(first) for v in values):
        kinds = [type(v).__name__ for v in values]
        raise ValueError(
            f"mgpu_dp needs every replica to return the same kind of step output, got {kinds}."
            " Make the step return the same structure (or None) for every part of the batch."
        )
    if isinstance(first, Tensor):
        return _combine_tensors(values, sizes, device)
    per_row = all(len(v) == n for v, n in zip(values, sizes, strict=True)) if _per_row(first) else False
    if per_row and not _holds_tensor(values):
        return type(first)(item for v in values for item in v)  # one item per row, as cut
    if isinstance(first, (list, tuple)) and any(len(v) != len(first) for v in values):
        raise ValueError(
            f"mgpu_dp: replicas returned sequences of different lengths: {[len(v) for v in values]}"
        )
    if isinstance(first, Mapping) and any(list(v.keys()) != list(first.keys()) for v in values):
        raise ValueError(f"mgpu_dp: replicas returned dicts with different keys: {[list(v) for v in values]}")
    entries = [_entries(v, init_only=False) for v in values]
    if entries[0] is not None:
        keys = entries[0].keys()
        combined = {k: combine_outputs([e[k] for e in entries if e is not None], sizes, device) for k in keys}
        return _rebuilt(first, combined)
    if isinstance(first, numbers.Integral) and not isinstance(first, bool):
        return sum(int(v) for v in values)
    if isinstance(first, numbers.Real):
        total = sum(sizes)
        return sum(float(v) * n / total for v, n in zip(values, sizes, strict=True))
    return first
