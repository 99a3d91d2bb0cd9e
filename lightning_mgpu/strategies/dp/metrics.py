"""torchmetrics inside replicas: each replica updates its own copy, merged back after the step.

A replica made by ``replicate`` would share the metric's state tensors with the module
(torchmetrics keeps them as plain attributes) and update them from several threads at
once. Instead every replica gets its own copy of each ``Metric``, reset before the step;
after the step the copies' states are merged into the module's metric in replica order,
so the merged state holds exactly what one device would have accumulated over the whole
batch, and ``compute()`` gives the single-device value.

Merging uses ``Metric.merge_state`` (torchmetrics >= 1.6). Where it is missing, or where
it refuses the metric (``full_state_update`` not ``False``, ``dist_sync_on_step=True``),
the same per-state reductions run through ``Metric._reduce_states``: the reductions
(``dist_reduce_fx``) that a DDP sync applies across processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric

from lightning_mgpu.strategies.dp.replicas import replica_path

__all__ = ["ReplicaMetrics", "metric_paths"]


def metric_paths(module: nn.Module) -> list[str]:
    """Dotted paths of the ``Metric`` submodules of ``module``, not those nested inside another metric."""
    paths: list[str] = []
    for name, sub in module.named_modules():
        if name and isinstance(sub, Metric) and not any(name.startswith(p + ".") for p in paths):
            paths.append(name)
    return paths


def _move(state: Any, device: torch.device) -> Any:
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, list):
        return [_move(s, device) for s in state]
    return state


def _reduce(metric: Metric, earlier: dict[str, Any]) -> None:
    merge_state = getattr(metric, "merge_state", None)
    if merge_state is not None and metric.full_state_update is False and not metric.dist_sync_on_step:
        merge_state(earlier)
    else:
        metric._reduce_states(earlier)


def merge_in_order(metric: Metric, parts: Sequence[Metric]) -> None:
    """Append the states of ``parts`` (in order) after the state ``metric`` already holds."""
    updated = [p for p in parts if p._update_count > 0]
    if not updated:
        return
    device = metric.device
    start = metric._update_count
    for part in updated:
        # torchmetrics reduces (incoming, own) with the incoming state first: hand it the state
        # accumulated so far as "incoming" so list states keep their order
        earlier = {name: getattr(metric, name) for name in metric._defaults}
        for name in metric._defaults:
            setattr(metric, name, _move(getattr(part, name), device))
        metric._update_count += 1  # mean states weigh each merged part once
        _reduce(metric, earlier)
    # the module's metric saw as many updates as one device would have made
    metric._update_count = start + max(p._update_count for p in updated)
    metric._computed = None


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
                parent._modules[leaf] = copy

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
                return head.compute() if head._update_count else None
        return None

    def clear(self) -> None:
        self._copies.clear()
