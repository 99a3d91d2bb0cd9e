"""Counts in messages (``"1 row"``, ``"4 rows"``, ``"rank 1"``, ``"ranks 1, 3"``), and tables' columns."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["aligned", "counted", "ranks"]


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


def aligned(
    rows: Sequence[Sequence[str]],
    *,
    sep: str = " ",
    right_from: int | None = None,
    widths: Sequence[int] = (),
) -> list[str]:
    """The cells of each row padded to their column's width, at least ``widths[i]``, and joined by ``sep``.

    Columns are left-aligned, those from ``right_from`` on right-aligned (numbers); the one table helper of
    the monitors' tables and the estimate's.

    Example::

        aligned([["rank", "steps/s"], ["0", "12.5"]], right_from=1)  # ['rank steps/s', '0       12.5']
    """
    width = [max([len(row[i]) for row in rows] + list(widths[i : i + 1])) for i in range(len(rows[0]))]
    right = len(width) if right_from is None else right_from
    return [
        sep.join(c.rjust(width[i]) if i >= right else c.ljust(width[i]) for i, c in enumerate(row))
        for row in rows
    ]
