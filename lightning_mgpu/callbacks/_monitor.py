"""``Monitor``: what ``DeviceMemoryMonitor`` and ``DeviceTimeMonitor`` share, each reading its own numbers.

- the arguments both take (``flush_every_n_steps``, ``summary_file``, ``print_summary``);
- every rank's rows of numbers, kept until they are handed to rank 0 (``_hand_over``): at once in one
  process; under several processes through one asynchronous all-gather on the run's process group
  (on its device: a GPU under NCCL), read at the next hand-over (or the end of ``fit``), so no rank
  waits there for a slower one. No group of the monitors' own: on torch 2.6, dropping a gloo group
  at the end of a fit hung now and then in its C++ destructor, with the GIL held, until the
  run's watchdog stopped it;
- one report: each monitor has a line for the start of ``fit`` (what it watches) and a section for its
  end (its table). Each expects its parts in ``setup``, before any monitor's ``on_train_start``, then
  gives each (its text, or ``None``); the last monitor of the Trainer to give its part logs every part
  as one block, in the order of ``trainer.callbacks``: two monitors read as one report, not two
  unrelated blocks. One monitor alone logs its part as before. ``_give_end`` also writes the
  monitor's summary file; ``logging_step`` is the step its readings go to the loggers under.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_mgpu._atomic import atomic_write
from lightning_mgpu._compat.lightning import batches_that_stepped
from lightning_mgpu.callbacks._distributed import all_gather_objects, is_distributed

__all__ = ["Monitor", "logging_step"]

Moment = Literal["start", "end"]

HEADINGS = {"start": "Monitors of this fit:", "end": "End of fit, every device:"}

_PENDING = object()


class Monitor(Callback):
    """A monitor of every rank: rows of numbers gathered to rank 0 in windows, one report with the others.

    A subclass opens each fit with ``_open`` (every rank's description of what it reads), keeps rows
    (``_keep``) and hands them over (``_hand_over``), gets every rank's rows of each step in ``_use``
    (on every rank, in the same order) and ends the fit with ``_finish_gather``.
    """

    def __init__(self, flush_every_n_steps: int, summary_file: str | None, print_summary: bool) -> None:
        if not isinstance(flush_every_n_steps, int) or flush_every_n_steps < 1:
            raise ValueError(f"flush_every_n_steps must be a positive integer, got {flush_every_n_steps!r}")
        self.flush_every_n_steps = flush_every_n_steps
        self.summary_file = summary_file
        self.print_summary = print_summary
        self._parts: dict[Moment, object] = {}  # what it gave to the report: pending, its text or nothing
        self._start_line: str | None = None
        self._rows_on: torch.device | None = None  # where rows travel; None in one process
        self._kept: list[tuple[int, list[float]]] = []  # (step, row) not handed over yet
        self._inflight: tuple[Any, list[torch.Tensor], list[int]] | None = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and self.print_summary:  # before any monitor's on_train_start: the others wait
            self._parts = {"start": _PENDING, "end": _PENDING}

    # ------------------------------------------------------------------ rows of every rank
    def _use(self, trainer: Trainer, step: int, rows: list[list[float]]) -> None:
        """Every rank's row read at ``step``, by rank."""
        raise NotImplementedError

    def _open(self, trainer: Trainer, mine: Any) -> list[Any]:
        """Start a fit's hand-overs; every rank's ``mine``, by rank (``[mine]`` in one process)."""
        self._inflight, self._kept = None, []
        self._rows_on = trainer.strategy.root_device if is_distributed(trainer) else None
        return all_gather_objects(trainer, mine)

    def _keep(self, trainer: Trainer, step: int, row: list[float], hand_over: bool) -> None:
        """Keep this rank's ``row`` read at ``step`` (as long as every rank's), handed over with the rest now
        if ``hand_over`` (every rank must decide alike)."""
        self._kept.append((step, row))
        if hand_over:
            self._hand_over(trainer)

    def _hand_over(self, trainer: Trainer) -> None:
        """This rank's kept rows to ``_use``, with every other rank's.

        In one process at once; under several processes they travel in an all-gather that runs while
        training goes on, finished at the next hand-over or by ``_finish_gather``.
        """
        kept, self._kept = self._kept, []
        if self._rows_on is None:
            for step, row in kept:
                self._use(trainer, step, [row])
            return
        self._finish_gather(trainer)
        steps = [step for step, _ in kept]
        mine = torch.tensor([row for _, row in kept], dtype=torch.float64, device=self._rows_on)
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        self._inflight = (dist.all_gather(parts, mine, async_op=True), parts, steps)

    def _finish_gather(self, trainer: Trainer) -> None:
        """Wait for the gather in flight (usually done by now) and use its rows, oldest first: at the
        next hand-over, and at the end of a fit for its last rows."""
        if self._inflight is None:
            return
        work, parts, steps = self._inflight
        self._inflight = None
        work.wait()
        tables = [part.tolist() for part in parts]
        for i, step in enumerate(steps):
            self._use(trainer, step, [table[i] for table in tables])

    # ------------------------------------------------------------------ the report
    def _give(self, trainer: Trainer, moment: Moment, text: str | None) -> None:
        """This monitor's part for ``moment``; the last monitor to give its part logs them all (on rank 0)."""
        if not self.print_summary:
            return
        self._parts[moment] = text
        callbacks = getattr(trainer, "callbacks", [])  # set at run time, unknown to type checkers
        monitors = [cb for cb in callbacks if isinstance(cb, Monitor)]
        parts = [m._parts.get(moment) for m in monitors]
        if any(part is _PENDING for part in parts):
            return
        for m in monitors:
            m._parts.pop(moment, None)
        texts = [part for part in parts if isinstance(part, str)]
        if len(texts) > 1:
            texts = [HEADINGS[moment], *texts]
        if texts:
            rank_zero_info("\n".join(texts))

    def _give_start(self, trainer: Trainer) -> None:
        """The start line, once a fit (given at the first batch, below the strategy's start-up summary)."""
        if self._start_line is not None:
            self._give(trainer, "start", self._start_line)
            self._start_line = None

    def _give_end(self, trainer: Trainer, text: str | None, summary: dict[str, Any] | None) -> None:
        """This monitor's part for the end of ``fit``, and ``summary`` written whole to its summary file.

        Every rank calls it (``trainer.log_dir`` is a broadcast); rank 0 gives the text and writes the file.
        """
        log_dir = trainer.log_dir or trainer.default_root_dir
        self._give(trainer, "end", text if trainer.is_global_zero else None)
        if trainer.is_global_zero and summary is not None and self.summary_file is not None:
            path = os.path.join(log_dir, self.summary_file)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with atomic_write(path) as file:
                file.write((json.dumps(summary, indent=2) + "\n").encode())


def logging_step(trainer: Trainer, last: bool = False) -> int:
    """The step Lightning's own logging used for the batch just run; at the end of ``fit`` (``last``) its
    count already includes that batch."""
    step = batches_that_stepped(trainer)
    step = trainer.global_step if step is None else step
    return max(0, step - 1) if last else step
