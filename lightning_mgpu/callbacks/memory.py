"""``DeviceMemoryMonitor``: memory of every device of a run, its balance, and what to do on OOM."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_mgpu.callbacks import memory_report as report
from lightning_mgpu.callbacks._distributed import all_gather_objects
from lightning_mgpu.callbacks._monitor import Monitor, logging_step
from lightning_mgpu.callbacks.memory_readings import (
    PlannedReading,
    device_label,
    micro_batch_sizes,
    plan_readings,
    replica_devices,
    strategy_kind,
    take_readings,
)
from lightning_mgpu.callbacks.memory_report import Facts, OOMContext, Reading, Summary
from lightning_mgpu.devices import cuda_devices
from lightning_mgpu.estimate.batch import batch_rows, tensors
from lightning_mgpu.estimate.model_state import ModelStateMeter
from lightning_mgpu.oom import is_out_of_memory

__all__ = ["DeviceMemoryMonitor"]

log = logging.getLogger(__name__)


class DeviceMemoryMonitor(Monitor):
    """Logs the memory of every device a run trains on, explains imbalance and out-of-memory failures.

    - Under ``mgpu_dp`` it reads every replica's device from the one process; under
      ``mgpu_ddp`` (or any DDP) every rank reads its own device and the readings are
      all-gathered, so rank 0's loggers hold all devices.
    - Readings are taken every ``every_n_steps`` and handed to the loggers in batches every
      ``flush_every_n_steps`` (under DDP: one asynchronous all-gather per batch), each under the
      step it was taken at; the rest of a batch is handed over at the end of fit, or, in a single
      process, when it fails.
    - ``memory/imbalance`` is the largest device's peak divided by the mean; above
      ``imbalance_threshold`` it warns once, naming the likely cause in this run.
    - At the end of ``fit`` rank 0 logs an ``nvidia-smi``-like table (``rank_zero_info``,
      on stderr unless logging is configured otherwise) and writes the
      same data to ``<trainer.log_dir>/memory_summary.json``; under a strategy given
      ``micro_batch_size=``, the rows per micro-batch each rank's last batch really ran in too.
      A line at the first batch says what it watches; beside ``DeviceTimeMonitor``, one report.
    - When a step runs out of memory (``torch.cuda.OutOfMemoryError`` or ``MemoryError``)
      the failing rank logs (``logging``, level ERROR) which device failed, what every device
      held (other ranks' devices as last gathered) and options computed from the run; the original exception
      is then raised as usual. This path runs no collective, so it cannot hang: the other
      ranks stop when their next collective loses the failed rank (``mgpu_ddp`` names the rank that failed).

    **Logged metrics** (MiB, one number per key, through ``logger.log_metrics`` on rank 0):

    - CUDA device ``<d>`` (``cuda:0``, ``cuda:1``, ...; ``node<n>:cuda:<i>`` on several machines):
      ``memory/<d>/allocated_MiB``, ``memory/<d>/reserved_MiB`` (caching allocator now),
      ``memory/<d>/peak_allocated_MiB``, ``memory/<d>/peak_reserved_MiB`` (peaks since the previous
      log; the callback resets the allocator's peak counters),
      ``memory/<d>/nvml_used_MiB`` (all processes and CUDA contexts, as ``nvidia-smi``; needs
      ``nvidia-ml-py``) and ``memory/<d>/total_MiB``.
    - CPU process of rank ``<r>``: ``memory/cpu:rank<r>/rss_MiB``, ``memory/cpu:rank<r>/peak_rss_MiB``.
    - Each rank's first device (its CPU process on CPU): ``memory/<d>/model_state_MiB``, the
      parameters, gradients and optimizer state the rank holds (under ``mgpu_fsdp`` its local
      shards, about 1/N of the model's; whole copies under the other strategies). The table's
      "Model state (rank)" column and ``model_state_bytes`` in the JSON show its largest value.
    - CPU ``mgpu_dp`` replica ``<i>`` (threads of one process, sharing its RSS):
      ``memory/cpu:replica<i>/saved_MiB``, the bytes it saved for backward in its last forward.
    - ``memory/imbalance``: max over devices of peak allocated (CUDA), saved bytes (CPU replicas)
      or peak RSS (CPU ranks), divided by the mean.

    Args:
        every_n_steps: log every this many optimizer steps (batches, without gradient
            accumulation); ``None`` follows ``Trainer(log_every_n_steps=...)``.
        imbalance_threshold: warn once when ``memory/imbalance`` exceeds this.
        summary_file: JSON written at the end of fit, relative to ``trainer.log_dir``;
            ``None`` writes none.
        print_summary: whether rank 0 logs the start line and the end-of-fit table.
        flush_every_n_steps: hand the readings taken so far to the loggers at the first log
            at least this many training batches after the previous hand-over (under DDP after
            one all-gather of every rank's readings). Batching keeps logging every step cheap
            (one collective, and the logging done while the code is warm); the loggers get
            the readings up to this many steps late, each with the step it was read at.
            1 hands every reading over at once.

    Raises:
        ValueError: if ``every_n_steps`` or ``flush_every_n_steps`` is not a positive integer, or
            the threshold is below 1.

    Example::

        import lightning as L
        from lightning_mgpu import DeviceMemoryMonitor

        trainer = L.Trainer(strategy="mgpu_ddp", devices=2, callbacks=[DeviceMemoryMonitor(every_n_steps=10)])
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        imbalance_threshold: float = 1.25,
        summary_file: str | None = "memory_summary.json",
        print_summary: bool = True,
        flush_every_n_steps: int = 25,
    ) -> None:
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ValueError(f"every_n_steps must be a positive integer or None, got {every_n_steps!r}")
        super().__init__(flush_every_n_steps, summary_file, print_summary)
        if not imbalance_threshold >= 1.0:
            raise ValueError(
                f"imbalance_threshold must be at least 1.0 (balanced), got {imbalance_threshold!r}"
            )
        self.every_n_steps = every_n_steps
        self.imbalance_threshold = float(imbalance_threshold)
        self.summary = Summary()
        self.latest: list[Reading] = []
        self._every = 1
        self._batches = 0
        self._firsts: list[list[Reading]] | None = None  # every rank's first readings: what its vectors hold
        self._device_plan: list[PlannedReading] | None = None
        self._meter = ModelStateMeter()
        self._width = 0  # numbers in the widest rank's row
        self._warned = False
        self._rows: int | None = None
        self._step_at_start = 0
        self._largest_ok: int | None = None

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        self._every = self.every_n_steps or max(1, int(getattr(trainer, "log_every_n_steps", 50)))
        if not trainer.loggers:
            rank_zero_warn(
                "DeviceMemoryMonitor: the Trainer has no logger, so memory/* metrics are not logged;"
                " the end-of-fit table, the summary JSON and the OOM guidance still work."
            )
        strategy = trainer.strategy
        if replica_devices(trainer) and strategy.root_device.type == "cpu":
            # CPU replicas share one RSS; the strategy then counts what each saved for backward
            strategy.track_replica_memory = True  # type: ignore[attr-defined]

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # a second fit with this monitor reports its own peaks, imbalance and largest batch, not the first's
        self.summary, self._warned, self._largest_ok = Summary(), False, None
        self._batches = 0
        self._device_plan = None
        self._firsts = self._open(trainer, self._read(trainer, reset_peak=False))
        self._width = max(sum(len(r.vector()) for r in first) for first in self._firsts)
        # what the OOM guidance shows of the other ranks until the first gather
        self.latest = [r for rank in self._firsts for r in rank]
        self._start_line = (  # given at the first batch, below the strategy's start-up summary
            f"DeviceMemoryMonitor: memory of {len(self.latest)} device(s), read every {self._every} step(s);"
            " a table of the peaks at the end"
        )

    # ------------------------------------------------------------------ steps
    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._give_start(trainer)
        # a gather started at the end of the last step ran while this batch was fetched
        self._finish_gather(trainer)
        self._rows = batch_rows(batch)
        self._step_at_start = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        per_device = self._per_device_batch(trainer)
        if per_device is not None:
            self._largest_ok = max(self._largest_ok or 0, per_device)
        # gradients accumulated over several batches before an optimizer step
        accumulating = pl_module.automatic_optimization and trainer.accumulate_grad_batches > 1
        if trainer.global_step == self._step_at_start and accumulating:
            return  # Lightning logs once per optimizer step, and so does the monitor
        self._batches += 1
        if self._batches % self._every == 0:
            self._collect_and_log(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._firsts is None:
            self._give_end(trainer, None, None)
            return
        if self._batches % self._every != 0:  # include the peaks since the last log
            self._collect_and_log(trainer, last=True)
        elif self._kept:
            self._hand_over(trainer)
        self._finish_gather(trainer)
        self.summary.micro_batches = micro_batch_sizes(trainer)  # a gather, when micro-batching
        rows, sizes = list(self.summary.devices.values()), self.summary.micro_batches
        table = report.table(rows, "Device memory over the fit (peaks):", sizes) if rows else None
        self._give_end(trainer, table, self.summary.as_json() if rows else None)

    # ------------------------------------------------------------------ OOM
    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._rows_on is None and self._kept:
            # the readings up to the failure, for the plot; under DDP a gather could hang now
            with contextlib.suppress(Exception):
                self._hand_over(trainer)
        super().on_exception(trainer, pl_module, exception)
        if not is_out_of_memory(exception):
            log.debug("not an out-of-memory error, no guidance: %s", type(exception).__name__)
            return
        try:  # the original error must surface whatever happens here
            message = self._oom_message(trainer, exception)
        except Exception as err:  # pragma: no cover - defensive
            message = f"DeviceMemoryMonitor could not describe the out-of-memory error: {err!r}"
        log.error(message)  # from the rank that ran out

    def _oom_message(self, trainer: Trainer, exception: BaseException) -> str:
        local = self._read(trainer, reset_peak=False)
        mine = {r.device for r in local}
        readings = [r for r in self.latest if r.device not in mine] + local
        readings.sort(key=lambda r: (r.rank, r.device))
        root = trainer.strategy.root_device
        failed = local[0].device if local else str(root)
        match = re.search(r"GPU (\d+)", str(exception))
        if isinstance(exception, torch.cuda.OutOfMemoryError) and match:
            failed = device_label(trainer, torch.device("cuda", int(match.group(1))))
        replicas = replica_devices(trainer)
        available = (
            torch.cuda.device_count() * trainer.num_nodes if root.type == "cuda" else trainer.world_size
        )
        ctx = OOMContext(
            failed_device=failed,
            rank=trainer.global_rank,
            step=trainer.global_step,
            strategy=strategy_kind(trainer),
            devices_used=len(replicas) if replicas else trainer.world_size,
            devices_available=available,
            accelerator=root.type,
            batch_per_device=self._per_device_batch(trainer),
            largest_ok=self._largest_ok,
            accumulate=trainer.accumulate_grad_batches,
            precision=str(trainer.precision),
        )
        return report.oom_guidance(exception, ctx, readings)

    # ------------------------------------------------------------------ reading
    def _per_device_batch(self, trainer: Trainer) -> int | None:
        replicas = replica_devices(trainer)
        if not replicas:
            return self._rows
        chunks = list(getattr(trainer.strategy, "last_chunk_sizes", None) or [])
        if chunks:
            return int(max(chunks))
        return math.ceil(self._rows / len(replicas)) if self._rows else None

    def _read(self, trainer: Trainer, reset_peak: bool) -> list[Reading]:
        if self._device_plan is None:
            self._device_plan, self._meter = plan_readings(trainer), ModelStateMeter()  # once a fit
        return take_readings(trainer, self._device_plan, self._rows, reset_peak, self._meter)

    def _collect_and_log(self, trainer: Trainer, last: bool = False) -> None:
        """Read this process's devices and keep the reading; hand the kept ones over when due.

        Readings wait in a buffer until ``flush_every_n_steps`` batches have passed since the
        last hand-over (or the fit ends). Under DDP one asynchronous all-gather then carries
        every buffered reading of every rank, and runs while Lightning logs and fetches the
        next batch. Each reading is logged with the step it was read at, the step Lightning's
        own logging used for that batch. Every rank counts the same batches, so they all
        reach each gather together.
        """
        readings = self._read(trainer, reset_peak=True)
        row = [x for r in readings for x in r.vector()]
        row += [math.nan] * (self._width - len(row))  # every rank's as long as the widest rank's
        # the kept readings, this one included, span this many batches since the last hand-over
        due = last or (len(self._kept) + 1) * self._every >= self.flush_every_n_steps
        self._keep(trainer, logging_step(trainer, last), row, hand_over=due)

    @override
    def _use(self, trainer: Trainer, step: int, rows: list[list[float]]) -> None:
        """Summarize, check the balance of and log one reading of every device."""
        ranks = zip(self._firsts or [], rows, strict=True)
        readings = [reading for firsts, row in ranks for reading in report.from_row(firsts, row)]
        ratio, fullest = report.imbalance(readings)
        self.latest = readings
        self.summary.update(readings, ratio)
        if ratio > self.imbalance_threshold and not self._warned and fullest is not None:
            log.debug(
                "%s holds %.2fx the mean (threshold %.2f): warning once",
                fullest.device,
                ratio,
                self.imbalance_threshold,
            )
            self._warned = True
            facts = self._facts(trainer, readings)  # collective: every rank reaches it with the same data
            message = report.imbalance_warning(
                fullest, ratio, self.imbalance_threshold, report.likely_causes(fullest, ratio, facts)
            )
            rank_zero_warn(message)
        if trainer.is_global_zero and trainer.loggers:
            values = report.metrics(readings)
            values["memory/imbalance"] = ratio
            for logger in trainer.loggers:
                logger.log_metrics(values, step=step)

    def _facts(self, trainer: Trainer, readings: list[Reading]) -> Facts:
        strategy = trainer.strategy
        root = strategy.root_device
        mine: dict[str, Any] = {"rank": trainer.global_rank, "pid": os.getpid(), "state": {}, "allocated": {}}
        for t in [t for opt in trainer.optimizers for state in opt.state.values() for t in tensors(state)]:
            if t.dim() > 0 and t.device != root:
                label = device_label(trainer, t.device)
                mine["state"][label] = mine["state"].get(label, 0) + t.numel() * t.element_size()
        if root.type == "cuda" and torch.cuda.is_initialized():
            for i in range(torch.cuda.device_count()):
                held = torch.cuda.memory_allocated(i)
                if i != root.index and held > 0:
                    mine["allocated"][device_label(trainer, torch.device("cuda", i))] = held
        everyone = all_gather_objects(trainer, mine)
        facts = Facts(strategy=strategy_kind(trainer), root_device=device_label(trainer, root))
        facts.chunk_sizes = [int(c) for c in getattr(strategy, "last_chunk_sizes", None) or []]
        facts.rows_per_rank = {r.rank: r.rows for r in readings if r.kind != "replica"}
        facts.optimizer_state_elsewhere = {m["rank"]: m["state"] for m in everyone if m["state"]}
        facts.allocated_elsewhere = {m["rank"]: m["allocated"] for m in everyone if m["allocated"]}
        if root.type == "cuda" and trainer.num_nodes == 1:
            rank_of = {m["pid"]: m["rank"] for m in everyone}
            for info in cuda_devices():
                ranks = [rank_of[p.pid] for p in info.processes if p.pid in rank_of]
                if ranks:
                    facts.contexts[device_label(trainer, torch.device("cuda", info.index))] = ranks
        return facts
