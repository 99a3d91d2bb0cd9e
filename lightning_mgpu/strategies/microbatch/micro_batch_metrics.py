"""torchmetrics inside micro-batches: each micro-batch updates its own copy, merged after the batch.

The same merging as ``mgpu_dp``'s replicas (``split.merge_metrics.merge_in_order``): the module's metric
ends with the state one unsplit update would leave, ``compute()`` gives the single-device value,
and the value ``forward`` returns for the batch (logged on step) is that of the whole batch.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torchmetrics import Metric

from lightning_mgpu._compat.torchmetrics import set_forward_cache, update_count
from lightning_mgpu.strategies.split.merge_metrics import merge_in_order, metric_paths, replica_path

__all__ = ["MicroBatchMetrics"]


class MicroBatchMetrics:
    """Gives every micro-batch a fresh copy of each metric of the module, and merges the copies back."""

    def __init__(self) -> None:
        self._copies: dict[int, list[Metric]] = {}
        self._slots: list[tuple[nn.Module, str, Metric]] = []
        self._used = 0

    def begin(self, module: nn.Module) -> None:
        """Find the module's metrics (none: nothing to do for this batch)."""
        self._slots = []
        self._used = 0
        for path in metric_paths(module):
            parent_path, _, leaf = replica_path(path).rpartition(".")
            parent = module.get_submodule(parent_path) if parent_path else module
            original = getattr(parent, leaf)
            assert isinstance(original, Metric)
            self._slots.append((parent, leaf, original))
        live = {id(original) for _, _, original in self._slots}
        self._copies = {k: v for k, v in self._copies.items() if k in live}

    def use(self, index: int) -> None:
        """Micro-batch ``index`` updates its own (reset) copy of every metric."""
        self._used = max(self._used, index + 1)
        for parent, leaf, original in self._slots:
            copies = self._copies.setdefault(id(original), [])
            while len(copies) <= index:
                copies.append(original.clone())
            copy = copies[index]
            copy.reset()
            if copy.device != original.device:
                copy.to(original.device)
            setattr(parent, leaf, copy)  # nn.Module puts a module value among its children

    def put_back(self) -> None:
        """The module's own metrics in place again (after every micro-batch, and after a failed attempt)."""
        for parent, leaf, original in self._slots:
            setattr(parent, leaf, original)

    def forget_attempt(self) -> None:
        """A failed attempt's updates count for nothing."""
        self.put_back()
        self._used = 0

    def merge(self) -> dict[int, Metric]:
        """Merge the copies into the module's metrics; returns ``id(copy) -> metric`` for every copy used."""
        self.put_back()
        originals: dict[int, Metric] = {}
        for _, _, original in self._slots:
            used = self._copies.get(id(original), [])[: self._used]
            if not used:
                continue
            merge_in_order(original, used)
            originals.update((id(c), original) for c in used)
            if any(update_count(c) for c in used):
                set_forward_cache(original, _batch_value(used))
        return originals


def _batch_value(copies: list[Metric]) -> Any:
    head, rest = copies[0], copies[1:]
    merge_in_order(head, rest)
    return head.compute() if update_count(head) else None
