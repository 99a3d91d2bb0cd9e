"""Match source names to model names when one side has an extra top-level prefix.

A Lightning checkpoint names its weights ``model.encoder.0.weight`` where the plain model expects
``encoder.0.weight``; a plain export going into a LightningModule needs the opposite; two
LightningModules may call the attribute ``model`` and ``net``. Each way of mapping (as is, take off
one top-level name, put one on, or both) is scored by how many names it makes meet; a mapping that
makes both sides equal wins, and two such mappings are an error naming them. When none does, the
closest one is kept only if it moves a LightningModule's attribute prefix (the known cause);
otherwise the names are compared as they are, so the error shows the real differences.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from lightning_mgpu.checkpoint._prefixes import split_top

__all__ = ["Mapping", "match_names"]

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

    def describe(self) -> str:
        parts = []
        if self.strip:
            parts.append(f"under {self.strip!r} with that prefix removed")
        if self.add:
            parts.append(f"with {self.add!r} added")
        return " and ".join(parts) or "as named"


def _candidates(source: Sequence[str], target: Collection[str]) -> list[Mapping]:
    def prefixes(keys: Collection[str]) -> list[str]:
        return [f"{top}." for top in split_top(keys) if any(k.startswith(f"{top}.") for k in keys)]

    strips, adds = prefixes(source), prefixes(target)
    out = [Mapping()] + [Mapping(strip=s) for s in strips] + [Mapping(add=a) for a in adds]
    if len(strips) <= _MAX_SWAP_TOPS and len(adds) <= _MAX_SWAP_TOPS:
        out += [Mapping(s, a) for s in strips for a in adds if s != a]
    return out


def match_names(
    source: Sequence[str],
    target: Collection[str],
    submodule_hint: str,
    *,
    source_lightning: bool = False,
    target_lightning: bool = False,
) -> Mapping:
    """The mapping that best fits ``source`` names onto ``target`` names.

    ``source_lightning`` / ``target_lightning`` say which side may carry a LightningModule's
    attribute prefix, which allows a partial fit that removes / adds it.

    Raises:
        ValueError: two mappings fit exactly (say, ``student.`` and ``teacher.`` of the same
            architecture); the message lists them and how to pick one (``submodule_hint``).
    """
    target_set = set(target)
    if set(source) == target_set:
        return Mapping()
    scored = []
    for mapping in _candidates(source, target_set):
        mapped = {mapping.apply(k) for k in source if mapping.covers(k)}
        scored.append((len(mapped & target_set), mapped == target_set, mapping))
    exact = [m for _, is_exact, m in scored if is_exact]
    if len(exact) == 1:
        return exact[0]
    if len(exact) > 1:
        ways = "; ".join(m.describe() for m in exact)
        raise ValueError(f"the weights fit the model in several ways: {ways}. {submodule_hint}")
    allowed = [
        (score, m)
        for score, _, m in scored
        if (not m.strip or source_lightning) and (not m.add or target_lightning)
    ]
    best = max(score for score, _ in allowed)
    return next(m for score, m in allowed if score == best)
