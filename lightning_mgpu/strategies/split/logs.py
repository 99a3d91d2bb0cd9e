"""``self.log`` inside parts of a batch (replicas, micro-batches): captured per part, replayed once.

- ``LogCapture`` stands in for ``self.log`` while one part runs and records its calls;
- ``replay_logs`` logs once on the module what the parts logged: the mean weighted by the parts'
  rows (or the ``batch_size`` they passed), or the sum / max / min their ``reduce_fx`` asks for.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor
from torchmetrics import Metric

from lightning_mgpu.strategies.split.batch import weighted_mean

__all__ = ["LogCapture", "replay_logs"]


@functools.cache
def _log_signature() -> inspect.Signature:
    return inspect.signature(LightningModule.log)


class LogCapture:
    """Stands in for ``self.log`` inside one part of a batch."""

    def __init__(self) -> None:
        self.calls: dict[str, tuple[Any, dict[str, Any]]] = {}

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        options = dict(_log_signature().bind(None, name, value, *args, **kwargs).arguments)
        for key in ("self", "name", "value"):
            options.pop(key, None)
        self.calls[name] = (value, options)


def _reduction(reduce_fx: Any) -> str:
    if isinstance(reduce_fx, str):
        name = reduce_fx.lower()
        return "mean" if name == "avg" else name
    for name, fns in (("mean", (torch.mean,)), ("sum", (torch.sum, sum)), ("max", (torch.max, max))):
        if reduce_fx in fns:
            return name
    if reduce_fx in (torch.min, min):
        return "min"
    return "mean"  # Lightning rejects other reductions with its own message when the value is logged


def _combine_logged(values: list[Tensor], weights: Sequence[float], reduce_fx: Any) -> Tensor:
    kind = _reduction(reduce_fx)
    if kind == "sum":
        return functools.reduce(torch.add, values)
    if kind == "max":
        return functools.reduce(torch.maximum, values)
    if kind == "min":
        return functools.reduce(torch.minimum, values)
    return weighted_mean(values, weights, values[0].device)


def replay_logs(
    module: LightningModule,
    captures: Sequence[LogCapture],
    sizes: Sequence[int],
    device: torch.device,
    originals: dict[int, Metric],
) -> None:
    """Log once on ``module`` what the parts of a batch logged.

    A value is the mean of the parts' values weighted by their rows (``sizes``, or the
    ``batch_size`` they passed), or their sum / max / min when ``reduce_fx`` says so. A metric
    object logged in a part is replaced by the module's own metric (``originals``: copy id -> metric).
    """
    names = dict.fromkeys(name for capture in captures for name in capture.calls)
    for name in names:
        entries = [(n, c.calls[name]) for n, c in zip(sizes, captures, strict=True) if name in c.calls]
        value, options = entries[0][1]
        options = dict(options)
        if isinstance(value, Metric):
            module.log(name, originals.get(id(value), value), **options)
            continue
        given = [float(opts["batch_size"]) for _, (_, opts) in entries if opts.get("batch_size") is not None]
        if len(given) == len(entries):
            weights = given
            options["batch_size"] = int(sum(weights))
        else:
            weights = [float(n) for n, _ in entries]
        values = [
            v.to(device) if isinstance(v, Tensor) else torch.tensor(v, device=device) for _, (v, _) in entries
        ]
        module.log(name, _combine_logged(values, weights, options.get("reduce_fx", "mean")), **options)
