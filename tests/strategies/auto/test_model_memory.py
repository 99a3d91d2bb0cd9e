"""``choose_strategy`` given the model: ``mgpu_fsdp`` when only the shards fit (``device_memory=`` on CPU)."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_mgpu.strategies.auto import EnvironmentFacts, choose_strategy
from lightning_mgpu.strategies.auto.model_memory import model_memory
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
        (2, "16MiB", "mgpu_ddp"),  # 18 + 4 MiB sharded does not fit either: nothing is gained (below)
        (1, "24MiB", "single_device"),  # one device: nothing to shard over
    ],
)
def test_the_other_rules_stand(devices: int, memory: str, expected: str) -> None:
    choice = choose_strategy(
        devices, accelerator="cpu", facts=SCRIPT, model=big_model(), device_memory=memory
    )
    assert choice.strategy == expected


def test_a_model_whose_shards_do_not_fit_either_keeps_mgpu_ddp_with_the_numbers() -> None:
    choice = choose_strategy(2, accelerator="cpu", facts=SCRIPT, model=big_model(), device_memory="16MiB")
    assert choice.strategy == "mgpu_ddp"
    assert choice.reason == (
        "2 devices in a script: one process per device; but the model does not fit a device of 16.00 MiB even"
        " sharded: its parameters and gradients take 36.00 MiB whole and 22.00 MiB per device sharded over"
        " 2 process(es) with the largest unit gathered (optimizer state and activations come on top); use at"
        " least 3 devices (devices=, num_nodes=) or a lower precision"
    )
    # a 4 MiB block gathered whole cannot fit 3 MiB, however many devices share the rest
    tiny = choose_strategy(2, accelerator="cpu", facts=SCRIPT, model=big_model(), device_memory="3MiB")
    assert "no number of devices helps while its largest unit does not fit" in tiny.reason


def test_the_precision_counts_the_bytes_the_parameters_will_take() -> None:
    model = big_model()  # 16 MiB of float32 blocks, 2 MiB head: 36 MiB of parameters and gradients
    assert model_memory(model, 4, 10**9).whole == 36 * MiB
    assert model_memory(model, 4, 10**9, "bf16-true").whole == 18 * MiB
    assert model_memory(model, 4, 10**9, "64-true").whole == 72 * MiB
    mixed = model_memory(model, 4, 10**9, "bf16-mixed")  # float32 shards, blocks gathered in bfloat16
    assert (mixed.whole, mixed.sharded) == (36 * MiB, 9 * MiB + 2 * MiB)


def test_a_model_without_parameters_yet_needs_nothing() -> None:
    memory = model_memory(nn.ReLU(), 2, 1024)
    assert (memory.whole, memory.needs_sharding, memory.fits_nowhere) == (0, False, False)
    assert (
        choose_strategy(2, accelerator="cpu", facts=SCRIPT, model=nn.ReLU(), device_memory=1).strategy
        == "mgpu_ddp"
    )


def test_without_a_device_memory_on_cpu_the_model_changes_nothing() -> None:
    assert choose_strategy(4, accelerator="cpu", facts=SCRIPT, model=big_model()).strategy == "mgpu_ddp"
