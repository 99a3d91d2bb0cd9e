"""One run of a validated config: the run folder, the task, and the summary that ends it.

The run folder (``run_dir``, by default ``runs/<recipe>-<date>-<time>``) must be new or empty (a
folder holding files is refused before anything starts, so two runs never mix); it receives:

- ``config.yaml``: the resolved config;
- ``metrics.csv`` (and ``hparams.yaml``): every logged metric (Lightning's ``CSVLogger``);
- ``checkpoints/``: ``ModelCheckpoint``'s files and, next to each, plain ``.safetensors`` weights;
- ``memory_summary.json`` (the memory monitor's per-device peaks) and ``memory.png`` (its plot, when
  matplotlib is installed);
- ``time_summary.json``: the time monitor's per-rank data loading, work and waiting, and its verdict,
  and ``time.png`` (one bar per rank, when matplotlib is installed);
- ``predictions.csv`` for ``task: predict``.

Under DDP every process runs this; Lightning's launcher passes the run folder to the processes
it starts through ``LIGHTNING_MGPU_RUN_DIR``, and only rank 0 writes the config and returns the
summary (``lightning-mgpu run`` prints it).

A job SLURM requeued (``SLURM_RESTART_COUNT`` set, after a time limit's signal made Lightning
save ``hpc_ckpt_<n>.ckpt`` in the run folder and requeue it) comes back to a run folder that holds
its own earlier files: when that folder holds a ``config.yaml``, the run goes on there, the earlier
attempt's ``metrics.csv`` kept as ``metrics-attempt<k>.csv``, and Lightning resumes from the newest
``hpc_ckpt_*.ckpt`` by itself.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from omegaconf import OmegaConf

from lightning_mgpu._words import counted
from lightning_mgpu.callbacks.predictions import PredictionCSV
from lightning_mgpu.config.callbacks import build_callbacks
from lightning_mgpu.config.instantiate import build_data, build_module, build_trainer
from lightning_mgpu.config.schema import RunConfig
from lightning_mgpu.strategies.resume.restart import env_count

RUN_DIR_ENV = "LIGHTNING_MGPU_RUN_DIR"

log = logging.getLogger(__name__)


def resolve_run_dir(cfg: RunConfig) -> Path:
    """The config's ``run_dir``, the launching process's (in a process Lightning started), or a new one."""
    if cfg.run_dir:
        log.debug("run folder %s: the config's run_dir", cfg.run_dir)
        return Path(cfg.run_dir).expanduser()
    if os.environ.get(RUN_DIR_ENV):
        log.debug("run folder %s: the launching process's (%s)", os.environ[RUN_DIR_ENV], RUN_DIR_ENV)
        return Path(os.environ[RUN_DIR_ENV])
    base = Path("runs") / f"{cfg.recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    log.debug("run folder %s: a new one, as run_dir is unset", path)
    return path


def check_run_dir_unused(cfg: RunConfig, run_dir: Path) -> None:
    """Refuse a ``run_dir`` that already holds files: this run's files would mix with them.

    Raises:
        ValueError: ``run_dir`` is a file, or a folder that is not empty; the message says what to do.
    """
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise ValueError(f"run_dir {run_dir} is a file; set run_dir to a new folder")
    held = sorted(p.name for p in run_dir.iterdir())
    if not held:
        return
    shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
    fix = "set another run_dir, or leave it unset for a new folder under runs/"
    weights = Path(cfg.weights).expanduser().resolve() if cfg.weights else None
    if weights is None or not weights.is_relative_to(run_dir.resolve()):
        fix += f", or delete {run_dir} first"
    raise ValueError(f"run_dir {run_dir} already holds files ({shown}) that this run's would mix with; {fix}")


def slurm_restarts() -> int:
    """How many times SLURM requeued this job: 0 outside SLURM and on a job's first attempt."""
    return env_count(os.environ, "SLURM_RESTART_COUNT") if SLURMEnvironment.detect() else 0


