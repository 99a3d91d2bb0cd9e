"""Small checks the config sections share: each returns a list of messages, never raises.

- ``one_of``: a value from a fixed set of names;
- ``at_least`` / ``minimums``: lower bounds of numbers, one field or several.

This module does not import torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["at_least", "minimums", "one_of"]


def one_of(name: str, value: str, allowed: Sequence[str]) -> list[str]:
    """``[]`` when ``value`` is in ``allowed``, else the message naming ``name`` and the choices.

    Example::

        one_of("mode", "mni", ("min", "max"))  # ["mode: 'mni' is not one of min, max"]
    """
    if value in allowed:
        return []
    return [f"{name}: {value!r} is not one of {', '.join(allowed)}"]


def at_least(name: str, value: float | None, low: float, note: str = "") -> list[str]:
    """``[]`` when ``value`` is ``None`` or at least ``low``, else the message naming ``name``.

    Example::

        at_least("num_samples", 0, 1)  # ['num_samples: must be >= 1, got 0']
    """
    if value is None or value >= low:
        return []
    return [f"{name}: must be >= {low:g}{note}, got {value:g}"]


def minimums(section: Any, **lows: float) -> list[str]:
    """``at_least`` for several fields of ``section`` at once.

    Example::

        minimums(cfg.data, num_samples=2, image_size=8)
    """
    return [p for name, low in lows.items() for p in at_least(name, getattr(section, name), low)]
