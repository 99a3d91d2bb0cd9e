"""torchmetrics' private ``Metric`` state that merging a batch's parts reads and writes.

A metric updated on parts of a batch (replicas, micro-batches) is merged into the module's metric so
that ``compute()`` gives the single-device value (``strategies/split/merge_metrics.py``). torchmetrics merges
states publicly only through ``Metric.merge_state`` (1.6), which refuses metrics with
``full_state_update`` or ``dist_sync_on_step``; the rest goes through the names below, checked on
torchmetrics 1.0 (the floor) to 1.9. No upstream issue found for a public update count.
"""

from __future__ import annotations

from typing import Any

from torchmetrics import Metric

__all__ = [
    "clear_computed",
    "reduce_states",
    "set_forward_cache",
    "set_update_count",
    "state_names",
    "update_count",
]


def update_count(metric: Metric) -> int:
    """How many times ``update`` ran since the last reset (``compute`` warns when it is 0)."""
    count: int = metric._update_count
    return count


def set_update_count(metric: Metric, count: int) -> None:
    """Set the update count to what one device would have counted over the whole batch."""
    metric._update_count = count


def state_names(metric: Metric) -> list[str]:
    """The names of the states ``add_state`` registered."""
    return list(metric._defaults)


def reduce_states(metric: Metric, incoming: dict[str, Any]) -> None:
    """Reduce ``incoming`` into the metric's states by each ``dist_reduce_fx``, as a DDP sync does."""
    metric._reduce_states(incoming)


def clear_computed(metric: Metric) -> None:
    """Drop the cached ``compute()`` value after the states changed."""
    metric._computed = None


def set_forward_cache(metric: Metric, value: Any) -> None:
    """Set the value ``forward`` returned, which ``self.log(name, metric)`` logs on step."""
    metric._forward_cache = value
