"""``DeviceTimeMonitor``: where the time of every rank goes, and which rank holds the others back."""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_mgpu._compat.lightning import batches_that_stepped
from lightning_mgpu.callbacks import _report
from lightning_mgpu.callbacks import time_report as report
from lightning_mgpu.callbacks.memory_readings import device_label, replica_devices
from lightning_mgpu.callbacks.time_clocks import CudaStep, StepTimer, attach_timer
from lightning_mgpu.callbacks.time_report import RankTime
from lightning_mgpu.estimate.batch import batch_rows

__all__ = ["DeviceTimeMonitor"]


class DeviceTimeMonitor(Callback):
    """Times every rank's data loading, work and waiting for the others, and names the rank that is slow.

    Per rank and training batch, three phases, summed:

    - **data**: from the end of the previous batch (or the start of the epoch, or the end of a
      validation run inside it) to the start of this one, host time: the training loop fetching
      the batch, and whatever other callbacks do between two batches;
    - **waiting**: the time the rank is blocked on the others, plus the transfer:

      - under DDP (``mgpu_ddp``), from the rank's last gradient bucket being ready (its own backward
        done) until the all-reduce of every bucket completed, measured by a DDP communication hook
        that wraps the default all-reduce (none is registered when the strategy was given
        ``ddp_comm_hook=``);
      - under ``mgpu_fsdp`` on CPU, the time inside FSDP's all-gathers and reduce-scatters, which
        gloo runs on the training thread (the rank computes nothing meanwhile). On GPUs they run
        on streams of their own beside the computation, and the part of them the computation
        waits for cannot be read from the host without a profiler: there waiting is shown as
        ``-``, work includes it, and only a slow loader can single out a rank (the verdict says so);
      - in a single process (``mgpu_dp``, one device) there is no other rank: ``-``.

      Other collectives in a step (``self.log(..., sync_dist=True)``, ``mgpu_ddp``'s look at the
      first batch) count as work;
    - **work**: from the start to the end of the batch (forward, backward, optimizer step), less
      the waiting. On CUDA the batch is timed on the GPU with ``torch.cuda.Event`` pairs read
      once they have completed, a few batches later: the monitor adds no synchronisation.

    Under ``mgpu_dp`` the one process and all its replicas are one row, its device column listing
    every replica's device (the table says so under it): the replicas run each batch's forward in
    threads, then one backward through all of them and one optimizer step, so a batch ends with
    the slowest replica and the rest of it is shared; a slow replica shows as the row's work.
    ``DeviceMemoryMonitor`` shows each replica's memory. ``samples`` is the whole batch.

    Every ``flush_every_n_steps`` batches one asynchronous all-gather of each rank's sums for the
    window (five numbers, on a gloo group of the monitor's own, created at the start of ``fit`` and
    destroyed at its end) brings them to rank 0 while the next window trains; rank 0's loggers
    then get the window's means at its last step. At the end of ``fit`` rank 0 logs
    (``rank_zero_info``, on stderr unless logging is configured otherwise) a table (rank, device,
    steps/s, data %, work %, waiting %, samples/s) and one verdict line: balanced, or the slowest
    rank, how much slower it is, the phase it loses the time in and what to try
    (``time_report.verdict``); the same goes to ``<trainer.log_dir>/time_summary.json``. After the
    first batch a line says what it times and whether waiting is measured. Beside
    ``DeviceMemoryMonitor`` both monitors' lines and tables are logged as one report.

    **Logged metrics** (through ``logger.log_metrics`` on rank 0, means over each window):
    ``time/rank<r>/data_ms``, ``time/rank<r>/work_ms``, ``time/rank<r>/wait_ms`` (where measured)
    per batch, ``time/rank<r>/samples_per_s``, and ``time/samples_per_s`` for the run.

    Args:
        flush_every_n_steps: gather and log every this many training batches (one collective each).
        summary_file: JSON written at the end of fit, relative to ``trainer.log_dir``;
            ``None`` writes none.
        print_summary: whether rank 0 logs the start line and the end-of-fit table and verdict.

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
        self.report_parts = _report.Parts()
        self._start_line: str | None = None
        self._timer: StepTimer | None = None
        self._window = _Window()
        self._pending: list[CudaStep] = []
        self._group: Any = None
        self._labels: list[str] = []  # every rank's device(s), by rank
        self._inflight: tuple[Any, list[torch.Tensor], int] | None = None  # gather, its parts, its step
        self._mark = 0.0
        self._start = 0.0
        self._batches = 0
        self._device = ""
        self._cuda = False

    # ------------------------------------------------------------------ fit
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":  # before any monitor's on_train_start: one report with the others
            _report.expect(self)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        root = trainer.strategy.root_device
        replicas = replica_devices(trainer)
        if root.type != "cuda" and replicas:  # as DeviceMemoryMonitor names CPU replicas
            self._device = ",".join(f"cpu:replica{i}" for i in range(len(replicas)))
        elif root.type != "cuda":
            self._device = f"cpu:rank{trainer.global_rank}"  # as DeviceMemoryMonitor names the process
        else:
            self._device = ",".join(device_label(trainer, d) for d in replicas or [root])
        self._cuda = root.type == "cuda"
        self._window, self._pending, self._batches, self.totals = _Window(), [], 0, []
        self._release_group()  # a fit that ended in an error left its group
        self._labels, self._inflight = [self._device], None
        if _distributed(trainer):
            # a group of its own, on the CPU: no copy from a GPU, no synchronisation, and its gathers
            # in flight never sit between the strategy's collectives; released at the end of fit
            self._group = dist.new_group(backend="gloo")
            self._labels = [""] * dist.get_world_size()
            dist.all_gather_object(self._labels, self._device, group=self._group)
        self._timer = attach_timer(trainer, root if self._cuda else None)
        if len(self._labels) == 1:
            waiting = "no other rank to wait for"
        elif self._timer is not None:
            waiting = "waiting for the others measured"
        else:
            waiting = "waiting for the others not measured under this strategy, work includes it"
        # given after the first batch, below the strategy's start-up summary
        self._start_line = (
            f"DeviceTimeMonitor: data loading, work and waiting of {len(self._labels)} rank(s) ({waiting});"
            " a table and the slow rank at the end"
        )
        self._mark = time.perf_counter()

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._mark = time.perf_counter()  # the time between epochs (validation, checkpoints) is no phase

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._mark = time.perf_counter()  # validation inside an epoch is no phase of training either

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
        if self._start_line is not None:
            _report.give(trainer, self, "start", self._start_line)
            self._start_line = None
        self._mark = time.perf_counter()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._cuda:
            self._read_cuda(block=True)  # the fit is over: waiting for the last events costs no step
        # every rank must decide alike: on CUDA the windows hold what events finished late, which varies
        if self._batches % self.flush_every_n_steps != 0 or self._cuda:
            self._flush(trainer, last=True)
        self._finish_gather(trainer)
        self._release_group()
        if self._timer is not None:
            self._timer.detach()
        log_dir = trainer.log_dir or trainer.default_root_dir  # a broadcast: every rank calls it
        if not trainer.is_global_zero or not self.totals:
            _report.give(trainer, self, "end", None)
            return
        accelerator = "cuda" if self._cuda else "cpu"
        self.verdict = report.verdict(self.totals, accelerator)
        _report.give(trainer, self, "end", report.table(self.totals) + "\n" + self.verdict.line())
        if self.summary_file is not None:
            data = report.summary_json(self.totals, self.verdict)
            _report.write_json(os.path.join(log_dir, self.summary_file), data)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._timer is not None:  # no collective here: another rank may be gone
            self._timer.detach()
        if self._inflight is None:  # a gather in flight may never end: the group goes with the process
            self._release_group()

    def _release_group(self) -> None:
        """Destroy this fit's group (its sockets, a communicator's threads); no collective runs."""
        if self._group is not None and dist.is_initialized():
            # ValueError: it went with the default group (destroyed since, and maybe created again)
            with contextlib.suppress(ValueError):
                dist.destroy_process_group(self._group)
        self._group = None

    # ------------------------------------------------------------------ windows
    def _read_cuda(self, block: bool) -> None:
        """Add the batches whose events have completed, oldest first; ``block`` waits for the rest."""
        while self._pending and self._pending[0].done(block):
            step = self._pending.pop(0)
            self._window.add(*step.seconds())

    def _flush(self, trainer: Trainer, last: bool = False) -> None:
        """Hand this window over: used here in one process, after an asynchronous all-gather under DDP.

        The gather of a handful of numbers runs while the next window trains and is read at the next
        hand-over (or the end of fit), so no rank waits there for a slower one.
        """
        mine, self._window = self._window, _Window()
        # the step Lightning's own logging uses; at the end of fit it already counts the last batch
        step = batches_that_stepped(trainer)
        step = max(0, (trainer.global_step if step is None else step) - int(last))
        if not _distributed(trainer):
            self._use(trainer, [mine], step)
            return
        self._finish_gather(trainer)
        vector = torch.tensor(mine.vector(), dtype=torch.float64)
        parts = [torch.empty_like(vector) for _ in self._labels]
        work = dist.all_gather(parts, vector, group=self._group, async_op=True)
        self._inflight = (work, parts, step)

    def _finish_gather(self, trainer: Trainer) -> None:
        if self._inflight is None:
            return
        work, parts, step = self._inflight
        self._inflight = None
        work.wait()
        self._use(trainer, [_Window.from_vector(part.tolist()) for part in parts], step)

    def _use(self, trainer: Trainer, windows: list[_Window], step: int) -> None:
        """Rank 0 adds every rank's window to the totals and logs the window's means."""
        if not trainer.is_global_zero:
            return
        totals = {r.rank: r for r in self.totals}
        values: dict[str, float] = {}
        for rank, (device, window) in enumerate(zip(self._labels, windows, strict=True)):
            empty = RankTime(rank, device, 0, 0, 0.0, 0.0, None if window.wait is None else 0.0)
            totals[rank] = window.added_to(totals.get(rank, empty))
            values.update(window.metrics(f"time/rank{rank}"))
        self.totals = [totals[r] for r in sorted(totals)]
        longest = max(w.seconds for w in windows)
        values["time/samples_per_s"] = sum(w.samples for w in windows) / longest if longest > 0 else 0.0
        for logger in trainer.loggers:
            logger.log_metrics(values, step=step)


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

    def vector(self) -> list[float]:
        return [self.steps, self.samples, self.data, self.work, math.nan if self.wait is None else self.wait]

    @classmethod
    def from_vector(cls, values: list[float]) -> _Window:
        steps, samples, data, work, wait = values
        return cls(int(steps), int(samples), data, work, None if math.isnan(wait) else wait)

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
