"""Small checks the config sections share: the checks return a list of messages and never raise.

- ``one_of``: a value from a fixed set of names;
- ``at_least`` / ``minimums``: lower bounds of numbers, one field or several;
- ``did_you_mean``: returns the suggestion (a string) of every message that names a near miss (a key,
  a recipe, a class).

This module does not import torch.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["at_least", "did_you_mean", "minimums", "one_of"]


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


def did_you_mean(word: str, choices: Iterable[str], template: str = "did you mean {}? ") -> str:
    """``template`` filled in with the choice closest to ``word``, or ``""`` when none is close.

    Example::

        did_you_mean("digts", ["digits", "mnist"])  # 'did you mean digits? '
    """
    close = difflib.get_close_matches(word, list(choices), n=1)
    return template.format(close[0]) if close else ""
