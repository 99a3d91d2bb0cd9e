"""The monitors' report: one block on rank 0 at the start and at the end of ``fit``, however many monitors.

``DeviceMemoryMonitor`` and ``DeviceTimeMonitor`` each have a line for the start of ``fit`` (what they
watch) and a section for its end (their table). Each ``expect``s its parts in ``setup``, before any
monitor's ``on_train_start``, then ``give``s each (its text, or ``None``); the last monitor of the
Trainer to give its part logs every part as one block, in the order of ``trainer.callbacks``: two
monitors read as one report, not two unrelated blocks. One monitor alone logs its part as before.
``give_end`` also writes the monitor's summary file; ``logging_step`` is the step its readings go
to the loggers under.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal, Protocol

from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mgpu._atomic import atomic_write
from lightning_mgpu._compat.lightning import batches_that_stepped

__all__ = ["Monitor", "Parts", "expect", "give", "give_end", "logging_step"]

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
    summary_file: str | None
    """Its JSON summary, relative to ``trainer.log_dir``; ``None`` writes none."""


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


def give_end(trainer: Trainer, monitor: Monitor, text: str | None, summary: dict[str, Any] | None) -> None:
    """``monitor``'s part for the end of ``fit``, and ``summary`` written whole to its summary file.

    Every rank calls it (``trainer.log_dir`` is a broadcast); rank 0 gives the text and writes the file.
    """
    log_dir = trainer.log_dir or trainer.default_root_dir
    give(trainer, monitor, "end", text if trainer.is_global_zero else None)
    if trainer.is_global_zero and summary is not None and monitor.summary_file is not None:
        path = os.path.join(log_dir, monitor.summary_file)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with atomic_write(path) as file:
            file.write((json.dumps(summary, indent=2) + "\n").encode())


def logging_step(trainer: Trainer, last: bool = False) -> int:
    """The step Lightning's own logging used for the batch just run; at the end of ``fit`` (``last``) its
    count already includes that batch."""
    step = batches_that_stepped(trainer)
    step = trainer.global_step if step is None else step
    return max(0, step - 1) if last else step
