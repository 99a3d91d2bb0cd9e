"""Building what a config describes: the devices ``run`` uses and the Trainer it gets."""

from __future__ import annotations

import datetime
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint, Timer

from lightning_mgpu import DeviceMemoryMonitor, MGPUDDPStrategy, PlainStateDictExport
from lightning_mgpu.config import load_config
from lightning_mgpu.config.callbacks import build_callbacks
from lightning_mgpu.config.instantiate import build_data, build_module, build_trainer, resolve_devices
from lightning_mgpu.config.schema import CPU_DEVICE_CAP


def test_minus_one_means_auto(tmp_path: Path) -> None:
    accelerator, count = resolve_devices("cpu", "auto")
    assert 1 <= count <= CPU_DEVICE_CAP
    assert resolve_devices("cpu", -1) == (accelerator, count)
    assert resolve_devices("auto", -1) == resolve_devices("auto", "auto")
    cfg = load_config("linear", ["trainer.accelerator=cpu", "trainer.devices=-1"])
    trainer = build_trainer(cfg, tmp_path, [])  # Lightning alone refuses -1 with the CPU accelerator
    assert trainer.num_devices == count


def test_device_indices_on_cpu_say_what_to_give_instead() -> None:
    with pytest.raises(ValueError, match=r"^trainer.devices=\[0, 3\]: device indices select GPUs, and "):
        resolve_devices("cpu", [0, 3])
    assert resolve_devices("cpu", 2) == ("cpu", 2)


def test_progress_in_a_log_is_one_line_per_epoch_without_lightnings_own_warnings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = load_config(
        "linear",
        ["trainer.accelerator=cpu", "trainer.devices=1", "trainer.strategy=auto", "trainer.max_epochs=2"],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = build_trainer(cfg, tmp_path, [])  # pytest's captured stdout is not a terminal
        trainer.fit(build_module(cfg), datamodule=build_data(cfg))
        trainer.validate(trainer.lightning_module, datamodule=build_data(cfg))
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning, stacklevel=1)
    out = capsys.readouterr().out
    assert "\r" not in out  # no redrawn bar frames
    lines = [line for line in out.splitlines() if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in lines] == ["epoch 1/2", "epoch 2/2"]
    assert all(" batches in " in line and "val/loss=" in line for line in lines)
    validation = [line for line in out.splitlines() if line.startswith("validation: ")]
    assert len(validation) == 1  # validate's own line; fit's validations are on its epoch lines
    assert " batches in " in validation[0]
    assert "val/loss=" in validation[0]
    leaf = [str(w.message) for w in caught if "LeafSpec" in str(w.message)]
    assert leaf == ["`isinstance(treespec, LeafSpec)` is deprecated"]  # only the one raised here, by a test


@pytest.mark.parametrize("strategy", ["mgpu_ddp", "mgpu_dp", "mgpu_fsdp", "mgpu_auto"])
def test_micro_batch_size_reaches_the_strategy(strategy: str, tmp_path: Path) -> None:
    two_cpus = ["trainer.accelerator=cpu", "trainer.devices=2", f"trainer.strategy={strategy}"]
    for setting, rows in (("auto", None), ("3", 3)):
        cfg = load_config("digits", [*two_cpus, f"trainer.micro_batch_size={setting}"])
        trainer = build_trainer(cfg, tmp_path, [])  # Trainer(...) only: no process starts before fit
        chosen: Any = trainer.strategy  # mgpu_auto has become the strategy it picked
        assert chosen.micro_batch_size == (setting if setting == "auto" else rows)
        assert chosen.micro_batches.size == rows
        assert chosen.micro_batches.auto == (setting == "auto")
    off: Any = build_trainer(load_config("digits", two_cpus), tmp_path, []).strategy
    assert off.micro_batch_size is None


def test_strategy_options_reach_the_strategy_as_its_init_takes_them(tmp_path: Path) -> None:
    options = [
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.strategy={name: mgpu_ddp, stall_timeout: 60, timeout: 600}",
        "trainer.strategy.find_unused_parameters=true",  # passed on to DistributedDataParallel
    ]
    chosen: Any = build_trainer(load_config("digits", options), tmp_path, []).strategy
    assert isinstance(chosen, MGPUDDPStrategy)
    assert chosen.stall_timeout == 60.0
    assert chosen._timeout == datetime.timedelta(seconds=600)  # seconds in the config, a timedelta here
    assert chosen._ddp_kwargs == {"find_unused_parameters": True}
    fsdp = ["trainer.accelerator=cpu", "trainer.devices=2", "trainer.strategy.name=mgpu_fsdp"]
    checkpointed = load_config("digits", [*fsdp, "trainer.strategy.activation_checkpointing=true"])
    sharded: Any = build_trainer(checkpointed, tmp_path, []).strategy
    assert sharded.options.activation_checkpointing is True


def test_trainer_arguments_from_a_config_file_and_overrides_reach_the_trainer(tmp_path: Path) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        "recipe: linear\n"
        "trainer:\n"
        "  detect_anomaly: true  # a Trainer argument no config key listed before\n"
        "  max_time: 3600        # seconds\n"
        "  accelerator: cpu\n"
        "  devices: 1\n"
        "  strategy: auto\n"
        "  max_epochs: 1\n"
        "  limit_train_batches: 2\n"
        "  limit_val_batches: 1\n"
        "  enable_progress_bar: false\n"
    )
    cfg = load_config(mine, ["trainer.gradient_clip_algorithm=value", "trainer.gradient_clip_val=1"])
    anomaly_mode: list[bool] = []

    class Probe(Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            anomaly_mode.append(torch.is_anomaly_enabled())

    trainer = build_trainer(cfg, tmp_path / "run", [Probe()])
    assert trainer.gradient_clip_algorithm == "value"
    assert trainer.gradient_clip_val == 1
    timer = next(cb for cb in trainer.callbacks if isinstance(cb, Timer))  # type: ignore[attr-defined]
    assert timer.time_remaining() == 3600  # seconds in the config, a timedelta for the Trainer
    trainer.fit(build_module(cfg), datamodule=build_data(cfg))
    assert anomaly_mode == [True, True]


def test_callback_arguments_from_the_config_reach_the_callbacks(tmp_path: Path) -> None:
    overrides = [
        "callbacks.checkpoint.save_weights_only=true",  # arguments no config key listed before
        "callbacks.export.prefix=module.",
        "callbacks.early_stopping.enabled=true",
        "callbacks.early_stopping.stopping_threshold=0.5",
    ]
    memory, _, export, checkpoint, stopping = build_callbacks(
        load_config("digits", overrides).callbacks, tmp_path
    )
    assert isinstance(checkpoint, ModelCheckpoint)
    assert (checkpoint.save_weights_only, checkpoint.monitor, checkpoint.save_last) == (True, "val/acc", True)
    assert checkpoint.dirpath == str(tmp_path / "checkpoints")  # set by the run
    assert isinstance(export, PlainStateDictExport)
    assert (export.prefix, export.submodule) == ("module.", "net")
    assert isinstance(stopping, EarlyStopping)
    assert (stopping.stopping_threshold, stopping.monitor) == (0.5, "val/loss")
    assert isinstance(memory, DeviceMemoryMonitor)
    assert (memory.every_n_steps, memory.print_summary) == (10, False)
