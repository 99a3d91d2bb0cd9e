"""How large the micro-batches of one rank are: halve on out-of-memory, grow back after clean steps.

A pure decision, with no torch in it: the runner reports what happened to each batch and asks
for the next size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

__all__ = ["MicroBatchSizes", "Shrink"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shrink:
    """What an out-of-memory error changed: the size that failed and the one to try next."""

    old: int
    new: int


class MicroBatchSizes:
    """The micro-batch size of one rank, fixed or adapting to out-of-memory errors.

    - A fixed size (``auto=False``) never changes; a batch no larger than it runs whole.
    - ``auto=True`` starts with the whole batch (``start=None``) or with ``start`` rows; an
      out-of-memory error halves the size of the batch that failed (rounding down, at least 1),
      and no size at or above one that failed is tried again;
    - after ``grow_after`` batches in a row without an error the size doubles, up to the whole
      batch, and stops below the smallest size that failed.

    Args:
        size: rows per micro-batch; ``None`` for the whole batch (``"auto"`` only).
        auto: whether out-of-memory errors change the size.
        grow_after: clean batches before trying a larger size.
    """

    def __init__(self, size: int | None, auto: bool, grow_after: int = 100) -> None:
        self.size = size
        self.auto = auto
        self.grow_after = grow_after
        self.failed: int | None = None
        self._clean = 0
        self._largest_batch = 0

    def start(self, size: int) -> None:
        """Start ``"auto"`` at ``size`` rows instead of the whole batch (before any batch ran)."""
        if self.auto and self.size is None and self.failed is None:
            self.size = size
            log.debug("first micro-batch size: %d rows", size)

    def rows(self, batch_rows: int) -> int:
        """Rows per micro-batch for a batch of ``batch_rows`` rows."""
        self._largest_batch = max(self._largest_batch, batch_rows)
        return batch_rows if self.size is None else max(1, min(self.size, batch_rows))

    def out_of_memory(self, tried: int) -> Shrink | None:
        """A batch failed with micro-batches of ``tried`` rows; ``None`` when it was already 1 row."""
        self._clean = 0
        self.failed = tried if self.failed is None else min(self.failed, tried)
        if tried <= 1:
            return None
        self.size = tried // 2
        log.debug("out of memory with %d rows: next %d, never %d or more again", tried, self.size, tried)
        return Shrink(tried, self.size)

    def succeeded(self) -> int | None:
        """A batch ran without error; returns the new size when this one made it grow."""
        if not self.auto or self.size is None:
            return None
        self._clean += 1
        if self._clean < self.grow_after:
            return None
        self._clean = 0
        ceiling = self._largest_batch if self.failed is None else min(self._largest_batch, self.failed - 1)
        grown = min(self.size * 2, ceiling)
        if grown <= self.size:
            return None
        log.debug("%d clean batches: micro-batches of %d rows grow to %d", self.grow_after, self.size, grown)
        self.size = None if self.failed is None and grown >= self._largest_batch else grown
        return grown
