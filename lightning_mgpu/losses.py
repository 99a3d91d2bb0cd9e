"""Losses that stay exact however a batch is split: ``global_mean``, and where it learns about the split.

A loss that is a mean over rows (``mse_loss``, ``cross_entropy`` with their default
``reduction="mean"``) survives any split of the batch: every ``mgpu_*`` strategy weights each
part's loss by its share of the rows. A sum (``reduction="sum"``) or a mean over a count that
is not the rows (``err.sum() / mask.sum()``, the usual masked-token loss) does not: on two
devices the step differs from the single-device one, silently. ``global_mean(total, count)``
divides by the count of the *whole* batch instead of the part's:

- **DDP / FSDP ranks**: one all-reduce of the count (a scalar) per call; the loss is scaled by
  the number of ranks because their gradients are averaged.
- **``mgpu_dp`` replicas**: the replicas of a step add up their counts through the strategy
  (``ReplicaPart``, set in each replica's thread), and the loss undoes the row share the
  strategy weights it with.
- **micro-batches**: the micro-batches of one batch run one after the other, so no micro-batch
  knows the whole count while its backward runs. Each one's loss is its own mean; the
  micro-batching weights it by its count and divides the gradients by the whole batch's count
  (all ranks, through the step's one all-reduce) once every micro-batch is done (``MicroCounts``).
  Under micro-batching a ``training_step`` may hold one ``global_mean`` term, and other terms
  added to it are then weighted by the count of their micro-batch rather than its rows. The loss
  returned, and a value ``global_mean`` returned that is logged as it is (``self.log("loss", loss)``),
  are combined over the micro-batches with the same weights: they show what the unsplit step shows.
- **``accumulate_grad_batches``**: Lightning averages the losses of the accumulated batches, each
  divided by its own global count. That equals one step on all of them only when every
  accumulated batch has the same global count (a sum over rows with equal batch sizes, tokens of
  fixed length); with varying token counts it is the mean of per-batch means, as on one device
  with the same setting. Exact token weighting across accumulated batches would need the counts
  of batches not loaded yet.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "MicroCounts",
    "ReplicaPart",
    "global_mean",
    "is_micro_mean",
    "micro_counts",
    "note_micro_mean",
    "replica_step_context",
]


@dataclass(frozen=True)
class ReplicaPart:
    """What one ``mgpu_dp`` replica thread knows about its part of the step.

    Attributes:
        index: the replica's position.
        sizes: rows of every replica's chunk; the strategy weights replica ``i``'s loss by
            ``sizes[i] / sum(sizes)``.
        add_up: called by every replica with ``(index, count)``; returns the sum over the
            replicas (a rendezvous of the replica threads).
    """

    index: int
    sizes: Sequence[int]
    add_up: Callable[[int, Tensor], Tensor]


@dataclass
class MicroCounts:
    """What ``global_mean`` saw and gave in the micro-batch being run.

    Attributes:
        counts: The count of each call (with ``mgpu_dp`` replicas: summed over them, given once).
        means: The values it returned, and those ``mgpu_dp`` combined from them over its replicas
            (``note_micro_mean``): logged as they are, micro-batching weights them by the counts.
    """

    counts: list[Tensor] = field(default_factory=list)
    means: list[Tensor] = field(default_factory=list)


_local = threading.local()
# micro-batches run in the main thread; replicas inside a micro-batch run in other threads
_micro: list[MicroCounts] = []


def _sum_on_first(counts: list[Tensor]) -> Tensor:
    return sum((c.to(counts[0].device) for c in counts[1:]), counts[0])


def replica_step_context(
    step_context: Callable[[], AbstractContextManager[Any]],
    index: int,
    sizes: Sequence[int],
    rendezvous: Callable[[int, str, Any, Callable[[list[Any]], Any]], Any],
) -> Callable[[], AbstractContextManager[Any]]:
    """``step_context`` that also tells ``global_mean`` it runs in replica ``index`` of ``len(sizes)``.

    Args:
        step_context: the precision plugin's context for the step.
        index: the replica.
        sizes: rows of every replica's chunk.
        rendezvous: where the replicas meet, called ``(index, label, value, action)`` and
            returning ``action(values of every replica)`` (``dp.lockstep.Lockstep.run``).
    """

    def add_up(i: int, count: Tensor) -> Tensor:
        return rendezvous(i, "global_mean", count, _sum_on_first)

    part = ReplicaPart(index, sizes, add_up)

    @contextmanager
    def context() -> Iterator[None]:
        previous = getattr(_local, "part", None)
        _local.part = part  # global_mean calls in this thread run in replica ``index``
        try:
            with step_context():
                yield
        finally:
            _local.part = previous

    return context


@contextmanager
def micro_counts(counts: MicroCounts) -> Iterator[MicroCounts]:
    """Record in ``counts`` the count each ``global_mean`` call of this micro-batch gives."""
    _micro.append(counts)
    try:
        yield counts
    finally:
        _micro.remove(counts)


def is_micro_mean(value: Any) -> bool:
    """Whether ``value`` is a mean ``global_mean`` gave in the micro-batch running now (the very tensor)."""
    return bool(_micro) and any(value is mean for mean in _micro[-1].means)


def note_micro_mean(value: Tensor) -> None:
    """Count ``value``, made from ``global_mean``'s values alone (replicas' parts combined), as one too."""
    if _micro:
        _micro[-1].means.append(value)


def _as_count(count: Any, like: Tensor) -> Tensor:
    import torch

    value = torch.as_tensor(count, device=like.device).detach()
    if not value.is_floating_point():
        value = value.to(torch.float64 if like.dtype == torch.float64 else torch.float32)
    if value.dim() != 0:
        raise ValueError(
            f"global_mean: `count` must be a number or a 0-dim tensor (the rows or tokens `total` sums over),"
            f" got a tensor of shape {tuple(value.shape)}. Pass e.g. `mask.sum()`."
        )
    return value


def global_mean(total: Tensor, count: Any) -> Tensor:
    """The mean over the whole global batch, from this part's ``total`` and ``count``.

    Use it for a loss that is a sum over rows or tokens divided by how many there are::

        def training_step(self, batch, batch_idx):
            x, y, mask = batch
            err = (self(x) - y) ** 2 * mask
            return lightning_mgpu.global_mean(err.sum(), mask.sum())  # not err.sum() / mask.sum()

    The gradient of the returned loss, after the strategy combined the parts, equals that of
    ``sum of totals / sum of counts`` over the whole global batch on one device, whichever way the
    batch was split: ``mgpu_ddp`` / ``mgpu_fsdp`` ranks, ``mgpu_dp`` replicas, micro-batches (see
    the module docstring for ``accumulate_grad_batches``). On one device it is ``total / count``.

    The value returned is this part's share: under DDP the mean over ranks of the returned
    values (``self.log(..., sync_dist=True)``) is the global mean; under ``mgpu_dp`` the strategy's
    own weighting of the replicas' values gives it.

    Every part must call it the same number of times (ranks meet in an all-reduce, replicas in
    a rendezvous), also when its part holds no valid token (``count`` 0).

    Args:
        total: the sum of the per-row or per-token losses of this part (a tensor with a graph).
        count: how many rows or tokens ``total`` sums over (a number or a 0-dim tensor; no
            gradient flows through it).

    Returns:
        The loss to return from ``training_step`` (or to add to other terms).

    Raises:
        ValueError: if ``count`` is not a scalar.
    """
    import torch
    import torch.distributed as dist

    mine = _as_count(count, total)
    part: ReplicaPart | None = getattr(_local, "part", None)
    share = None
    if part is not None:
        rows = part.sizes[part.index]
        share = sum(part.sizes) / rows  # undoes the strategy's weighting of this replica by its rows
        mine = part.add_up(part.index, mine).to(total.device)
    if _micro:
        # the whole count is known once every micro-batch ran: the micro-batching rescales then
        if part is None or part.index == 0:
            _micro[-1].counts.append(mine)
        mean = total / torch.where(mine > 0, mine, torch.ones_like(mine))
        mean = mean * share if share is not None else mean
        _micro[-1].means.append(mean)  # from every replica: each one's value may be logged
        return mean
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world > 1:
        mine = mine.clone()
        dist.all_reduce(mine)
        total = total * world  # DDP and FSDP average the ranks' gradients
    mean = total / mine
    return mean * share if share is not None else mean
