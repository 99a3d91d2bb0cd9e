"""plot_memory: one line per device from logged metrics, limits dashed, clear errors."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import DeviceMemoryMonitor, plot_memory, plot_time

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def line_styles(fig: object) -> list[str]:
    return [line.get_linestyle() for line in fig.axes[0].get_lines()]  # type: ignore[attr-defined]


def test_one_line_per_device_and_dashed_limits(tmp_path: Path) -> None:
    rows = [
        {"step": step}
        | {f"memory/cuda:{i}/peak_allocated_MiB": 1000.0 * (i + 1) + step for i in range(3)}
        | {f"memory/cuda:{i}/total_MiB": 81559.0 for i in range(3)}
        for step in range(5)
    ]
    fig = plot_memory(rows, tmp_path / "out" / "memory.png")
    assert (tmp_path / "out" / "memory.png").read_bytes()[:8] == PNG_MAGIC
    assert line_styles(fig).count("-") == 3
    assert line_styles(fig).count("--") == 3
    solid = [line for line in fig.axes[0].get_lines() if line.get_linestyle() == "-"]
    assert [line.get_label() for line in solid] == [f"cuda:{i} peak_allocated" for i in range(3)]
    assert list(solid[2].get_ydata()) == [3000.0 + s for s in range(5)]


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_plots_a_real_run_folder(tmp_path: Path) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=CSVLogger(tmp_path / "runs"),
        callbacks=[DeviceMemoryMonitor(every_n_steps=1)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4))
    fig = plot_memory(tmp_path / "runs", tmp_path / "memory.png")  # finds the only metrics.csv below
    assert (tmp_path / "memory.png").read_bytes()[:8] == PNG_MAGIC
    assert line_styles(fig) == ["-"]  # one CPU rank, no per-device limit on CPU
    line = fig.axes[0].get_lines()[0]
    assert line.get_label() == "cpu:rank0 rss"
    assert list(line.get_xdata()) == [0, 1, 2, 3]


def test_field_choice_and_errors(tmp_path: Path) -> None:
    rows = [{"step": 0, "memory/cuda:0/peak_allocated_MiB": 5.0, "memory/cuda:0/reserved_MiB": 8.0}]
    fig = plot_memory(rows, tmp_path / "a.png", field="reserved")
    assert list(fig.axes[0].get_lines()[0].get_ydata()) == [8.0]
    with pytest.raises(ValueError, match="fields present: peak_allocated, reserved"):
        plot_memory(rows, tmp_path / "b.png", field="nvml_used")
    with pytest.raises(ValueError, match="no memory/\\* metrics"):
        plot_memory([{"step": 0, "train_loss": 1.0}], tmp_path / "c.png")
    with pytest.raises(FileNotFoundError, match="no such run folder"):
        plot_memory(tmp_path / "missing", tmp_path / "d.png")
    for version in ("version_0", "version_1"):
        (tmp_path / "runs" / version).mkdir(parents=True)
        (tmp_path / "runs" / version / "metrics.csv").write_text("step\n0\n")
    with pytest.raises(ValueError, match="holds several runs; pass one of"):
        plot_memory(tmp_path / "runs", tmp_path / "e.png")
    assert not list(tmp_path.glob("*.png.tmp*"))
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["a.png"]


def test_each_quantity_gets_its_own_panel_and_scale(tmp_path: Path) -> None:
    """An mgpu_dp run on CPU: the process's RSS in MiB, each replica's saved bytes in KiB below it."""
    rows = [
        {
            "step": step,
            "memory/cpu:rank0/rss_MiB": 450.0 + step,
            "memory/cpu:replica0/saved_MiB": 0.30,
            "memory/cpu:replica1/saved_MiB": 0.15,
        }
        for step in range(4)
    ]
    fig = plot_memory(rows, tmp_path / "memory.png")
    rss, saved = fig.axes
    assert [line.get_label() for line in rss.get_lines()] == ["cpu:rank0 rss"]
    assert rss.get_ylabel() == "MiB"
    assert [line.get_label() for line in saved.get_lines()] == ["cpu:replica0 saved", "cpu:replica1 saved"]
    assert saved.get_ylabel() == "KiB"
    assert list(saved.get_lines()[1].get_ydata()) == pytest.approx([0.15 * 1024] * 4)
    assert saved.get_ylim()[1] < 400  # on its own scale: the replicas do not lie flat on zero


def test_without_matplotlib_the_install_hint_comes_before_any_data_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # what a venv without [plot] gives
    with pytest.raises(ImportError, match=r"plot_memory needs matplotlib: pip install 'lightning-mgpu\[plot"):
        plot_memory(tmp_path, tmp_path / "memory.png")  # a folder with no metrics at all
    with pytest.raises(ImportError, match=r"plot_time needs matplotlib"):
        plot_time(tmp_path / "time_summary.json", tmp_path / "time.png")  # no such file
    assert list(tmp_path.iterdir()) == []
