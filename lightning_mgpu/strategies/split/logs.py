"""``self.log`` inside parts of a batch (replicas, micro-batches): captured per part, replayed once.

- ``LogCapture`` stands in for ``self.log`` while one part runs and records its calls;
- ``replay_logs`` logs once on the module what the parts logged: the mean weighted by the parts'
  rows (or the ``batch_size`` they passed), or the sum / max / min their ``reduce_fx`` asks for;
  a value ``global_mean`` returned in micro-batches is weighted by their counts instead
  (``lightning_mgpu.losses``), as the gradients are.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor
from torchmetrics import Metric

from lightning_mgpu.losses import is_micro_mean, note_micro_mean
from lightning_mgpu.strategies.split.batch import weighted_mean

__all__ = ["LogCapture", "replay_logs"]


@functools.cache
def _log_signature() -> inspect.Signature:
    return inspect.signature(LightningModule.log)


class LogCapture:
    """Stands in for ``self.log`` inside one part of a batch.

    Attributes:
        calls: name -> the value and the options of its last ``self.log`` call.
        micro_means: The names logged with a value ``global_mean`` returned in a micro-batch.
    """

    def __init__(self) -> None:
        self.calls: dict[str, tuple[Any, dict[str, Any]]] = {}
        self.micro_means: set[str] = set()

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        options = dict(_log_signature().bind(None, name, value, *args, **kwargs).arguments)
        for key in ("self", "name", "value"):
            options.pop(key, None)
        self.calls[name] = (value, options)
        if is_micro_mean(value):
            self.micro_means.add(name)
        else:
            self.micro_means.discard(name)


_FOLDS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "sum": torch.add,
    "max": torch.maximum,
    "min": torch.minimum,
}
"""How the values of the parts fold into one, by ``reduce_fx``; a mean is weighted instead."""


def _reduction(reduce_fx: Any) -> str:
    if isinstance(reduce_fx, str):
        name = reduce_fx.lower()
        return "mean" if name == "avg" else name
    for name, fns in (("sum", (torch.sum, sum)), ("max", (torch.max, max)), ("min", (torch.min, min))):
        if reduce_fx in fns:
            return name
    return "mean"  # torch.mean; Lightning rejects other reductions with its own message when logged


def replay_logs(
    module: LightningModule,
    captures: Sequence[LogCapture],
    sizes: Sequence[int],
    device: torch.device,
    originals: dict[int, Metric],
    shares: Sequence[Tensor] | None = None,
) -> None:
    """Log once on ``module`` what the parts of a batch logged.

    A value is the mean of the parts' values weighted by their rows (``sizes``, or the
    ``batch_size`` they passed), or their sum / max / min when ``reduce_fx`` says so. A metric
    object logged in a part is replaced by the module's own metric (``originals``: copy id -> metric).

    ``shares`` (micro-batches, when the step used ``global_mean``): each part's weight in the batch's
    ``global_mean``, its count over the whole count, as its gradients got it. A mean that every part
    logged from ``global_mean`` is then the sum of each part's value times its share, the value of the
    unsplit step; without ``shares`` (``mgpu_dp``'s replicas, whose values ``global_mean`` already
    scaled to their rows) the mean by rows gives it, and the result counts as ``global_mean``'s again.
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
        kind = _reduction(options.get("reduce_fx", "mean"))
        means = kind == "mean" and all(name in c.micro_means for c in captures)
        if means and shares is not None:
            combined = functools.reduce(
                torch.add, (v * s.to(device, v.dtype) for v, s in zip(values, shares, strict=True))
            )
        elif kind in _FOLDS:
            combined = functools.reduce(_FOLDS[kind], values)
        else:
            combined = weighted_mean(values, weights, device)
        if means:
            note_micro_mean(combined)
        module.log(name, combined, **options)
