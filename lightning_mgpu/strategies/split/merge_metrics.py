"""torchmetrics updated on parts of a batch (replicas, micro-batches), merged into the module's own metric.

Each part updates its own copy of a ``Metric``; ``merge_in_order`` then merges the copies' states into
the module's metric in the parts' order, so the merged state holds exactly what one device would have
accumulated over the whole batch, and ``compute()`` gives the single-device value.

Merging uses ``Metric.merge_state`` (torchmetrics >= 1.6). Where it is missing, or where it refuses
the metric (``full_state_update`` not ``False``, ``dist_sync_on_step=True``), the same per-state
reductions run through ``Metric._reduce_states`` (``_compat/torchmetrics.py``): the reductions
(``dist_reduce_fx``) that a DDP sync applies across processes.

``PartMetrics`` holds the copies: one per part, kept from batch to batch and reset before each part
runs. A part that updated the module's own metric would share its state tensors with the other parts
(torchmetrics keeps them as plain attributes), and ``mgpu_dp``'s replicas update them from several
threads at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_mgpu._compat.torch import ORIG_MOD
from lightning_mgpu._compat.torchmetrics import (
    clear_computed,
    reduce_states,
    set_forward_cache,
    set_update_count,
    state_names,
    update_count,
)

__all__ = ["PartMetrics", "merge_in_order", "metric_paths", "replica_path"]


def metric_paths(module: nn.Module) -> list[str]:
    """Dotted paths of the ``Metric`` submodules of ``module``, not those nested inside another metric."""
    paths: list[str] = []
    for name, sub in module.named_modules():
        if name and isinstance(sub, Metric) and not any(name.startswith(p + ".") for p in paths):
            paths.append(name)
    return paths


def _reduce(metric: Metric, earlier: dict[str, Any]) -> None:
    merge_state = getattr(metric, "merge_state", None)
    if merge_state is not None and metric.full_state_update is False and not metric.dist_sync_on_step:
        merge_state(earlier)
    else:
        reduce_states(metric, earlier)


def merge_in_order(metric: Metric, parts: Sequence[Metric]) -> None:
    """Append the states of ``parts`` (in order) after the state ``metric`` already holds."""
    updated = [p for p in parts if update_count(p) > 0]
    if not updated:
        return
    device = metric.device
    start = update_count(metric)
    for part in updated:
        # torchmetrics reduces (incoming, own) with the incoming state first: hand it the state
        # accumulated so far as "incoming" so list states keep their order
        names = state_names(metric)
        earlier = {name: getattr(metric, name) for name in names}
        for name in names:
            setattr(metric, name, apply_to_collection(getattr(part, name), Tensor, Tensor.to, device))
        set_update_count(metric, update_count(metric) + 1)  # mean states weigh each merged part once
        _reduce(metric, earlier)
    # the module's metric saw as many updates as one device would have made
    set_update_count(metric, start + max(update_count(p) for p in updated))
    clear_computed(metric)


def replica_path(name: str) -> str:
    """Where the module's submodule or tensor ``name`` lies in a replica, which holds no compile wrappers."""
    return ".".join(part for part in name.split(".") if part != ORIG_MOD)


def _place(tree: nn.Module, path: str, metric: Metric) -> None:
    """Put ``metric`` at ``path`` in ``tree`` (the module, or a replica of it)."""
    parent_path, _, leaf = replica_path(path).rpartition(".")
    parent = tree.get_submodule(parent_path) if parent_path else tree
    setattr(parent, leaf, metric)  # nn.Module puts a module value among its children


class PartMetrics:
    """Each part of a batch (a replica, a micro-batch) gets a fresh copy of every metric; merged after it.

    Example::

        metrics.begin(module)
        metrics.put(replica, 0, device)  # or the module itself: a micro-batch, put_back after it
        originals = metrics.merge()  # id(copy) -> the module's metric
    """

    def __init__(self) -> None:
        self._copies: dict[str, tuple[Metric, list[Metric]]] = {}
        self._used = 0

    def begin(self, module: nn.Module) -> None:
        """Find ``module``'s metrics for a new batch; copies of metrics it no longer holds are dropped."""
        copies: dict[str, tuple[Metric, list[Metric]]] = {}
        for path in metric_paths(module):
            original = module.get_submodule(path)
            assert isinstance(original, Metric)
            entry = self._copies.get(path)
            copies[path] = entry if entry is not None and entry[0] is original else (original, [])
        self._copies = copies
        self._used = 0

    def put(self, tree: nn.Module, index: int, device: torch.device | None = None) -> None:
        """Part ``index`` updates its own (reset) copy of every metric, placed in ``tree``.

        The copies go to ``device``; ``None``: each to its metric's device.
        """
        self._used = max(self._used, index + 1)
        for path, (original, copies) in self._copies.items():
            while len(copies) <= index:
                copies.append(original.clone())
            copy = copies[index]
            copy.reset()
            if copy.device != (device or original.device):
                copy.to(device or original.device)
            _place(tree, path, copy)

    def put_back(self, module: nn.Module) -> None:
        """The module's own metrics in place again (after a part that ran in the module itself)."""
        for path, (original, _) in self._copies.items():
            _place(module, path, original)

    def forget(self) -> None:
        """The parts run so far count for nothing (an attempt that failed)."""
        self._used = 0

    def merge(self) -> dict[int, Metric]:
        """Merge the copies used in this batch into the module's metrics.

        Each metric a part updated gets the whole batch's value as the one ``forward`` returned, which
        Lightning logs on step, whichever hook logs it (``training_step``, ``on_train_batch_end``, ...).

        Returns:
            ``id(copy) -> metric of the module`` for every copy used, to map a metric
            logged inside a part back to the module's own.
        """
        originals: dict[int, Metric] = {}
        for original, copies in self._copies.values():
            used = copies[: self._used]
            merge_in_order(original, used)
            originals.update((id(c), original) for c in used)
            if used:  # the whole batch's value: the copies merged into the first, as one forward gives it
                merge_in_order(used[0], used[1:])
                if update_count(used[0]):
                    set_forward_cache(original, used[0].compute())
        return originals

    def clear(self) -> None:
        """Drop every copy (the run ended)."""
        self._copies.clear()
