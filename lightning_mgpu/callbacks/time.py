"""``DeviceTimeMonitor``: where the time of every rank goes, and which rank holds the others back."""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from typing_extensions import override

from lightning_mgpu.callbacks import time_report as report
from lightning_mgpu.callbacks._monitor import Monitor, logging_step
from lightning_mgpu.callbacks.memory_readings import plan_readings
from lightning_mgpu.callbacks.time_clocks import CudaStep, StepTimer, attach_timer
from lightning_mgpu.callbacks.time_report import RankTime
from lightning_mgpu.estimate.batch import batch_rows

__all__ = ["DeviceTimeMonitor"]


class DeviceTimeMonitor(Monitor):
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
    window (five numbers) brings them to rank 0 while the next window trains; rank 0's loggers
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
        super().__init__(flush_every_n_steps, summary_file, print_summary)
        self.totals: list[RankTime] = []
        """Every rank's totals so far (rank 0 only; filled at each gather)."""
        self.verdict: report.Verdict | None = None
        self._timer: StepTimer | None = None
        self._window = RankTime(0, "")  # this rank's sums since the last gather
        self._pending: list[CudaStep] = []
        self._labels: list[str] = []  # every rank's device(s), by rank
        self._mark = 0.0
        self._start = 0.0
        self._batches = 0
        self._device = ""
        self._cuda = False

    # ------------------------------------------------------------------ fit
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        root = trainer.strategy.root_device
        # named as DeviceMemoryMonitor reads them: its devices, or its CPU process without replicas
        plan = plan_readings(trainer)
        labels = [p.label for p in plan if p.kind != "cpu" or len(plan) == 1]
        # a device the memory monitor does not read (MPS, XPU, ...): named by its type and the rank
        self._device = ",".join(labels) or f"{root.type}:rank{trainer.global_rank}"
        self._cuda = root.type == "cuda"
        self._window, self._pending, self._batches, self.totals = RankTime(0, self._device), [], 0, []
        self._labels = self._open(trainer, self._device)
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
        self._window.data_s += self._start - self._mark
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
            wait_s = None if isinstance(wait, list) else wait
            self._window.add_step(end - self._start, wait_s)
        self._batches += 1
        if self._batches % self.flush_every_n_steps == 0:
            self._flush(trainer)
        self._give_start(trainer)
        self._mark = time.perf_counter()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._cuda:
            self._read_cuda(block=True)  # the fit is over: waiting for the last events costs no step
        # every rank must decide alike: on CUDA the windows hold what events finished late, which varies
        if self._batches % self.flush_every_n_steps != 0 or self._cuda:
            self._flush(trainer, last=True)
        self._finish_gather(trainer)
        if self._timer is not None:
            self._timer.detach()
        if not self.totals:  # rank 0's: the others have none
            self._give_end(trainer, None, None)
            return
        self.verdict = report.verdict(self.totals, "cuda" if self._cuda else "cpu")
        text = report.table(self.totals) + "\n" + self.verdict.line()
        self._give_end(trainer, text, report.summary_json(self.totals, self.verdict))

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._timer is not None:  # no collective here: another rank may be gone
            self._timer.detach()
        super().on_exception(trainer, pl_module, exception)

    # ------------------------------------------------------------------ windows
    def _read_cuda(self, block: bool) -> None:
        """Add the batches whose events have completed, oldest first; ``block`` waits for the rest."""
        while self._pending and self._pending[0].done(block):
            step = self._pending.pop(0)
            self._window.add_step(*step.seconds())

    def _flush(self, trainer: Trainer, last: bool = False) -> None:
        """Hand this window over (to rank 0 in an all-gather that runs while the next window trains)."""
        mine, self._window = self._window, RankTime(0, self._device)
        self._keep(trainer, logging_step(trainer, last), mine.vector(), hand_over=True)

    @override
    def _use(self, trainer: Trainer, step: int, rows: list[list[float]]) -> None:
        """Rank 0 adds every rank's window to the totals and logs the window's means."""
        if not trainer.is_global_zero:
            return
        labelled = enumerate(zip(self._labels, rows, strict=True))
        windows = [RankTime.from_vector(rank, label, row) for rank, (label, row) in labelled]
        # every rank's window, by rank, as the totals are
        self.totals = [t + w for t, w in zip(self.totals, windows, strict=True)] if self.totals else windows
        values = {k: v for w in windows for k, v in w.metrics(f"time/rank{w.rank}").items()}
        values["time/samples_per_s"] = report.run_samples_per_s(windows)
        for logger in trainer.loggers:
            logger.log_metrics(values, step=step)
