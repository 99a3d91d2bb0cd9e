"""``DeviceTimeMonitor``: where the time of every rank goes, and which rank holds the others back."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_mgpu._atomic import atomic_write
from lightning_mgpu.callbacks import time_report as report
from lightning_mgpu.callbacks.memory_readings import device_label, replica_devices
from lightning_mgpu.callbacks.time_clocks import AllReduceTimer, CudaStep
from lightning_mgpu.callbacks.time_report import RankTime
from lightning_mgpu.estimate.batch import batch_rows

__all__ = ["DeviceTimeMonitor"]


class DeviceTimeMonitor(Callback):
    """Times every rank's data loading, work and waiting for the others, and names the rank that is slow.

    Per rank and training batch, three phases, summed:

    - **data**: from the end of the previous batch (or the start of the epoch) to the start of
      this one, host time: the training loop fetching the batch, and whatever other callbacks do
      between two batches;
    - **waiting**: under DDP (``mgpu_ddp``), the time from the rank's last gradient bucket being
      ready (its own backward done) until the all-reduce of every bucket completed: blocked on
      the other ranks, plus the transfer. Measured by a DDP communication hook that wraps the
      default all-reduce (none is registered when the strategy was given ``ddp_comm_hook=``). Not
      measured under ``mgpu_fsdp`` (its collectives run inside forward and backward) nor in a
      single process (``mgpu_dp``, one device): there it is shown as ``-``, and work includes it;
    - **work**: from the start to the end of the batch (forward, backward, optimizer step), less
      the waiting. On CUDA the batch is timed on the GPU with ``torch.cuda.Event`` pairs read
      once they have completed, a few batches later: the monitor adds no synchronisation.

    Under ``mgpu_dp`` the one process and all its replicas are one row (replicas run each batch
    together, so they finish together); ``samples`` is then the whole batch.

    Every ``flush_every_n_steps`` batches one all-gather of each rank's sums for the window (a
    handful of numbers, on a gloo group on CUDA) brings them to rank 0, whose loggers get
    the window's means at its last step; its time is counted in no phase. At the end of ``fit``
    rank 0 prints a table (rank, device, steps/s, data %, work %, waiting %, samples/s) and one
    verdict line: balanced, or the slowest rank, how much slower it is, the phase it loses the
    time in and what to try (``time_report.verdict``); the same goes to
    ``<trainer.log_dir>/time_summary.json``.

    **Logged metrics** (through ``logger.log_metrics`` on rank 0, means over each window):
    ``time/rank<r>/data_ms``, ``time/rank<r>/work_ms``, ``time/rank<r>/wait_ms`` (where measured)
    per batch, ``time/rank<r>/samples_per_s``, and ``time/samples_per_s`` for the run.

    Args:
        flush_every_n_steps: gather and log every this many training batches (one collective each).
        summary_file: JSON written at the end of fit, relative to ``trainer.log_dir``;
            ``None`` writes none.
        print_summary: whether rank 0 prints the end-of-fit table and verdict.

    Raises:
        ValueError: if ``flush_every_n_steps`` is not a positive integer.

    Example::

        import lightning as L
        from lightning_mgpu import DeviceTimeMonitor

        trainer = L.Trainer(strategy="mgpu_ddp", devices=2, callbacks=[DeviceTimeMonitor()])
    """

    def __init__(
        self,
        flush_every_n_steps: int = 25,
        summary_file: str | None = "time_summary.json",
        print_summary: bool = True,
    ) -> None:
        if not isinstance(flush_every_n_steps, int) or flush_every_n_steps < 1:
            raise ValueError(f"flush_every_n_steps must be a positive integer, got {flush_every_n_steps!r}")
        self.flush_every_n_steps = flush_every_n_steps
        self.summary_file = summary_file
        self.print_summary = print_summary
        self.totals: list[RankTime] = []
        """Every rank's totals so far (rank 0 only; filled at each gather)."""
        self.verdict: report.Verdict | None = None
        self._timer: AllReduceTimer | None = None
        self._window = _Window()
        self._pending: list[CudaStep] = []
        self._group: Any = None
        self._mark = 0.0
        self._start = 0.0
        self._batches = 0
        self._device = ""
        self._cuda = False

    # ------------------------------------------------------------------ fit
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        root = trainer.strategy.root_device
        replicas = replica_devices(trainer)
        if root.type != "cuda":
            self._device = f"cpu:rank{trainer.global_rank}"  # as DeviceMemoryMonitor names the process
        else:
            self._device = ",".join(device_label(trainer, d) for d in replicas or [root])
        self._cuda = root.type == "cuda"
        self._window, self._pending, self._batches, self.totals = _Window(), [], 0, []
        self._group = None
        if _distributed(trainer) and dist.get_backend() != "gloo":
            # the sums travel on the CPU: no copy from a GPU, no synchronisation
            self._group = dist.new_group(backend="gloo")
        self._timer = AllReduceTimer.attach(trainer, root if self._cuda else None)
        self._mark = time.perf_counter()

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._mark = time.perf_counter()  # the time between epochs (validation, checkpoints) is no phase

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._start = time.perf_counter()
        self._window.data += self._start - self._mark
        self._window.samples += batch_rows(batch) or 0
        if self._timer is not None:
            self._timer.begin_step()
        if self._cuda:
            self._pending.append(CudaStep(trainer.strategy.root_device))

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        end = time.perf_counter()
        wait = self._timer.end_step() if self._timer is not None else None
        if self._cuda:
            self._pending[-1].end(wait)
            self._read_cuda(block=False)
        else:
            self._window.add(end - self._start, None if isinstance(wait, list) else wait)
        self._batches += 1
        if self._batches % self.flush_every_n_steps == 0:
            self._flush(trainer)
        self._mark = time.perf_counter()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._cuda:
            self._read_cuda(block=True)  # the fit is over: waiting for the last events costs no step
        if self._batches % self.flush_every_n_steps != 0 or self._window.steps:
            self._flush(trainer)
        if self._timer is not None:
            self._timer.detach()
        log_dir = trainer.log_dir or trainer.default_root_dir  # a broadcast: every rank calls it
        if not trainer.is_global_zero or not self.totals:
            return
        accelerator = "cuda" if self._cuda else "cpu"
        self.verdict = report.verdict(self.totals, accelerator)
        if self.print_summary:
            print(report.table(self.totals) + "\n" + self.verdict.line(), flush=True)
        if self.summary_file is not None:
            path = os.path.join(log_dir, self.summary_file)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with atomic_write(path) as file:
                data = report.summary_json(self.totals, self.verdict)
                file.write((json.dumps(data, indent=2) + "\n").encode())

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._timer is not None:  # no collective here: another rank may be gone
            self._timer.detach()

    # ------------------------------------------------------------------ windows
    def _read_cuda(self, block: bool) -> None:
        """Add the batches whose events have completed, oldest first; ``block`` waits for the rest."""
        while self._pending and self._pending[0].done(block):
            step = self._pending.pop(0)
            self._window.add(*step.seconds())

    def _flush(self, trainer: Trainer) -> None:
        """One all-gather of every rank's window; rank 0 adds them to the totals and logs their means."""
        mine, self._window = self._window, _Window()
        everyone = [(trainer.global_rank, self._device, mine)]
        if _distributed(trainer):
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, everyone[0], group=self._group)
            everyone = sorted(gathered, key=lambda item: item[0])
        if not trainer.is_global_zero:
            return
        totals = {r.rank: r for r in self.totals}
        values: dict[str, float] = {}
        for rank, device, window in everyone:
            empty = RankTime(rank, device, 0, 0, 0.0, 0.0, None if window.wait is None else 0.0)
            totals[rank] = window.added_to(totals.get(rank, empty))
            values.update(window.metrics(f"time/rank{rank}"))
        self.totals = [totals[r] for r in sorted(totals)]
        longest = max(w.seconds for _, _, w in everyone)
        values["time/samples_per_s"] = (
            sum(w.samples for _, _, w in everyone) / longest if longest > 0 else 0.0
        )
        # the step Lightning's own logging uses
        step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", None)
        for logger in trainer.loggers:
            logger.log_metrics(values, step=max(0, (trainer.global_step if step is None else step) - 1))


