"""How large the micro-batches of one rank are: halve on out-of-memory, grow back after clean steps.

A pure decision, with no torch in it: the runner reports what happened to each batch and asks
for the next size.
"""

from __future__ import annotations

import logging
import math

from lightning_mgpu._words import counted

__all__ = ["MicroBatchSizes"]

log = logging.getLogger(__name__)


class MicroBatchSizes:
    """The micro-batch size of one rank, fixed or adapting to out-of-memory errors.

    A batch of ``n`` rows runs in as few micro-batches as hold at most ``size`` rows each, spread
    evenly (``split.batch.split_sizes``): 8 rows at ``size=7`` run as 4 and 4. The sizes it grows
    to, ``failed`` and ``last_rows`` are rows a micro-batch really held (``rows``), never only a cap.

    - A fixed size (``auto=False``) never changes; a batch no larger than it runs whole.
    - ``auto=True`` starts with the whole batch (``start=None``) or with ``start`` rows; an
      out-of-memory error halves the rows of the micro-batches that failed (rounding down, at least
      1), and no micro-batch of as many rows as one that failed runs again;
    - after ``grow_after`` batches in a row without an error the size doubles, up to the whole
      batch and below the smallest micro-batch that failed; a doubling that would cut the largest
      batch into micro-batches no larger than now is no growth.

    Args:
        size: rows per micro-batch at most; ``None`` for the whole batch (``"auto"`` only).
        auto: whether out-of-memory errors change the size.
        grow_after: clean batches before trying a larger size.

    Attributes:
        failed: the rows of the smallest micro-batch that ran out of memory, if any did.
        last_rows: rows per micro-batch of the last batch of the largest size seen (``None``: it ran
            whole); what the memory summary reports. A smaller last batch of an epoch leaves it.
    """

    def __init__(self, size: int | None, auto: bool, grow_after: int = 100) -> None:
        self.size = size
        self.auto = auto
        self.grow_after = grow_after
        self.failed: int | None = None
        self.last_rows: int | None = None
        self._clean = 0
        self._largest_batch = 0

    def start(self, size: int) -> None:
        """Start ``"auto"`` at ``size`` rows instead of the whole batch (before any batch ran)."""
        if self.auto and self.size is None and self.failed is None:
            self.size = size
            log.debug("first micro-batch size: %s", counted(size, "row"))

    def rows(self, batch_rows: int) -> int:
        """Rows of the largest micro-batch a batch of ``batch_rows`` rows runs in."""
        self._largest_batch = max(self._largest_batch, batch_rows)
        return _largest_part(batch_rows, self.size)

    def ran(self, batch_rows: int, rows: int) -> None:
        """A batch of ``batch_rows`` rows ran in micro-batches of at most ``rows`` rows."""
        if batch_rows >= self._largest_batch:
            self.last_rows = None if rows >= batch_rows else rows

    def out_of_memory(self, tried: int) -> int | None:
        """Micro-batches of ``tried`` rows failed: the rows to try next; ``None`` when it was 1 row."""
        self._clean = 0
        self.failed = tried if self.failed is None else min(self.failed, tried)
        if tried <= 1:
            return None
        self.size = tried // 2
        log.debug(
            "out of memory with %s: next %d, never %d or more again", counted(tried, "row"), self.size, tried
        )
        return self.size

    def succeeded(self) -> int | None:
        """A batch ran without error; returns the new size when this one made it grow."""
        if not self.auto or self.size is None:
            return None
        self._clean += 1
        if self._clean < self.grow_after:
            return None
        self._clean = 0
        largest = self._largest_batch
        ceiling = largest if self.failed is None else min(largest, self.failed - 1)
        grown = _largest_part(largest, min(self.size * 2, ceiling))
        if grown <= _largest_part(largest, self.size):
            return None
        log.debug(
            "%s: micro-batches of %s grow to %d",
            counted(self.grow_after, "clean batch", "clean batches"),
            counted(self.size, "row"),
            grown,
        )
        self.size = None if self.failed is None and grown >= largest else grown
        return grown


def _largest_part(batch_rows: int, size: int | None) -> int:
    """Rows of the largest of the fewest even micro-batches of at most ``size`` rows (``None``: whole)."""
    if size is None or size >= batch_rows:
        return batch_rows
    parts = math.ceil(batch_rows / max(1, size))
    return math.ceil(batch_rows / parts)
