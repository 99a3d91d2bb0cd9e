"""``choose_strategy`` given the model: ``mgpu_fsdp`` when only the shards fit (``device_memory=`` on CPU)."""

from __future__ import annotations

import pytest

from lightning_mgpu.strategies.auto import EnvironmentFacts, choose_strategy
from tests.estimate.test_sharded import big_model  # 4 blocks of 4 MiB and a 2 MiB head, on meta

MiB = 1024**2
SCRIPT = EnvironmentFacts(
    interactive=False,
    cuda_initialized=False,
    launcher=None,
    fork_available=True,
    nccl_available=False,
    distributed_available=True,
)


def test_a_model_whose_shards_alone_fit_gets_mgpu_fsdp_and_the_numbers() -> None:
    # parameters and gradients: 36 MiB whole; over 4 processes 9 MiB of shards and a 4 MiB block
    choice = choose_strategy(4, accelerator="cpu", facts=SCRIPT, model=big_model(), device_memory="24MiB")
    assert choice.strategy == "mgpu_fsdp"
    assert "36.00 MiB, more than the 24.00 MiB of a device" in choice.reason
    assert "13.00 MiB per device" in choice.reason


@pytest.mark.parametrize(
    ("devices", "memory", "expected"),
    [
        (4, "64MiB", "mgpu_ddp"),  # a whole copy fits: no reason to shard
        (2, "16MiB", "mgpu_ddp"),  # 18 + 4 MiB sharded does not fit either: nothing is gained
        (1, "24MiB", "single_device"),  # one device: nothing to shard over
    ],
)
def test_the_other_rules_stand(devices: int, memory: str, expected: str) -> None:
    choice = choose_strategy(
        devices, accelerator="cpu", facts=SCRIPT, model=big_model(), device_memory=memory
    )
    assert choice.strategy == expected


def test_without_a_device_memory_on_cpu_the_model_changes_nothing() -> None:
    assert choose_strategy(4, accelerator="cpu", facts=SCRIPT, model=big_model()).strategy == "mgpu_ddp"
