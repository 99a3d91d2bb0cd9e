"""``LoadReport``: what :func:`load_state_dict` did, readable by people and by code."""

from __future__ import annotations

import reprlib
from dataclasses import dataclass, field

# sizes read the same in every report of the package: ``"512 B"``, ``"3.40 KiB"``
from lightning_mgpu.devices import format_bytes as human_size

__all__ = ["LoadReport", "Shape", "human_size", "reason", "shown"]

_SHOW = 10  # names listed per problem before "... and N more"

_BOUNDED = reprlib.Repr()
_BOUNDED.maxlevel, _BOUNDED.maxstring, _BOUNDED.maxother = 3, 80, 80
_BOUNDED.maxlist = _BOUNDED.maxtuple = _BOUNDED.maxdict = _BOUNDED.maxset = 8


def shown(value: object) -> str:
    """``repr(value)`` cut short: 3 levels deep, 8 items, 80 characters a string, whatever the file held.

    A message never formats a value read from a file with plain ``repr``/``str``: a list nested
    200,000 deep would raise ``RecursionError`` instead of the message.
    """
    return _BOUNDED.repr(value)


def reason(err: BaseException) -> str:
    """The first line of what ``err`` says (torch's weights-only refusals: after their preamble)."""
    text = str(err).split("WeightsUnpickler error:")[-1]
    return next((line.strip() for line in text.splitlines() if line.strip()), type(err).__name__)


class Shape(tuple[int, ...]):
    """A tensor shape that prints as ``[10, 5]``."""

    def __str__(self) -> str:
        return "[" + ", ".join(str(d) for d in self) + "]"


def _listed(problems: list[tuple[str, list[str]]]) -> list[str]:
    """``"  label (N): a, b, ... and K more"`` for each non-empty list of names."""
    lines = []
    for label, names in problems:
        if names:
            more = f", ... and {len(names) - _SHOW} more" if len(names) > _SHOW else ""
            lines.append(f"  {label} ({len(names)}): {', '.join(names[:_SHOW])}{more}")
    return lines


@dataclass
class LoadReport:
    """What :func:`~lightning_mgpu.load_state_dict` loaded, and what it could not.

    Attributes:
        source: The source, as the messages name it.
        removed_prefixes: Prefixes taken off the source names (wrappers, a LightningModule attribute).
        added_prefixes: Prefixes put on to fit the model (its own wrappers, its attribute).
        unchanged_prefixes: Wrappers the source and the model share (a DataParallel file into a
            DataParallel model): the names went in as they were.
        missing: Model entries the source has nothing for.
        unexpected: Source entries the model has no place for.
        mismatched: ``(source name, model name, source shape, model shape)`` for each shape mismatch.
        ignored: Source entries outside the submodule that was loaded (a loss module's buffers).
        pairs: With ``by_order=True``, ``(source name, model name)`` for every loaded entry.
        tied: ``(model name, loaded name)`` for each entry the source left out that the model ties
            to a loaded one (``lm_head.weight`` is ``embed.weight``): filled in through it, as
            Hugging Face ``save_pretrained`` files expect.
        loaded: Number of entries copied into the model.

    Example::

        import torch
        from torch import nn
        from lightning_mgpu import load_state_dict

        torch.save(nn.Sequential(nn.Linear(4, 8)).state_dict(), "encoder.pt")
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        report = load_state_dict(model, "encoder.pt", strict=False)
        if not report.ok:
            print(report)  # loaded 2 entries; missing: 2.weight, 2.bias
    """

    source: str
    removed_prefixes: list[str] = field(default_factory=list)
    added_prefixes: list[str] = field(default_factory=list)
    unchanged_prefixes: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, str, Shape, Shape]] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    pairs: list[tuple[str, str]] = field(default_factory=list)
    tied: list[tuple[str, str]] = field(default_factory=list)
    loaded: int = 0

    @property
    def ok(self) -> bool:
        """True when every model entry got a tensor of the right shape and no source entry was left."""
        return not (self.missing or self.unexpected or self.mismatched)

    def problem_lines(self) -> list[str]:
        """One indented line per kind of problem."""
        mismatched = [
            f"{s} {ss} -> {t} {ts}" if s != t else f"{s}: source {ss}, model {ts}"
            for s, t, ss, ts in self.mismatched
        ]
        lines = _listed(
            [
                ("missing from the source", self.missing),
                ("not in the model", self.unexpected),
                ("shape mismatch", mismatched),
            ]
        )
        changes = []
        if self.removed_prefixes:
            changes.append("removed " + ", ".join(self.removed_prefixes))
        if self.added_prefixes:
            changes.append("added " + ", ".join(self.added_prefixes))
        if changes:
            lines.append("  prefixes: " + "; ".join(changes))
        elif self.unchanged_prefixes:
            shared = ", ".join(self.unchanged_prefixes)
            lines.append(f"  prefixes: none changed (the source and the model both carry {shared})")
        return lines

    def __str__(self) -> str:
        lines = [f"loaded {self.loaded} entries from {self.source}", *self.problem_lines()]
        lines += _listed(
            [
                ("ignored, outside the loaded submodule", self.ignored),
                ("not in the source but tied to a loaded entry", [f"{n} (is {s})" for n, s in self.tied]),
                ("paired by order", [f"{s} -> {t}" for s, t in self.pairs]),
            ]
        )
        return "\n".join(lines)