def continue_requeued(run_dir: Path, restarts: int) -> bool:
    """Go on in the run folder of this job's earlier attempt, if it is one; returns whether it is.

    The earlier attempt's ``metrics.csv`` is kept as ``metrics-attempt<restarts>.csv`` (Lightning's
    CSV logger would delete it).
    """
    if restarts < 1 or not (run_dir / "config.yaml").is_file():
        return False
    metrics = run_dir / "metrics.csv"
    if metrics.is_file():
        metrics.rename(run_dir / f"metrics-attempt{restarts}.csv")
    job = os.environ.get("SLURM_JOB_ID", "?")
    rank_zero_info(
        f"SLURM job {job} requeued ({restarts} time(s)): going on in {run_dir}, where its earlier attempt"
        " left its files; Lightning resumes from the newest hpc_ckpt_*.ckpt there"
    )
    return True


def run_job(cfg: RunConfig) -> str | None:
    """Build everything ``cfg`` describes and run its task; returns rank 0's closing summary, else ``None``.

    Raises:
        ValueError: settings Lightning refuses, or a global batch that does not divide over the processes.
        FileNotFoundError: data or weights that are not where the config says.
    """
    from lightning_mgpu.recipes._base import per_process_batch_size

    if cfg.seed is not None:
        L.seed_everything(cfg.seed, workers=True, verbose=False)
    run_dir = resolve_run_dir(cfg)
    launcher = RUN_DIR_ENV not in os.environ  # not one of the processes Lightning's launcher started
    launching = launcher and getattr(rank_zero_only, "rank", 0) == 0
    if launching and not continue_requeued(run_dir, slurm_restarts()):
        check_run_dir_unused(cfg, run_dir)  # the launching process decides, before anything starts
    data = build_data(cfg)
    module = build_module(cfg)
    callbacks = build_callbacks(cfg.callbacks, run_dir)
    if cfg.task == "predict":
        callbacks.append(PredictionCSV(run_dir / "predictions.csv"))
    trainer = build_trainer(cfg, run_dir, callbacks)
    per_process_batch_size(cfg.data.batch_size, trainer.world_size)  # fail before any process starts
    if getattr(rank_zero_only, "rank", 0) == 0:
        if isinstance(trainer.logger, CSVLogger):
            _ = trainer.logger.experiment  # the CSV logger first: it warns about a folder that is not empty
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    os.environ[RUN_DIR_ENV] = str(run_dir.resolve())
    start = time.monotonic()
    try:
        if cfg.task == "fit":
            trainer.fit(module, datamodule=data)
        elif cfg.task == "validate":
            trainer.validate(module, datamodule=data)
        else:
            trainer.predict(module, datamodule=data, return_predictions=False)
    finally:
        if launcher:
            os.environ.pop(RUN_DIR_ENV, None)
    if trainer.is_global_zero:
        seconds = time.monotonic() - start
        notes = _draw_plots(cfg, run_dir)  # before the summary, which lists the files drawn
        return "\n".join([summary(cfg, trainer, run_dir, seconds), *notes])
    return None


def _draw_plots(cfg: RunConfig, run_dir: Path) -> list[str]:
    """Draw ``memory.png`` from the logged memory metrics and ``time.png`` from ``time_summary.json``;
    returns why one could not be drawn."""
    from lightning_mgpu.plot import plot_memory, plot_time

    notes = []
    metrics, times = run_dir / "metrics.csv", run_dir / "time_summary.json"
    if cfg.task == "fit" and cfg.callbacks.memory.enabled and metrics.is_file():
        try:
            plot_memory(metrics, run_dir / "memory.png", title=f"{cfg.recipe}: memory per device")
        except ImportError as err:
            notes.append(f"no memory.png: {err}")
        except ValueError:  # too short a run to log memory (e.g. fewer steps than every_n_steps)
            pass
    if times.is_file():
        try:
            plot_time(times, run_dir / "time.png")
        except (ImportError, ValueError) as err:
            notes.append(f"no time.png: {err}")
    return notes


def summary(cfg: RunConfig, trainer: L.Trainer, run_dir: Path, seconds: float) -> str:
    """The closing report: what ran, the metric values, the files written and each device's peak memory."""
    strategy = getattr(trainer.strategy, "strategy_name", None) or type(trainer.strategy).__name__
    where = counted(trainer.num_devices, f"{trainer.strategy.root_device.type} device")
    where += f" x {trainer.num_nodes} nodes" if trainer.num_nodes > 1 else ""
    lines = [f"{cfg.recipe}: {cfg.task} done in {seconds:.1f} s with {strategy} on {where}"]
    if cfg.task == "fit":
        steps = counted(trainer.global_step, "optimizer step")
        lines[0] += f", {counted(trainer.current_epoch, 'epoch')}, {steps}"
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    if metrics:
        lines.append("metrics:")
        width = max(len(k) for k in metrics)
        lines += [f"  {k:<{width}}  {metrics[k]:.4f}" for k in sorted(metrics, key=_metric_order)]
    lines.append(f"written to {run_dir}/:")
    lines += [f"  {line}" for line in _describe_files(trainer, run_dir)]
    lines += _time_lines(trainer)
    lines.append("peak memory:")
    lines += [f"  {line}" for line in _peak_memory_lines(trainer)]
    return "\n".join(lines)