@dataclass
class _Window:
    """One rank's sums over the batches since the last gather."""

    steps: int = 0
    samples: int = 0
    data: float = 0.0
    work: float = 0.0
    wait: float | None = None

    @property
    def seconds(self) -> float:
        return self.data + self.work + (self.wait or 0.0)

    def add(self, step_s: float, wait_s: float | None) -> None:
        self.steps += 1
        wait_s = None if wait_s is None else min(wait_s, step_s)
        self.work += step_s - (wait_s or 0.0)
        if wait_s is not None:
            self.wait = (self.wait or 0.0) + wait_s

    def added_to(self, total: RankTime) -> RankTime:
        wait = None if total.wait_s is None or self.wait is None else total.wait_s + self.wait
        return replace(
            total,
            steps=total.steps + self.steps,
            samples=total.samples + self.samples,
            data_s=total.data_s + self.data,
            work_s=total.work_s + self.work,
            wait_s=wait,
        )

    def metrics(self, prefix: str) -> dict[str, float]:
        """The window's means per batch in ms, and its samples per second."""
        if not self.steps:
            return {}
        per = 1e3 / self.steps
        values = {f"{prefix}/data_ms": self.data * per, f"{prefix}/work_ms": self.work * per}
        if self.wait is not None:
            values[f"{prefix}/wait_ms"] = self.wait * per
        values[f"{prefix}/samples_per_s"] = self.samples / self.seconds if self.seconds > 0 else 0.0
        return values


def _distributed(trainer: Trainer) -> bool:
    return trainer.world_size > 1 and dist.is_available() and dist.is_initialized()
