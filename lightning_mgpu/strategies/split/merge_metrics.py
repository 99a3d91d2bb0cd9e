"""torchmetrics updated on parts of a batch (replicas, micro-batches), merged into the module's own metric.

Each part updates its own copy of a ``Metric``; ``merge_in_order`` then merges the copies' states into
the module's metric in the parts' order, so the merged state holds exactly what one device would have
accumulated over the whole batch, and ``compute()`` gives the single-device value.

Merging uses ``Metric.merge_state`` (torchmetrics >= 1.6). Where it is missing, or where it refuses
the metric (``full_state_update`` not ``False``, ``dist_sync_on_step=True``), the same per-state
reductions run through ``Metric._reduce_states`` (``_compat/torchmetrics.py``): the reductions
(``dist_reduce_fx``) that a DDP sync applies across processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric

from lightning_mgpu._compat.torch import ORIG_MOD
from lightning_mgpu._compat.torchmetrics import (
    clear_computed,
    reduce_states,
    set_update_count,
    state_names,
    update_count,
)

__all__ = ["merge_in_order", "metric_paths", "replica_path"]


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
            setattr(metric, name, _move(getattr(part, name), device))
        set_update_count(metric, update_count(metric) + 1)  # mean states weigh each merged part once
        _reduce(metric, earlier)
    # the module's metric saw as many updates as one device would have made
    set_update_count(metric, start + max(update_count(p) for p in updated))
    clear_computed(metric)


def replica_path(name: str) -> str:
    """Where the module's submodule or tensor ``name`` lies in a replica, which holds no compile wrappers."""
    return ".".join(part for part in name.split(".") if part != ORIG_MOD)
