"""Predict what a training or inference step needs on each device, before anything runs.

- ``predict.py``: ``estimate_memory`` (public), and ``model_state_estimate``, the same before any batch
  (``mgpu_auto``'s numbers);
- ``memory_estimate.py``: the ``MemoryEstimate`` it returns, each strategy's peak from it (public),
  and its one table, for ``str(estimate)`` and ``lightning-mgpu estimate``;
- ``batch.py``: a batch's rows (Lightning's ``extract_batch_size``), its tensors, a resized copy;
- ``steps.py``: one warm-up and two measured training steps on copies of the module, or two
  measured forward passes under ``torch.no_grad()`` for inference;
- ``optimizer_state.py``: the one counter of optimizer state (an optimizer copied and stepped);
- ``model_state.py``: the model state a rank holds now, its shards beside the whole model's;
- ``live_bytes.py``: the one counter of bytes held by live tensors, on any device including ``meta``,
  of a list of tensors' storages, and of bytes saved for backward (also used by ``mgpu_dp`` for each
  replica).

``mgpu_fsdp``'s peak comes from its sharding plan and what it leaves on each device, which live with
neither the estimate nor the strategy but in ``lightning_mgpu._sharding``, which both use.

The public names load on first use, so ``mgpu_dp`` can use ``live_bytes`` without loading the rest.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_mgpu.estimate.predict import MemoryEstimate, estimate_memory

__all__ = ["MemoryEstimate", "estimate_memory"]

# Importing Lightning registers the mgpu_* strategies, and micro-batching's first size imports
# ``predict``. Importing Lightning here, before any module of this package starts (``batch.py``
# imports it), means that registration never meets an estimate module that is only half imported.
import lightning.pytorch  # noqa: E402, F401


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("lightning_mgpu.estimate.predict"), name)
    raise AttributeError(f"module 'lightning_mgpu.estimate' has no attribute {name!r}")
