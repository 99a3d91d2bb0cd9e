"""How the ranks of a micro-batched step learn of each other's out-of-memory errors, none left waiting.

Every exchange is one all-reduce of the same small float64 vector, whoever calls it:
``[status of rank 0, ..., status of rank N-1, global_mean count, ranks at the end, ranks about to
run a collective, ranks that will cut their next batch, that collective's description (4 numbers)]``.

- ``agree``: the end of an attempt. Each rank gives its status (``OK``, ``RETRY``: it ran
  out of memory and will run the batch again smaller, ``FATAL``: not even one row fits), the
  count ``global_mean`` saw, and whether it will cut its next batch into micro-batches (when no
  rank will, the next batch runs whole everywhere without asking).
- ``announce``: under ``mgpu_fsdp``, right before each of FSDP's collectives, a rank that runs its
  pass says which one it is about to enter (which unit's, which kind, its sizes), asynchronously:
  nothing waits for it, and its result is never read. A rank that ran out of memory earlier in the
  pass is in ``agree`` meanwhile: its exchange meets the announcement, and it runs the same
  collective with buffers of its own (``shadow``), so nobody waits in it, then exchanges again.
  The others finish their pass, and learn at their ``agree`` that the attempt failed.

A rank that fails calls ``agree`` while the others may still be in their pass; all calls are the
same all-reduce, so they meet. The count of ranks at the end tells ``agree`` whether every rank
was there: if not, it runs again (after shadowing the collective announced, if one was) until all
meet there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mgpu._words import counted

__all__ = ["DESCRIPTION", "FATAL", "OK", "RETRY", "Agreement", "Shadow", "Verdict"]

log = logging.getLogger(__name__)

OK, RETRY, FATAL = 0, 1, 2
DESCRIPTION = 4
"""Numbers that describe a collective to shadow (``announce``): the meaning is the announcer's."""

Shadow = Callable[[Sequence[int]], None]
"""Runs, on a rank that left its pass, the collective another rank announced (its description)."""


@dataclass(frozen=True)
class Verdict:
    """What the ranks agreed on at the end of an attempt.

    Attributes:
        statuses: Rank -> its status (``OK``, ``RETRY``, ``FATAL``), for every rank that took part.
        count: The ``global_mean`` count summed over every rank, when the step used it.
    """

    statuses: dict[int, int]
    count: Tensor | None
    cut: bool = True
    """Whether a rank will cut its next batch into micro-batches (``False``: every rank runs it whole)."""


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
        self.shadow: Shadow | None = None
        """Set by the strategy that announces its collectives: how this rank runs one it left."""
        self.leave: Callable[[], None] | None = None
        """Set where the collectives of the pass are known and nobody announces them: runs, on a rank
        whose attempt failed, those of the pass it did not enter, before it meets the others."""
        self._announced: list[tuple[dist.Work | None, Tensor]] = []

    def _exchange(self, status: int, count: Tensor | None, cut: bool) -> Tensor:
        vector = torch.zeros(self.world + 4 + DESCRIPTION, dtype=torch.float64, device=self.device)
        vector[self.rank] = status
        if count is not None:
            vector[self.world] = count
        vector[self.world + 1] = 1.0  # at the end (an announcement adds 0)
        vector[self.world + 3] = float(cut)
        dist.all_reduce(vector)
        return vector.cpu()

    def announce(self, description: Sequence[int]) -> None:
        """About to enter a collective (``description``): tell a rank that left the pass, without waiting."""
        if self.world == 1:
            return
        vector = torch.zeros(self.world + 4 + DESCRIPTION, dtype=torch.float64)
        vector[self.world + 2] = 1
        vector[self.world + 4 :] = torch.tensor([float(n) for n in description], dtype=torch.float64)
        vector = vector.to(self.device)
        self._announced.append((dist.all_reduce(vector, async_op=True), vector))

    def agree(self, status: int, count: Tensor | None, cut: bool = True) -> Verdict:
        """Every rank's status and the summed count; returns once every rank reached the end.

        ``cut``: whether this rank will cut its next batch into micro-batches, as far as it knows now.
        """
        if self.world == 1:
            return Verdict({self.rank: status}, count, cut)
        if status != OK and self.leave is not None:
            leave, self.leave = self.leave, None
            leave()
        while True:
            vector = self._exchange(status, count, cut)
            announcing = int(vector[self.world + 2].item())
            if announcing:
                self._shadow(vector[self.world + 4 :], announcing)
                continue
            arrived = int(vector[self.world + 1].item())
            if arrived == self.world:
                for work, _ in self._announced:  # done long ago: their collectives ran after them
                    if work is not None:
                        work.wait()
                self._announced.clear()
                statuses = {rank: int(s) for rank, s in enumerate(vector[: self.world].tolist())}
                summed = vector[self.world].to(self.device) if count is not None else None
                return Verdict(statuses, summed, bool(vector[self.world + 3].item()))
            log.debug(
                "rank %d: %d of %d ranks at the end; the others abandon their pass",
                self.rank,
                arrived,
                self.world,
            )

    def _shadow(self, summed: Tensor, announcing: int) -> None:
        """Run the collective ``announcing`` ranks announced (``summed``: their descriptions added up)."""
        description = [int(n) // announcing for n in summed.tolist()]
        if [n * announcing for n in description] != [int(n) for n in summed.tolist()] or self.shadow is None:
            raise RuntimeError(
                f"rank {self.rank} left its pass after an out-of-memory error, and"
                f" {counted(announcing, 'rank')} announced collectives it cannot run with them (summed"
                f" description {summed.tolist()});"
                " the run stops here rather than leave them waiting"
            )
        log.debug("rank %d runs the collective %s with the ranks still in their pass", self.rank, description)
        self.shadow(description)

    def most(self, value: int) -> int:
        """The largest ``value`` over the ranks (the number of micro-batches every rank runs)."""
        if self.world == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())
