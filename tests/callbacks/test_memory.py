"""DeviceMemoryMonitor in real runs: one process and DP replicas reach the logger, summary, OOM guidance.

The runs over DDP ranks are in ``test_memory_ddp.py``.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import DeviceMemoryMonitor
from lightning_mgpu.callbacks.memory_report import (
    Facts,
    OOMContext,
    Reading,
    likely_causes,
    oom_guidance,
    table,
)
from tests.helpers import run_script


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def memory_rows(log_dir: Path) -> list[dict[str, str]]:
    rows = read_csv(next(log_dir.rglob("metrics.csv")))
    return [r for r in rows if r.get("memory/imbalance")]


class Small(L.LightningModule):
    def __init__(self, fail_at_rows: int | None = None) -> None:
        super().__init__()
        self.net = nn.Linear(8, 1)
        self.fail_at_rows = fail_at_rows

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if x.shape[0] == self.fail_at_rows:
            raise MemoryError("cannot allocate memory")
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(
    tmp_path: Path, callback: DeviceMemoryMonitor, loader: DataLoader, model: L.LightningModule, **kw: Any
) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        default_root_dir=tmp_path,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )
    trainer.fit(model, loader)
    return trainer


def dataset(n: int = 32) -> TensorDataset:
    return TensorDataset(torch.randn(n, 8), torch.randn(n, 1))


def test_single_process_interval_final_log_and_summary_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monitor = DeviceMemoryMonitor(every_n_steps=3, summary_file="mem.json", print_summary=False)
    trainer = fit(tmp_path, monitor, DataLoader(dataset(), batch_size=4), Small(), logger=CSVLogger(tmp_path))
    rows = memory_rows(tmp_path)
    # after batches 3 and 6, and the rest at the end, under the steps Lightning logged them at
    assert [int(r["step"]) for r in rows] == [2, 5, 7]
    assert all(float(r["memory/cpu:rank0/rss_MiB"]) > 50 for r in rows)
    assert all(float(r["memory/imbalance"]) == 1.0 for r in rows)
    summary = json.loads((Path(trainer.log_dir) / "mem.json").read_text())
    assert summary["devices"][0]["device"] == "cpu:rank0"
    assert summary["logs"] == 3
    assert "Device memory over the fit" not in caplog.text


def test_a_second_fit_reports_its_own_readings(tmp_path: Path) -> None:
    monitor = DeviceMemoryMonitor(every_n_steps=1, print_summary=False)
    fit(tmp_path / "first", monitor, DataLoader(dataset(12), batch_size=4), Small())
    assert summary_logs(tmp_path / "first") == 3
    batches = [list(range(0, 2)), list(range(2, 6)), list(range(6, 14))]  # 2, 4, then 8 rows
    with pytest.raises(MemoryError):  # two readings, then the failure
        fit(
            tmp_path / "failed",
            monitor,
            DataLoader(dataset(16), batch_sampler=batches),
            Small(fail_at_rows=8),
        )
    fit(tmp_path / "second", monitor, DataLoader(dataset(8), batch_size=4), Small())
    assert summary_logs(tmp_path / "second") == 2  # its two steps, none of the earlier fits'


def test_gradient_accumulation_logs_once_per_optimizer_step(tmp_path: Path) -> None:
    monitor = DeviceMemoryMonitor(every_n_steps=1)
    loader = DataLoader(dataset(28), batch_size=4)  # 7 batches: 3 steps of 2 and a last one alone
    fit(tmp_path, monitor, loader, Small(), logger=CSVLogger(tmp_path), accumulate_grad_batches=2)
    rows = read_csv(next(tmp_path.rglob("metrics.csv")))
    memory = [int(r["step"]) for r in rows if r.get("memory/imbalance")]
    assert memory == [0, 1, 2, 3]
    assert summary_logs(tmp_path) == 4


def summary_logs(root: Path) -> int:
    return int(json.loads(next(root.rglob("memory_summary.json")).read_text())["logs"])


def test_without_logger_warns_and_still_writes_summary(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.warns(UserWarning, match="no logger"):
        fit(
            tmp_path,
            DeviceMemoryMonitor(every_n_steps=2),
            DataLoader(dataset(8), batch_size=4),
            Small(),
            logger=False,
        )
    assert json.loads((tmp_path / "memory_summary.json").read_text())["devices"][0]["device"] == "cpu:rank0"
    assert "| cpu:rank0 | CPU process |" in caplog.text


def test_out_of_memory_reports_batches_and_options_then_reraises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    batches = [list(range(0, 2)), list(range(2, 6)), list(range(6, 14))]  # 2, 4, then 8 rows
    loader = DataLoader(dataset(16), batch_sampler=batches)
    with pytest.raises(MemoryError, match="cannot allocate memory"):
        fit(
            tmp_path,
            DeviceMemoryMonitor(every_n_steps=1),
            loader,
            Small(fail_at_rows=8),
            logger=CSVLogger(tmp_path),
        )
    # the readings of the steps before the failure still reach the logger, for the plot
    assert [int(r["step"]) for r in memory_rows(tmp_path)] == [0, 1]
    err = caplog.text
    assert "Out of memory on cpu:rank0 (rank 0) at step 2: MemoryError: cannot allocate memory" in err
    assert "| cpu:rank0 | CPU process |" in err
    assert (
        "8 rows per device now; the largest that finished a step so far is 4; try 4 rows per device." in err
    )
    assert "DataLoader batch_size=4 and Trainer(accumulate_grad_batches=2) (now 1)" in err
    assert "precision: 32-true now; precision='bf16-mixed'" in err
    assert "mgpu_ddp instead" not in err  # only offered to mgpu_dp runs


def test_other_errors_print_no_guidance(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class Broken(Small):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        fit(tmp_path, DeviceMemoryMonitor(), DataLoader(dataset(8), batch_size=4), Broken(), logger=False)
    assert "Out of memory" not in caplog.text


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="every_n_steps must be a positive integer"):
        DeviceMemoryMonitor(every_n_steps=0)
    with pytest.raises(ValueError, match="^flush_every_n_steps must be a positive integer, got 0"):
        DeviceMemoryMonitor(flush_every_n_steps=0)
    with pytest.raises(ValueError, match="imbalance_threshold must be at least 1.0"):
        DeviceMemoryMonitor(imbalance_threshold=0.9)


class WideRows(L.LightningModule):
    """Activations grow with the rows; the weight is one number, so rows decide each replica's memory."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return (x * self.scale).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_dp_replicas_reach_the_logger_and_uneven_split_is_named(tmp_path: Path) -> None:
    loader = DataLoader(TensorDataset(torch.randn(12, 4096)), batch_size=3)  # 2 replicas: 2 rows and 1 row
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="mgpu_dp",
        max_epochs=1,
        logger=CSVLogger(tmp_path),
        callbacks=[DeviceMemoryMonitor(every_n_steps=1)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.warns(UserWarning, match="Memory is unbalanced") as record:
        trainer.fit(WideRows(), loader)
    rows = memory_rows(tmp_path)
    assert len(rows) == 4
    for row in rows:
        first, second = (
            float(row["memory/cpu:replica0/saved_MiB"]),
            float(row["memory/cpu:replica1/saved_MiB"]),
        )
        assert first == pytest.approx(2 * second, rel=0.05)
        assert float(row["memory/cpu:rank0/rss_MiB"]) > 50
        assert float(row["memory/imbalance"]) == pytest.approx(4 / 3, rel=0.05)
    messages = [str(w.message) for w in record if "Memory is unbalanced" in str(w.message)]
    assert len(messages) == 1
    assert "cpu:replica0" in messages[0]
    assert "uneven splits: the replicas got [2, 1] rows" in messages[0]


class OutOfMemoryOnThirdBatch(WideRows):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 2:
            raise MemoryError("replica could not allocate")
        return super().training_step(batch, batch_idx)


def test_dp_out_of_memory_offers_mgpu_ddp(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="mgpu_dp",
        max_epochs=1,
        logger=False,
        callbacks=[DeviceMemoryMonitor(every_n_steps=1)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(MemoryError, match="replica could not allocate"):
        trainer.fit(OutOfMemoryOnThirdBatch(), DataLoader(TensorDataset(torch.randn(32, 64)), batch_size=8))
    err = caplog.text
    assert "Out of memory on cpu:rank0 (rank 0) at step 2" in err
    assert "| cpu:replica0 | CPU replica |" in err
    assert "4 rows per device now; the largest that finished a step so far is 4" in err
    assert "DataLoader batch_size=4 and Trainer(accumulate_grad_batches=2)" in err  # 2 rows on each of 2
    assert "strategy='mgpu_ddp' instead of mgpu_dp" in err


def test_oom_guidance_for_a_gpu_dp_run() -> None:
    ctx = OOMContext(
        failed_device="cuda:0",
        rank=0,
        step=12,
        strategy="mgpu_dp",
        devices_used=2,
        devices_available=4,
        accelerator="cuda",
        batch_per_device=32,
        largest_ok=None,
        accumulate=2,
        precision="bf16-mixed",
    )
    card = reading("cuda:0", 0, 30 * 2**30)
    text = oom_guidance(
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has"), ctx, [card]
    )
    assert text.startswith("Out of memory on cuda:0 (rank 0) at step 12: RuntimeError: CUDA out of memory.")
    assert "| cuda:0 | GPU  | 30.00 GiB" in text
    assert "32 rows per device now; no step has finished yet; try 16 rows per device." in text
    assert "DataLoader batch_size=32 and Trainer(accumulate_grad_batches=4) (now 2)" in text
    assert "strategy='mgpu_ddp' instead of mgpu_dp" in text
    assert "more devices: 2 of 4 are used; devices=4" in text
    assert "precision: already bf16-mixed." in text


def test_table_shows_small_sizes_in_their_own_unit() -> None:
    """KiB-sized replicas must not read as 0 beside a warning that they differ."""
    replicas = [
        Reading(f"cpu:replica{i}", "replica", 0, "CPU replica", {"saved": saved})
        for i, saved in enumerate((4800.0, 3264.0))
    ]
    text = table(replicas + [Reading("cpu", "cpu", 0, "CPU", {"rss": 3 * 2**30, "peak_rss": math.nan})])
    assert "| cpu:replica0 | CPU replica | -        | -        | 4.69 KiB" in text
    assert "| cpu:replica1 | CPU replica | -        | -        | 3.19 KiB" in text
    assert "| cpu          | CPU         | 3.00 GiB | -        | -" in text


def reading(device: str, rank: int, peak: float, rows: float = 8) -> Reading:
    values = dict.fromkeys(("allocated", "reserved", "peak_reserved", "nvml_used", "total"), math.nan)
    return Reading(device, "cuda", rank, "GPU", values | {"peak_allocated": peak}, rows)


def test_likely_causes_name_each_known_cause() -> None:
    card0, card1 = reading("cuda:0", 0, 3e9), reading("cuda:1", 1, 1e9)
    dp = likely_causes(card0, 1.5, Facts("mgpu_dp", root_device="cuda:0", chunk_sizes=[8, 8]))
    assert len(dp) == 1
    assert "mgpu_dp gathers every replica's outputs and computes the loss on cuda:0" in dp[0]
    uneven = likely_causes(card0, 1.5, Facts("mgpu_dp", root_device="cuda:0", chunk_sizes=[9, 8, 8]))
    assert "uneven splits: the replicas got [9, 8, 8] rows" in uneven[1]
    ranks = likely_causes(card0, 1.5, Facts("ddp", root_device="cuda:0", rows_per_rank={0: 12, 1: 4}))
    assert ranks == ["uneven splits: ranks got different batches in the last step (rank 0: 12, rank 1: 4)"]
    state = likely_causes(card0, 1.5, Facts("ddp", optimizer_state_elsewhere={1: {"cuda:0": 2**30}}))
    assert state[0].startswith("optimizer state on cuda:0: rank 1 keeps 1.00 GiB")
    stray = likely_causes(card0, 1.5, Facts("ddp", contexts={"cuda:0": [0, 1, 2]}))
    assert stray[0].startswith("a stray CUDA context on cuda:0: rank(s) 1, 2 also use cuda:0")
    allocated = likely_causes(card0, 1.5, Facts("ddp", allocated_elsewhere={3: {"cuda:0": 10}}))
    assert "rank(s) 3 also use cuda:0" in allocated[0]
    nothing = likely_causes(card1, 1.5, Facts("ddp", contexts={"cuda:0": [0, 1]}))
    assert nothing[0].startswith("none of the usual causes")


@pytest.mark.gpu
def test_cuda_keys_table_and_oom(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class Big(Small):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if batch_idx == 2:
                torch.empty(2**50, device=self.device)  # more than any GPU holds
            return super().training_step(batch, batch_idx)

    loader = DataLoader(dataset(16), batch_size=4)
    trainer = L.Trainer(
        accelerator="gpu",
        devices=1,
        max_epochs=1,
        logger=CSVLogger(tmp_path),
        callbacks=[DeviceMemoryMonitor(every_n_steps=1)],
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    with pytest.raises(torch.cuda.OutOfMemoryError):
        trainer.fit(Big(), loader)
    err = caplog.text
    assert "Out of memory on cuda:0 (rank 0) at step 2" in err
    assert f"| cuda:0 | {torch.cuda.get_device_name(0)} |" in err
    rows = memory_rows(tmp_path)
    assert len(rows) == 2
    for key in ("allocated", "reserved", "peak_allocated", "peak_reserved", "total"):
        assert float(rows[0][f"memory/cuda:0/{key}_MiB"]) >= 0
    assert float(rows[0]["memory/cuda:0/peak_allocated_MiB"]) > 0
    assert float(rows[0]["memory/cuda:0/total_MiB"]) > 1000


def test_cpu_allocator_failure_gets_the_guidance(tmp_path: Path) -> None:
    """torch's CPU allocator says "can't allocate memory", not "out of memory": it is still an OOM."""
    code = """
import resource, sys
import lightning as L, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from lightning_mgpu import DeviceMemoryMonitor

class Greedy(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            # the address space this process has, plus 1 GiB: the allocator then fails for real
            status = open("/proc/self/status").read()
            size = int(status.split("VmSize:")[1].split()[0]) * 1024
            hard = resource.getrlimit(resource.RLIMIT_AS)[1]
            resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), hard))
            torch.empty(1 << 36, dtype=torch.uint8)  # 64 GiB
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

trainer = L.Trainer(
    accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
    callbacks=[DeviceMemoryMonitor(every_n_steps=1)], enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(Greedy(), DataLoader(TensorDataset(torch.randn(32, 8), torch.randn(32, 1)), batch_size=4))
"""
    result = run_script(code, tmp_path, timeout=120)
    assert result.returncode != 0
    err = result.output
    assert "DefaultCPUAllocator: can't allocate memory" in err  # the original error, re-raised
    assert "Out of memory on cpu:rank0 (rank 0) at step 2: RuntimeError: [enforce fail" in err
    assert (
        "4 rows per device now; the largest that finished a step so far is 4; try 2 rows per device." in err
    )
    assert "| cpu:rank0 | CPU process |" in err
