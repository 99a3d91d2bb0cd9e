"""``choose_strategy`` given the model: ``mgpu_fsdp`` when only the shards fit (``device_memory=`` on CPU).

The model state counted is the estimate's: parameters, gradients, the optimizer's state and, under
``mgpu_ddp``, DDP's gradient buckets."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_mgpu import estimate_memory
from lightning_mgpu.devices import parse_bytes
from lightning_mgpu.estimate import STRATEGIES
from lightning_mgpu.estimate.optimizer_state import OptimizerState
from lightning_mgpu.strategies.auto import EnvironmentFacts, choose_strategy
from lightning_mgpu.strategies.auto.model_memory import model_memory
from tests.estimate.test_sharded import big_model  # 4 blocks of 4 MiB and a 2 MiB head, on meta
from tests.strategies.auto._gpt import TinyGPT2, token_batch

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
    # no optimizer: parameters, gradients and DDP's buckets 54 MiB whole; over 4 processes 9 MiB of
    # shards and a 4 MiB block
    choice = choose_strategy(4, accelerator="cpu", facts=SCRIPT, model=big_model(), device_memory="24MiB")
    assert choice.strategy == "mgpu_fsdp"
    assert "54.00 MiB per device with DDP's gradient buckets, more than the 24.00 MiB" in choice.reason
    assert "13.00 MiB per device" in choice.reason
    assert (
        "(optimizer state not counted: no optimizer given, and the model has no configure_optimizers;"
        " activations come on top)"
    ) in choice.reason
    # given one, its state counts: Adam's two moments make 36 MiB more, 9 MiB more per device sharded
    optimizer = torch.optim.Adam(big_model().parameters())
    with_adam = choose_strategy(
        4, accelerator="cpu", facts=SCRIPT, model=big_model(), device_memory="24MiB", optimizer=optimizer
    )
    assert "optimizer state (Adam) takes 90.00 MiB per device" in with_adam.reason
    assert "they need 22.00 MiB per device with the largest unit gathered (activations come on top)" in (
        with_adam.reason
    )


def test_adamw_state_shards_a_small_gpt2_that_estimate_memory_fits_only_sharded() -> None:
    model = TinyGPT2()  # 849.50 KiB of float32 parameters, AdamW from its configure_optimizers
    estimate = estimate_memory(model, token_batch(rows=2), devices=2, device_memory="2.5MiB")
    assert [s for s in STRATEGIES if estimate.largest_per_device_batch(s) >= 2] == ["mgpu_fsdp"]
    choice = choose_strategy(2, accelerator="cpu", facts=SCRIPT, model=model, device_memory="2.5MiB")
    assert choice.strategy == "mgpu_fsdp"
    assert choice.reason == (
        "2 devices in a script: one process per device; a whole copy of the parameters, gradients and"
        " optimizer state (AdamW) takes 4.15 MiB per device with DDP's gradient buckets, more than the"
        " 2.50 MiB of a device, but sharded they need 1.85 MiB per device with the largest unit gathered"
        " (activations come on top)"
    )
    # the same numbers as the estimate's; parameters and gradients alone (1.66 MiB) fit a device
    memory = model_memory(model, 2, parse_bytes("2.5MiB"))
    assert memory.optimizer == OptimizerState(estimate.optimizer_state_bytes, "AdamW")
    assert memory.whole == estimate.model_state_bytes + estimate.gradient_bytes
    assert memory.sharded == estimate.sharded_state_bytes(2) + estimate.largest_unit_bytes
    assert estimate.parameter_bytes + estimate.gradient_bytes < parse_bytes("2.5MiB")


class Scheduled(TinyGPT2):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters())
        steps = self.trainer.estimated_stepping_batches  # before the Trainer set up anything: fails
        return [optimizer], [torch.optim.lr_scheduler.OneCycleLR(optimizer, 1e-3, total_steps=steps)]


def test_a_configure_optimizers_that_needs_the_trainer_leaves_the_state_out_and_says_so() -> None:
    # parameters, gradients and DDP's buckets alone fit
    choice = choose_strategy(2, accelerator="cpu", facts=SCRIPT, model=Scheduled(), device_memory="2.5MiB")
    assert choice.strategy == "mgpu_ddp"
    assert choice.reason == (
        "2 devices in a script: one process per device; a whole copy of the parameters and gradients takes"
        " 2.49 MiB per device with DDP's gradient buckets, within the 2.50 MiB of a device (optimizer state"
        " not counted: Scheduled.configure_optimizers() failed outside a Trainer (RuntimeError: Scheduled is"
        " not attached to a `Trainer`.); pass optimizer=...; activations come on top)"
    )


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
        "2 devices in a script: one process per device; but the model does not fit a device of 16.00 MiB"
        " even sharded: its parameters and gradients take 54.00 MiB whole with DDP's gradient buckets and"
        " 22.00 MiB per device sharded over 2 process(es) with the largest unit gathered (optimizer state not"
        " counted: no optimizer given, and the model has no configure_optimizers; activations come on top);"
        " use at least 4 devices (devices=, num_nodes=) or a lower precision"
    )  # over 3 devices the 1024 rows of each weight pad to 3 x 342: 12.02 MiB of shards and the 4 MiB block
    # a 4 MiB block gathered whole cannot fit 3 MiB, however many devices share the rest
    tiny = choose_strategy(2, accelerator="cpu", facts=SCRIPT, model=big_model(), device_memory="3MiB")
    assert "no number of devices helps while its largest unit, gathered whole, and the rows" in tiny.reason


def test_the_precision_counts_the_bytes_the_parameters_and_their_state_will_take() -> None:
    model = big_model()  # 16 MiB of float32 blocks, 2 MiB head: 18 MiB of parameters
    adam = torch.optim.Adam(model.parameters())  # two moments: 36 MiB
    # parameters, gradients, DDP's buckets and Adam's moments: 5 copies
    assert model_memory(model, 4, 10**9, optimizer=adam).whole == 90 * MiB
    assert model_memory(model, 4, 10**9, "bf16-true", adam).whole == 45 * MiB
    assert model_memory(model, 4, 10**9, "64-true", adam).whole == 180 * MiB
    mixed = model_memory(model, 4, 10**9, "bf16-mixed", adam)  # float32 shards, blocks gathered in bfloat16
    assert (mixed.whole, mixed.sharded) == (90 * MiB, 18 * MiB + 2 * MiB)


def test_a_model_without_parameters_yet_needs_nothing() -> None:
    memory = model_memory(nn.ReLU(), 2, 1024)
    assert (memory.whole, memory.needs_sharding, memory.fits_nowhere) == (0, False, False)
    assert (
        choose_strategy(2, accelerator="cpu", facts=SCRIPT, model=nn.ReLU(), device_memory=1).strategy
        == "mgpu_ddp"
    )


def test_without_a_device_memory_on_cpu_the_model_changes_nothing() -> None:
    assert choose_strategy(4, accelerator="cpu", facts=SCRIPT, model=big_model()).strategy == "mgpu_ddp"
