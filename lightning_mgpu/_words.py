"""Counts in messages: ``"1 row"``, ``"4 rows"``, ``"rank 1"``, ``"ranks 1, 3"``."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["counted", "ranks"]


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, in the plural unless ``n`` is 1 (``plural`` where it is not ``noun + "s"``).

    Example::

        counted(1, "row"), counted(4, "row"), counted(2, "process", "processes")  # '1 row', '4 rows', ...
    """
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def ranks(numbers: Iterable[int]) -> str:
    """``"rank 1"`` or ``"ranks 1, 3"``."""
    listed = [str(n) for n in numbers]
    return f"rank{'s' if len(listed) != 1 else ''} {', '.join(listed)}"
