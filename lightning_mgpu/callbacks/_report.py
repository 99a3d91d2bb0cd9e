"""The monitors' report: one block on rank 0 at the start and at the end of ``fit``, however many monitors.

``DeviceMemoryMonitor`` and ``DeviceTimeMonitor`` each have a line for the start of ``fit`` (what they
watch) and a section for its end (their table). Each ``expect``s its parts in ``setup``, before any
monitor's ``on_train_start``, then ``give``s each (its text, or ``None``); the last monitor of the
Trainer to give its part logs every part as one block, in the order of ``trainer.callbacks``: two
monitors read as one report, not two unrelated blocks. One monitor alone logs its part as before.
``write_json`` writes a monitor's summary file.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal, Protocol

from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mgpu._atomic import atomic_write

__all__ = ["Monitor", "Parts", "expect", "give", "write_json"]

Moment = Literal["start", "end"]

HEADINGS = {"start": "Monitors of this fit:", "end": "End of fit, every device:"}

_PENDING = object()


class Parts:
    """What one monitor gave to the report, by moment: pending, its text, or nothing (absent)."""

    def __init__(self) -> None:
        self.given: dict[Moment, object] = {}


class Monitor(Protocol):
    """What the report needs of a monitor."""

    report_parts: Parts
    print_summary: bool
    """Whether the monitor gives parts at all."""


def expect(monitor: Monitor) -> None:
    """``monitor`` will give its parts for the start and the end of this fit: the others wait for them."""
    if monitor.print_summary:
        monitor.report_parts.given["start"] = monitor.report_parts.given["end"] = _PENDING


def give(trainer: Trainer, monitor: Monitor, moment: Moment, text: str | None) -> None:
    """``monitor``'s part for ``moment``; the last monitor to give its part logs them all (on rank 0)."""
    if not monitor.print_summary:
        return
    monitor.report_parts.given[moment] = text
    callbacks = getattr(trainer, "callbacks", [])  # set at run time, unknown to type checkers
    monitors = [cb for cb in callbacks if isinstance(getattr(cb, "report_parts", None), Parts)]
    parts = [m.report_parts.given.get(moment) for m in monitors]
    if any(part is _PENDING for part in parts):
        return
    for m in monitors:
        m.report_parts.given.pop(moment, None)
    texts = [part for part in parts if isinstance(part, str)]
    if len(texts) > 1:
        texts = [HEADINGS[moment], *texts]
    if texts:
        rank_zero_info("\n".join(texts))


def write_json(path: str, data: dict[str, Any]) -> None:
    """``data`` as indented JSON at ``path``, written whole or not at all; its folder created."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_write(path) as file:
        file.write((json.dumps(data, indent=2) + "\n").encode())
