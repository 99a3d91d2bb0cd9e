"""torchmetrics inside ``mgpu_dp``'s replicas: each replica updates its own copy, merged after the step.

A replica made by ``replicate`` would share the metric's state tensors with the module
(torchmetrics keeps them as plain attributes) and update them from several threads at
once. Instead every replica gets its own copy of each ``Metric``, reset before the step;
after the step the copies are merged into the module's metric in replica order
(``split.merge_metrics.merge_in_order``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric

from lightning_mgpu._compat.torchmetrics import update_count
from lightning_mgpu.strategies.split.merge_metrics import merge_in_order, metric_paths, replica_path

__all__ = ["ReplicaMetrics"]


class ReplicaMetrics:
    """Per-replica copies of a module's metrics, kept across steps and reset before each one."""

    def __init__(self) -> None:
        self._copies: dict[str, tuple[Metric, list[Metric]]] = {}
        self._used = 0

    def install(
        self, module: nn.Module, replicas: Sequence[nn.Module], devices: Sequence[torch.device]
    ) -> None:
        """Give every replica a fresh copy of each metric of ``module``, on the replica's device."""
        self._used = len(replicas)
        paths = metric_paths(module)
        for path in list(self._copies):
            if path not in paths:
                del self._copies[path]
        for path in paths:
            original = module.get_submodule(path)
            assert isinstance(original, Metric)
            entry = self._copies.get(path)
            if entry is None or entry[0] is not original:
                entry = (original, [])
                self._copies[path] = entry
            copies = entry[1]
            parent_path, _, leaf = replica_path(path).rpartition(".")
            for index, (replica, device) in enumerate(zip(replicas, devices, strict=True)):
                if index == len(copies):
                    copy = original.clone()
                    copies.append(copy)
                copy = copies[index]
                copy.reset()
                if copy.device != device:
                    copy.to(device)
                parent = replica.get_submodule(parent_path) if parent_path else replica
                setattr(parent, leaf, copy)  # nn.Module puts a module value among its children

    def merge(self) -> dict[int, Metric]:
        """Merge the copies used in the last step into the module's metrics.

        Returns:
            ``id(copy) -> metric of the module`` for every copy used, to map a metric
            logged inside a replica back to the module's own.
        """
        originals: dict[int, Metric] = {}
        for original, copies in self._copies.values():
            used = copies[: self._used]
            merge_in_order(original, used)
            originals.update((id(c), original) for c in used)
        return originals

    def batch_value(self, original: Metric) -> Any:
        """The metric's value over the whole last batch, as ``forward`` on one device returns it."""
        for metric, copies in self._copies.values():
            if metric is original:
                head, rest = copies[0], copies[1 : self._used]
                merge_in_order(head, rest)
                return head.compute() if update_count(head) else None
        return None

    def clear(self) -> None:
        self._copies.clear()
