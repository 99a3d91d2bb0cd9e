"""The gradients of one batch run in micro-batches: kept apart until every rank succeeded, synced once.

Lightning zeroes the gradients *after* ``training_step`` returns and before its backward,
and under ``"auto"`` a failed attempt's gradients must be dropped without losing those of
earlier accumulated batches. ``BatchGradients`` therefore:

- at the start takes the gradients the parameters hold out of them: dropped at once when
  Lightning is about to zero them anyway (so no second copy lives through the micro-batches),
  kept aside otherwise (the later batches of ``accumulate_grad_batches``, which therefore hold
  a second copy of the gradients while they run): this batch's own gradients must stay apart
  to be dropped after a failed attempt, or scaled by the count ``global_mean`` saw;
- lets the micro-batches' backward passes accumulate into empty ``.grad`` fields, and empties
  them again when an attempt fails;
- once the batch succeeded, scales them, adds the kept ones, averages them over the ranks
  (one flat all-reduce per bucket, as DDP would have in backward) and, when Lightning is about
  to zero the gradients, holds them until ``restore`` puts them back after the zeroing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_mgpu._compat.torch import flatten_dense_tensors, unflatten_dense_tensors

__all__ = ["BatchGradients", "average_over_ranks"]

_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb
_OWN_BYTES = 1024 * 1024  # a gradient this large is reduced in place: copying it costs more than a call


def average_over_ranks(grads: Sequence[Tensor], world_size: int) -> None:
    """All-reduce ``grads`` in place and divide by ``world_size``.

    Large contiguous gradients are reduced where they lie, all at once; the small ones in flat
    buckets of one dtype and device.
    """
    large = [g for g in grads if g.is_contiguous() and g.numel() * g.element_size() >= _OWN_BYTES]
    works = [dist.all_reduce(grad, async_op=True) for grad in large]
    buckets: dict[tuple[torch.dtype, torch.device], list[list[Tensor]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    chosen = {id(g) for g in large}
    for grad in grads:
        if id(grad) in chosen:
            continue
        key = (grad.dtype, grad.device)
        nbytes = grad.numel() * grad.element_size()
        if key not in buckets or sizes[key] + nbytes > _BUCKET_BYTES:
            buckets.setdefault(key, []).append([])
            sizes[key] = 0
        buckets[key][-1].append(grad)
        sizes[key] += nbytes
    for groups in buckets.values():
        for group in groups:
            flat = flatten_dense_tensors(group)
            dist.all_reduce(flat)
            flat.div_(world_size)
            for grad, synced in zip(group, unflatten_dense_tensors(flat, group), strict=True):
                grad.copy_(synced)
    for work, grad in zip(works, large, strict=True):
        work.wait()
        grad.div_(world_size)


class BatchGradients:
    """The ``.grad`` fields of ``module``'s trainable parameters while one batch runs in micro-batches.

    Args:
        module: the LightningModule.
        zeroing: whether Lightning zeroes the gradients after this ``training_step``.
    """

    def __init__(self, module: nn.Module, zeroing: bool) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.zeroing = zeroing
        self._pending: list[Tensor | None] | None = None
        # dropped (Lightning would zero them) or kept aside until the batch succeeded
        self._held = None if zeroing else [p.grad for p in self.params]
        self.drop_attempt()  # the micro-batches accumulate into empty fields

    def drop_attempt(self) -> None:
        """Empty the ``.grad`` fields: free what a failed attempt accumulated."""
        for p in self.params:
            p.grad = None

    def finish(self, scale: float | Tensor | None, world_size: int) -> None:
        """Scale this batch's gradients, add the kept ones, average over ``world_size`` ranks."""
        grads = [p.grad for p in self.params]
        if scale is not None:
            for grad in grads:
                if grad is not None:
                    grad.mul_(scale)
        if self._held is not None:
            for p, held in zip(self.params, self._held, strict=True):
                if held is not None:
                    p.grad = held if p.grad is None else held.add_(p.grad)
            self._held = None
        if world_size > 1:
            # a parameter this rank did not use still takes part, with zeros, as under DDP
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            average_over_ranks([p.grad for p in self.params if p.grad is not None], world_size)
        if self.zeroing:
            self._pending = [p.grad for p in self.params]
            for p in self.params:
                p.grad = None

    def restore(self) -> None:
        """Put the batch's gradients back after Lightning zeroed the parameters' ``.grad``."""
        if self._pending is None:
            return
        for p, grad in zip(self.params, self._pending, strict=True):
            if grad is not None:
                p.grad = grad if p.grad is None else p.grad.add_(grad)
        self._pending = None