def _metric_order(name: str) -> tuple[int, str]:
    return (0 if name.startswith("val") else 1 if name.startswith("train") else 2, name)


def _describe_files(trainer: L.Trainer, run_dir: Path) -> list[str]:
    best = getattr(trainer.checkpoint_callback, "best_model_path", "")  # ModelCheckpoint's, if it ran
    notes = {
        "config.yaml": "the resolved config",
        "metrics.csv": "every logged metric",
        "hparams.yaml": "the module's hyperparameters",
        "predictions.csv": "index, name, predicted class, probability",
        "memory.png": "memory of each device over the steps",
        "memory_summary.json": "each device's peak memory",
        "time_summary.json": "each rank's data loading, work and waiting time, and the slow rank",
        "time.png": "each rank's time as one bar: data loading, work, waiting",
    }
    out = []
    # a sharded checkpoint (mgpu_fsdp) is a folder named like a file: one entry, not its shards
    folders = [p for p in run_dir.rglob("*.ckpt") if p.is_dir()]
    listed = [p for p in run_dir.rglob("*") if p.is_file() and not any(p.is_relative_to(f) for f in folders)]
    for path in sorted(listed + folders):
        rel = path.relative_to(run_dir).as_posix()
        note = notes.get(rel, "")
        if path.suffix == ".ckpt":
            note = "best checkpoint" if best and Path(best).resolve() == path.resolve() else "checkpoint"
            if path.is_dir():
                shards = len(list(path.glob("*.distcp")))
                rel, note = f"{rel}/", f"{note}, sharded: a folder of {shards} shard file(s)"
        elif path.suffix in (".safetensors", ".pt") and path.parent.name == "checkpoints":
            ckpt = path.with_suffix(".ckpt")
            note = f"plain weights of {ckpt.name}" if ckpt.exists() else "plain weights at the end of fit"
        out.append(f"{rel}  {note}".rstrip())
    return out


def _time_lines(trainer: L.Trainer) -> list[str]:
    """The time monitor's table and verdict, when it timed this fit."""
    from lightning_mgpu.callbacks.time import DeviceTimeMonitor
    from lightning_mgpu.callbacks.time_report import table

    callbacks = getattr(trainer, "callbacks", [])  # set at run time, unknown to type checkers
    monitor = next((cb for cb in callbacks if isinstance(cb, DeviceTimeMonitor)), None)
    if monitor is None or monitor.verdict is None:
        return []
    lines = [*table(monitor.totals, title="").splitlines(), monitor.verdict.line()]
    return ["time per rank:", *(f"  {line}" for line in lines)]


def _peak_memory_lines(trainer: L.Trainer) -> list[str]:
    """The memory monitor's table of each device's fit-wide peaks (and each rank's micro-batch size), else
    this process's own device."""
    from lightning_mgpu.callbacks.memory import DeviceMemoryMonitor
    from lightning_mgpu.callbacks.memory_report import table
    from lightning_mgpu.devices import format_bytes, process_memory

    callbacks = getattr(trainer, "callbacks", [])  # set at run time, unknown to type checkers
    monitor = next((cb for cb in callbacks if isinstance(cb, DeviceMemoryMonitor)), None)
    if monitor is not None and monitor.summary.devices:
        rows, sizes = list(monitor.summary.devices.values()), monitor.summary.micro_batches
        return table(rows, micro_batches=sizes).splitlines()
    device = trainer.strategy.root_device  # the monitor is off, or the run was too short to read it
    if device.type == "cuda":
        return [f"{device}: peak allocated {format_bytes(torch.cuda.max_memory_allocated(device))}"]
    return [f"cpu:rank{trainer.global_rank}: peak RSS {format_bytes(process_memory()['peak_rss'])}"]
