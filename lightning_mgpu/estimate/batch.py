"""What a batch holds: its rows as Lightning counts them, its tensors, and a copy with other rows.

``batch_rows`` is the package's one reading of a batch's size, used by the estimate and by
``DeviceMemoryMonitor``; it is Lightning's ``extract_batch_size`` without the warning meant for
``self.log`` calls.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from lightning.pytorch.utilities.data import extract_batch_size, warning_cache
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_mgpu._compat.torch import tree_flatten

__all__ = ["batch_rows", "resized", "tensors"]

_AMBIGUOUS = "Trying to infer the `batch_size` from an ambiguous collection"


def batch_rows(batch: Any) -> int | None:
    """The rows of ``batch`` as Lightning counts them: the first dimension of its first tensor.

    ``None`` when the batch holds no tensor. Lightning warns about a batch whose tensors disagree
    and tells the user to pass ``batch_size`` to ``self.log``; that advice is for logging, not for
    this reading, so the warning is neither shown here nor kept from Lightning's own later calls.

    Example::

        import torch
        from lightning_mgpu.estimate.batch import batch_rows

        batch_rows((torch.zeros(16, 3), torch.zeros(16)))  # 16
        batch_rows({"ids": [1, 2]})                       # None
    """
    # the common shapes, read as Lightning reads them (its first tensor), without its warning filters
    first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if isinstance(first, torch.Tensor):
        return 1 if first.ndim == 0 else int(first.shape[0])
    seen = set(warning_cache)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_AMBIGUOUS)
            return extract_batch_size(batch)
    except MisconfigurationException:
        return None
    finally:
        warning_cache.intersection_update(seen)


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nested collection, in order."""
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def resized(batch: Any, rows: int, new_rows: int) -> Any:
    """``batch`` with ``new_rows`` rows in each tensor of ``rows`` rows (cut, or repeated and cut)."""

    def resize(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] != rows:
            return t
        if new_rows < rows:
            return t[:new_rows].clone()
        return t.repeat(math.ceil(new_rows / rows), *([1] * (t.dim() - 1)))[:new_rows]

    return apply_to_collection(batch, torch.Tensor, resize)
