"""Match source names to model names when one side has an extra top-level prefix.

A Lightning checkpoint names its weights ``model.encoder.0.weight`` where the plain model expects
``encoder.0.weight``; a plain export going into a LightningModule needs the opposite; two
LightningModules may call the attribute ``model`` and ``net``. Exact names win first: when every
model name is in the source as it is, the names are taken as they are (the rest of the source is
unexpected), however well another way fits. Otherwise each way of mapping (as is, take off
one top-level name, put one on, or both) is scored by how many names it makes meet; a mapping that
makes both sides equal, with every shape equal too, wins, and two such mappings are an error naming
only them (a way whose names fit but whose shapes cannot is never offered; when no way's shapes
fit, the first is kept, so that the error lists its shape mismatches, not ways that do not fit).
When none does, the closest one is kept only if it moves a LightningModule's attribute prefix (the
known cause); otherwise the names are compared as they are, so the error shows the real differences.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from lightning_mgpu.checkpoint._prefixes import split_top

__all__ = ["Mapping", "match_names"]

logger = logging.getLogger(__name__)

# beyond this many top-level names on both sides, "take one off and put one on" is not tried
_MAX_SWAP_TOPS = 32


@dataclass(frozen=True)
class Mapping:
    """Source name -> model name: keep names under ``strip`` (removing it), then prepend ``add``."""

    strip: str = ""
    add: str = ""

    def covers(self, key: str) -> bool:
        return not self.strip or key.startswith(self.strip)

    def apply(self, key: str) -> str:
        return self.add + key[len(self.strip) :]

    def names(self, keys: Iterable[str]) -> set[str]:
        """The model names the ``keys`` this mapping covers become."""
        return {self.apply(k) for k in keys if self.covers(k)}

    def describe(self) -> str:
        parts = []
        if self.strip:
            parts.append(f"under {self.strip!r} with that prefix removed")
        if self.add:
            parts.append(f"with {self.add!r} added")
        return " and ".join(parts) or "as named"


def _candidates(source: Collection[str], target: Collection[str]) -> list[Mapping]:
    def prefixes(keys: Collection[str]) -> list[str]:
        return [f"{top}." for top in split_top(keys) if any(k.startswith(f"{top}.") for k in keys)]

    strips, adds = prefixes(source), prefixes(target)
    out = [Mapping()] + [Mapping(strip=s) for s in strips] + [Mapping(add=a) for a in adds]
    if len(strips) <= _MAX_SWAP_TOPS and len(adds) <= _MAX_SWAP_TOPS:
        out += [Mapping(s, a) for s in strips for a in adds if s != a]
    return out


def match_names(source: dict[str, Any], target: dict[str, Any], lightning: tuple[bool, bool]) -> Mapping:
    """The mapping that best fits the ``source`` state_dict's names onto the ``target``'s.

    ``lightning`` says which side, source then target, may carry a LightningModule's attribute
    prefix, which allows a partial fit that removes / adds it. Of several exact fits, only those
    whose shapes are all equal count.

    Raises:
        ValueError: two mappings fit exactly, shapes included (say, ``student.`` and ``teacher.``
            of the same architecture); the message lists them and how to pick one: a
            ``submodule=`` per way that takes one, else one of the source's top-level names.
    """
    target_set = set(target)
    if target_set <= set(source):  # never ``2.weight`` into ``0.weight`` when ``0.weight`` is there
        return Mapping()
    scored = []
    for mapping in _candidates(source, target_set):
        mapped = mapping.names(source)
        scored.append((len(mapped & target_set), mapped == target_set, mapping))
    exact = [m for _, is_exact, m in scored if is_exact]
    if len(exact) > 1:
        shaped = [
            m for m in exact if all(_same_shape(source[k], target[m.apply(k)]) for k in source if m.covers(k))
        ]
        logger.debug(
            "name fits %s; with equal shapes: %s",
            [m.describe() for m in exact],
            [m.describe() for m in shaped],
        )
        if not shaped:  # no way fits: nothing to choose between; the first one's mismatches are reported
            return exact[0]
        exact = shaped
    if len(exact) == 1:
        logger.debug("source names fit the model %s", exact[0].describe())
        return exact[0]
    if len(exact) > 1:
        ways = "; ".join(m.describe() for m in exact)
        picks = [m.strip.rstrip(".") for m in exact if m.strip]
        tops = list(split_top(source))
        hint = f"Pass submodule={tops[0]!r} (or another of {', '.join(tops)}) to choose." if tops else ""
        if len(picks) == len(exact):
            hint = "Pass " + " or ".join(f"submodule={p!r}" for p in picks) + " to choose."
        raise ValueError(f"the weights fit the model in several ways: {ways}. {hint}")
    allowed = [
        (score, m) for score, _, m in scored if (not m.strip or lightning[0]) and (not m.add or lightning[1])
    ]
    best = max(score for score, _ in allowed)
    return next(m for score, m in allowed if score == best)


def _same_shape(source: Any, target: Any) -> bool:
    return getattr(source, "shape", None) == getattr(target, "shape", None)
