"""How the ranks of a micro-batched step learn of each other's out-of-memory errors, none left waiting.

Every exchange is one all-reduce of the same small float64 vector, whoever calls it:
``[status of rank 0, ..., status of rank N-1, global_mean count, ranks at the end]``.

- ``agree``: the end of an attempt. Each rank gives its status (``OK``, ``RETRY``: it ran
  out of memory and will run the batch again smaller, ``FATAL``: not even one row fits) and
  the count ``global_mean`` saw.
- ``checkpoint``: a point inside a forward or backward pass (``mgpu_fsdp`` puts one around
  every unit, because its passes gather parameters collectively: a rank that fails between two
  gathers must meet the others before their next one). A rank passing it gives zeros; when
  another rank's status is not ``OK`` it raises ``PeerOutOfMemory`` and the attempt is
  abandoned on every rank.

A rank that fails calls ``agree`` while the others may still be at a checkpoint; both calls
are the same all-reduce, so they meet. The last entry tells ``agree`` whether every rank was
at the end: if not, the others now abandon their pass and come to ``agree`` as well, so it
runs again until all meet there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["FATAL", "OK", "RETRY", "Agreement", "PeerOutOfMemory", "Verdict"]

log = logging.getLogger(__name__)

OK, RETRY, FATAL = 0, 1, 2


class PeerOutOfMemory(Exception):
    """Another rank ran out of memory in this attempt: this rank abandons its pass to rerun the batch."""


@dataclass(frozen=True)
class Verdict:
    """What the ranks agreed on at the end of an attempt.

    Attributes:
        statuses: Rank -> its status (``OK``, ``RETRY``, ``FATAL``), for every rank that took part.
        count: The ``global_mean`` count summed over every rank, when the step used it.
    """

    statuses: dict[int, int]
    count: Tensor | None


class Agreement:
    """The exchanges of one rank (``world`` ranks, tensors on ``device``).

    Args:
        rank: This process's global rank.
        world: The number of ranks; with one, nothing is exchanged: the rank decides alone (a
            ``predict_step`` that no collective ties to the other ranks), whatever its rank.
        device: Where the vector lives (the process group's device: CUDA under NCCL).
    """

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank = rank
        self.world = world
        self.device = device

    def _exchange(self, status: int, count: Tensor | None, at_end: bool) -> Tensor:
        vector = torch.zeros(self.world + 2, dtype=torch.float64, device=self.device)
        vector[self.rank] = status
        if count is not None:
            vector[self.world] = count
        vector[self.world + 1] = float(at_end)
        dist.all_reduce(vector)
        return vector.cpu()

    def agree(self, status: int, count: Tensor | None) -> Verdict:
        """Every rank's status and the summed count; returns once every rank reached the end."""
        if self.world == 1:
            return Verdict({self.rank: status}, count)
        while True:
            vector = self._exchange(status, count, at_end=True)
            arrived = int(vector[self.world + 1].item())
            if arrived == self.world:
                statuses = {rank: int(s) for rank, s in enumerate(vector[: self.world].tolist())}
                return Verdict(statuses, vector[self.world].to(self.device) if count is not None else None)
            log.debug(
                "rank %d: %d of %d ranks at the end; the others abandon their pass",
                self.rank,
                arrived,
                self.world,
            )

    def checkpoint(self) -> None:
        """A point inside a pass: raises ``PeerOutOfMemory`` when a rank ended its attempt with an error."""
        if self.world == 1:
            return
        vector = self._exchange(OK, None, at_end=False)
        if vector[: self.world].any():
            failed = [rank for rank, s in enumerate(vector[: self.world].tolist()) if s]
            raise PeerOutOfMemory(f"rank(s) {failed} ran out of memory: this attempt is abandoned")

    def most(self, value: int) -> int:
        """The largest ``value`` over the ranks (the number of micro-batches every rank runs)."""
        if self.world == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())
