"""What the training and the inference measurements share: copies of the module, byte counts, results.

- ``make_copies`` copies a module's parameters and buffers (and a sample batch) to the measuring
  device (``meta`` or CPU), in the precision measured, with a call that runs a step on them
  through ``torch.func.functional_call``, so the module itself is left as it was (a sharded
  parameter is copied to ``meta`` by its global shape);
- ``sample_sizes`` picks the two batch sizes measured; ``fixed_and_slope`` a byte count through them.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.func import functional_call
from torch.utils.weak import WeakIdKeyDictionary

from lightning_mgpu.estimate.batch import batch_rows
from lightning_mgpu.estimate.live_bytes import storage_of

__all__ = [
    "Copies",
    "StepCall",
    "fixed_and_slope",
    "forward_step",
    "make_copies",
    "meta_like",
    "quiet_lightning",
    "sample_sizes",
    "unique_bytes",
]


def fixed_and_slope(b1: int, v1: float, b2: int, v2: float) -> tuple[float, float]:
    """``(fixed, slope)`` of the line ``fixed + slope * batch`` bytes through two measurements."""
    slope = max(0.0, (v1 - v2) / (b1 - b2))
    return v1 - slope * b1, slope


class StepCall(nn.Module):
    """Lets ``functional_call`` run any step function, not only ``forward``."""

    def __init__(self, module: nn.Module, step: Callable[[nn.Module, Any], Any]) -> None:
        super().__init__()
        self.module = module
        self._step = step

    def forward(self, batch: Any) -> Any:
        return self._step(self.module, batch)


def forward_step(module: nn.Module, batch: Any) -> Any:
    """The step of a plain ``nn.Module``: ``module(batch)``."""
    return module(batch)


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Silence Lightning's warnings about a module used without a Trainer, which measuring does on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*self\.trainer.*")
        warnings.filterwarnings("ignore", message=r".*configure_optimizers.*")
        yield


def unique_bytes(tensors: list[torch.Tensor], min_dim: int = 0) -> int:
    """Bytes of the storages behind ``tensors``, each once (a view keeps its whole storage alive); tensors
    under ``min_dim`` dimensions skipped, one without a storage (sparse) counted by its elements."""
    seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
    total = 0
    for t in tensors:
        st = storage_of(t)
        if t.dim() < min_dim or (st is not None and st in seen):
            continue
        if st is None:
            total += t.numel() * t.element_size()
        else:
            seen[st] = True
            total += int(st.nbytes())
    return total


def meta_like(t: torch.Tensor, dtype: torch.dtype | None, local: bool = False) -> torch.Tensor:
    """A meta tensor of ``t``'s shape, in ``dtype`` if ``t`` is floating-point: a sharded ``DTensor`` by its
    global shape, or by this rank's shard with ``local``."""
    if local and hasattr(t, "to_local"):
        t = t.to_local()
    dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
    return torch.empty(t.shape, dtype=dtype, device="meta").requires_grad_(t.requires_grad)


@dataclass
class Copies:
    """The module's tensors copied to the measuring device, and a call running the step on them."""

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    leaf_of: dict[int, torch.Tensor]
    call: Callable[[Any], Any]

    @property
    def static(self) -> list[torch.Tensor]:
        return [*self.params.values(), *self.buffers.values()]


def make_copies(
    module: nn.Module,
    sample_batch: Any,
    step: Callable[[nn.Module, Any], Any],
    device: torch.device,
    param_dtype: torch.dtype | None,
    autocast_dtype: torch.dtype | None,
) -> tuple[Copies, Any]:
    """The copies, and a copy of ``sample_batch`` (the caller holds it, so it can free it)."""

    def copy(t: torch.Tensor) -> torch.Tensor:
        if device.type == "meta" and hasattr(t, "to_local"):
            # a sharded parameter (a DTensor, under mgpu_fsdp) counts by its global shape
            return meta_like(t, param_dtype)
        dtype = param_dtype if param_dtype is not None and t.is_floating_point() else t.dtype
        return t.detach().to(device=device, dtype=dtype, copy=True).requires_grad_(t.requires_grad)

    named = dict(module.named_parameters())
    params = {name: copy(p) for name, p in named.items()}
    buffers = {name: copy(b) for name, b in module.named_buffers()}
    wrapper = StepCall(module, step)
    tensors = {f"module.{k}": v for k, v in {**params, **buffers}.items()}
    autocast: Any = contextlib.nullcontext()
    if autocast_dtype is not None:
        autocast = torch.autocast(device.type, dtype=autocast_dtype)

    def call(batch: Any) -> Any:
        with autocast:
            return functional_call(wrapper, tensors, (batch,))

    leaf_of = {id(p): params[name] for name, p in named.items()}
    return Copies(params, buffers, leaf_of, call), apply_to_collection(sample_batch, torch.Tensor, copy)


def sample_sizes(sample_batch: Any) -> tuple[int, int]:
    """The two batch sizes measured: the sample's, and half of it (or 2 for a sample of one row).

    Raises:
        ValueError: if the sample holds no tensor.
    """
    b1 = batch_rows(sample_batch)
    if b1 is None:
        raise ValueError("the sample batch holds no tensor: give one batch as the DataLoader yields it")
    return b1, b1 // 2 if b1 >= 2 else 2
