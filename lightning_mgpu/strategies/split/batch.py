"""Cut a batch along dim 0 into parts (replicas, micro-batches) and combine what the parts return.

- ``split_rows(batch, feature)`` finds the rows a batch can be cut into: the first dimension
  shared by every tensor of a nested batch (tuples, lists, dicts, namedtuples, dataclasses).
- ``split_sizes(rows, parts)`` spreads ``rows`` as evenly as possible over at most
  ``parts`` parts (never an empty part).
- ``scatter_batch`` cuts every tensor along dim 0 and places chunk ``i`` on device ``i``;
  0-dim tensors are copied to every device and anything that is not a tensor is handed to
  every part unchanged.
- ``combine_outputs`` turns the parts' step outputs into one output on the first device.

Across GPUs the chunks move with ``torch.nn.parallel``'s ``Scatter``/``Gather`` functions;
when every replica shares one device (CPU replicas) they are views of the batch.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

__all__ = ["combine_outputs", "scatter_batch", "split_rows", "split_sizes", "weighted_mean"]


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
        from torch.nn.parallel._functions import Scatter

        return Scatter.apply([d.index for d in devices], sizes, 0, tensor)
    # every replica on one device (CPU replicas, or several on one GPU): views of the batch
    return tensor.to(devices[0]).split(sizes)


def scatter_batch(batch: Any, sizes: list[int], devices: Sequence[torch.device]) -> list[Any]:
    """Cut ``batch`` into ``len(sizes)`` chunks along dim 0; chunk ``i`` lies on ``devices[i]``."""
    devices = list(devices)[: len(sizes)]
    pieces: list[Sequence[Tensor]] = []

    def cut(tensor: Tensor) -> Tensor:
        pieces.append(_split_tensor(tensor, sizes, devices))
        return tensor

    apply_to_collection(batch, Tensor, cut)
    chunks = []
    for index in range(len(sizes)):
        remaining = iter(pieces)
        chunks.append(apply_to_collection(batch, Tensor, lambda _, r=remaining, i=index: next(r)[i]))
    return chunks


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
            from torch.nn.parallel._functions import Gather

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

    - per-sample tensors (first dimension = the replica's chunk) are concatenated in order;
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
    if isinstance(first, Mapping):
        keys = list(first.keys())
        if any(list(v.keys()) != keys for v in values):
            raise ValueError(
                f"mgpu_dp: replicas returned dicts with different keys: {[list(v) for v in values]}"
            )
        combined = {k: combine_outputs([v[k] for v in values], sizes, device) for k in keys}
        try:
            return cast(Any, type(first))(combined)
        except TypeError:  # a mapping type that cannot be built from a dict
            return combined
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(
            *(combine_outputs(list(items), sizes, device) for items in zip(*values, strict=True))
        )
    if isinstance(first, (list, tuple)):
        if any(len(v) != len(first) for v in values):
            raise ValueError(
                f"mgpu_dp: replicas returned sequences of different lengths: {[len(v) for v in values]}"
            )
        return type(first)(combine_outputs(list(items), sizes, device) for items in zip(*values, strict=True))
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        result = copy.copy(first)
        for field in dataclasses.fields(first):
            value = combine_outputs([getattr(v, field.name) for v in values], sizes, device)
            object.__setattr__(result, field.name, value)
        return result
    if isinstance(first, numbers.Integral) and not isinstance(first, bool):
        return sum(int(v) for v in values)
    if isinstance(first, numbers.Real):
        total = sum(sizes)
        return sum(float(v) * n / total for v, n in zip(values, sizes, strict=True))
    return first
