"""Count the bytes tensors hold, on any device including ``meta``: live while ops run, saved for backward.

``LiveBytes``: a ``TorchDispatchMode`` sees every op's outputs; each new storage is counted once and
uncounted when it is freed (a weak reference on the storage, which torch keeps unique
while the storage lives). This is what a device's caching allocator would hold, minus
its rounding and cache, so it works on CPU and on meta tensors where no allocator
statistics exist.

``unique_bytes``: the bytes of a list of tensors' storages, each once.

``SavedBytes``: the bytes autograd keeps for backward, counted once per storage. The one
counter of them: the estimate's activations per sample and ``mgpu_dp``'s per-replica
``replica_saved_bytes`` both come from it.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from lightning_mgpu._compat.torch import TorchDispatchMode, tree_flatten

__all__ = ["LiveBytes", "SavedBytes", "storage_of", "unique_bytes"]


def storage_of(t: torch.Tensor) -> Any | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse and other layouts without one storage
        return None


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


class LiveBytes(TorchDispatchMode):
    """Live and peak bytes of the storages on ``device`` that ops create, plus those added by ``track``.

    Args:
        device: only storages on this device type count (``"cpu"`` or ``"meta"``).
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device_type = device.type
        self.live = 0
        self.peak = 0
        self._known: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: list[weakref.ref] = []

    def track(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage until it is freed (no-op if already counted or on another device)."""
        if t.device.type != self.device_type:
            return
        st = storage_of(t)
        if st is None or st in self._known:
            return
        n = int(st.nbytes())
        self._known[st] = n
        self.live += n
        self.peak = max(self.peak, self.live)
        self._refs.append(weakref.ref(st, functools.partial(self._free, n)))

    def track_all(self, tensors: list[torch.Tensor]) -> None:
        """``track`` each tensor (a function, so no loop variable keeps the last one alive)."""
        for t in tensors:
            self.track(t)

    def _free(self, n: int, _ref: Any = None) -> None:
        self.live -= n

    @contextmanager
    def phase(self) -> Iterator[dict[str, int]]:
        """Measure the peak of a stretch of work: yields a dict that holds ``peak`` afterwards."""
        self.peak = self.live
        result: dict[str, int] = {}
        try:
            yield result
        finally:
            result["peak"] = self.peak

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


class SavedBytes:
    """Bytes of the storages autograd saves for backward, each storage counted once.

    A storage counts for the span its saved tensors cover: a whole activation, or a chunk of a
    batch that several ``mgpu_dp`` replicas share (each replica counts its own rows). Storages of
    ``exclude`` (parameters, buffers, the batch: memory that lives anyway) do not count.

    Install with ``torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack)``.

    Args:
        exclude: tensors whose storages are not counted.

    Example::

        import torch
        from lightning_mgpu.estimate.live_bytes import SavedBytes

        w = torch.randn(8, 8, requires_grad=True)
        counter = SavedBytes(exclude=[w])
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            (torch.randn(4, 8) @ w).tanh().sum()
        counter.total  # 128 + 128: the input and tanh's output, 4 x 8 float32 each
    """

    def __init__(self, exclude: Sequence[torch.Tensor] = ()) -> None:
        self.total = 0
        self._spans: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> (start, end) bytes counted
        self._excluded: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for t in exclude:
            st = storage_of(t)
            if st is not None:
                self._excluded[st] = True

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = storage_of(t)
        if st is None:  # no storage to share (sparse, nested): its own elements
            self.total += t.numel() * t.element_size()
            return t
        if st in self._excluded or t.numel() == 0:
            return t
        size = t.element_size()
        start = int(t.storage_offset()) * size
        end = start + (1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True))) * size
        old = self._spans.get(st)
        if old is not None:
            start, end = min(start, old[0]), max(end, old[1])
            self.total -= old[1] - old[0]
        self._spans[st] = (start, end)
        self.total += end - start
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t
