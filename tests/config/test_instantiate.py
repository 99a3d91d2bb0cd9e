"""Building what a config describes: the devices ``run`` uses and the Trainer it gets."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_mgpu.config import load_config
from lightning_mgpu.config.instantiate import build_trainer, resolve_devices
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
