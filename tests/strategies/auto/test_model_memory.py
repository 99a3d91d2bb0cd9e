"""``choose_strategy`` given the model: ``mgpu_fsdp`` when only the shards fit (``device_memory=`` on CPU).

The model state counted is the estimate's: parameters, gradients, the optimizer's state and, under
``mgpu_ddp``, DDP's gradient buckets."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_mgpu import estimate_memory
from lightning_mgpu.devices import parse_bytes
from lightning_mgpu.estimate.memory_estimate import STRATEGIES
from lightning_mgpu.strategies.auto import choose_strategy
from lightning_mgpu.strategies.auto.decide import EnvironmentFacts
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
    # given one, its state counts: Adam's two moments make 36 MiB more, and its step's temporaries 18 MiB;
    # sharded, the step on the shards (72 + 18 MiB over 4) peaks above the shards with a block gathered
    optimizer = torch.optim.Adam(big_model().parameters())
    with_adam = choose_strategy(
        4, accelerator="cpu", facts=SCRIPT, model=big_model(), device_memory="24MiB", optimizer=optimizer
    )
    assert (
        "optimizer state (Adam) takes 108.00 MiB per device with DDP's gradient buckets and its optimizer"
        " step's temporaries"
    ) in with_adam.reason
    assert (
        "they need 22.50 MiB per device with the largest unit gathered or its optimizer step's temporaries"
        " (activations come on top)"
    ) in with_adam.reason


def test_adamw_state_shards_a_small_gpt2_that_estimate_memory_fits_only_sharded() -> None:
    model = TinyGPT2()  # 849.50 KiB of float32 parameters, AdamW from its configure_optimizers
    estimate = estimate_memory(model, token_batch(rows=2), devices=2, device_memory="2.5MiB")
    assert [s for s in STRATEGIES if estimate.largest_per_device_batch(s) >= 2] == ["mgpu_fsdp"]
    choice = choose_strategy(2, accelerator="cpu", facts=SCRIPT, model=model, device_memory="2.5MiB")
    assert choice.strategy == "mgpu_fsdp"
    assert choice.reason == (
        "2 devices in a script: one process per device; a whole copy of the parameters, gradients and"
        " optimizer state (AdamW) takes 4.98 MiB per device with DDP's gradient buckets and its optimizer"
        " step's temporaries, more than the 2.50 MiB of a device, but sharded they need 2.07 MiB per device"
        " with the largest unit gathered or its optimizer step's temporaries (activations come on top)"
    )
    # the estimate's numbers: its peaks before any activation (but the few bytes of a loss the estimate
    # measured); parameters and gradients alone (1.66 MiB) fit a device
    memory = model_memory(model, 2, parse_bytes("2.5MiB"))
    assert (memory.optimizer.bytes, memory.optimizer.optimizer) == (estimate.optimizer_state_bytes, "AdamW")
    assert memory.whole == pytest.approx(estimate.peak("mgpu_ddp", per_device_batch=0), abs=64)
    assert memory.sharded == pytest.approx(estimate.peak("mgpu_fsdp", per_device_batch=0), abs=64)
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
        " 22.00 MiB per device sharded over 2 processes with the largest unit gathered (optimizer state not"
        " counted: no optimizer given, and the model has no configure_optimizers; activations come on top);"
        " use at least 4 devices (devices=, num_nodes=) or a lower precision"
    )  # over 3 devices the 1024 rows of each weight pad to 3 x 342: 12.02 MiB of shards and the 4 MiB block
    # a 4 MiB block gathered whole cannot fit 3 MiB, however many devices share the rest
    tiny = choose_strategy(2, accelerator="cpu", facts=SCRIPT, model=big_model(), device_memory="3MiB")
    assert "no number of devices helps while its largest unit, gathered whole, and the rows" in tiny.reason


def test_the_precision_counts_the_bytes_the_parameters_and_their_state_will_take() -> None:
    model = big_model()  # 16 MiB of float32 blocks, 2 MiB head: 18 MiB of parameters
    adam = torch.optim.Adam(model.parameters())  # two moments: 36 MiB
    # parameters, gradients, DDP's buckets, Adam's moments and its step's temporaries: 6 copies
    assert model_memory(model, 4, 10**9, optimizer=adam).whole == 108 * MiB
    assert model_memory(model, 4, 10**9, "bf16-true", adam).whole == 54 * MiB
    assert model_memory(model, 4, 10**9, "64-true", adam).whole == 216 * MiB
    # float32 shards, blocks gathered in bfloat16 (18 + 2 MiB): the step on the shards peaks higher
    mixed = model_memory(model, 4, 10**9, "bf16-mixed", adam)
    assert (mixed.whole, mixed.sharded) == (108 * MiB, (72 + 18) * MiB // 4)


def test_a_model_without_parameters_yet_needs_nothing() -> None:
    memory = model_memory(nn.ReLU(), 2, 1024)
    assert (memory.whole, memory.needs_sharding, memory.fits_nowhere) == (0, False, False)
    assert (
        choose_strategy(2, accelerator="cpu", facts=SCRIPT, model=nn.ReLU(), device_memory=1).strategy
        == "mgpu_ddp"
    )


def test_without_a_device_memory_on_cpu_the_model_changes_nothing() -> None:
    assert choose_strategy(4, accelerator="cpu", facts=SCRIPT, model=big_model()).strategy == "mgpu_ddp"


class Wide(L.LightningModule):
    """16 MiB of float32 weights trained by AdamW, whose foreach step holds one more copy for a moment."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2048, 2048, bias=False, device="meta")

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


def test_near_the_limit_mgpu_auto_and_the_estimate_agree_that_only_the_shards_fit() -> None:
    # mgpu_ddp's optimizer step: 16 MiB of parameters, 16 of gradients and 16 of DDP's buckets, 32 of
    # AdamW's moments and 16 of its step's temporaries: 96 MiB, more than the 90 of a device
    estimate = estimate_memory(Wide(), torch.randn(4, 2048, device="meta"), devices=2, device_memory="90MiB")
    assert estimate.largest_per_device_batch("mgpu_ddp") == 0
    assert estimate.largest_per_device_batch("mgpu_fsdp") > 0
    choice = choose_strategy(2, accelerator="cpu", facts=SCRIPT, model=Wide(), device_memory="90MiB")
    assert choice.strategy == "mgpu_fsdp"
    assert "takes 96.00 MiB per device with DDP's gradient buckets and its optimizer step's temporaries" in (
        choice.reason
    )
    memory = model_memory(Wide(), 2, parse_bytes("90MiB"))
    assert memory.whole == pytest.approx(estimate.peak("mgpu_ddp", per_device_batch=0), abs=64)
    assert memory.sharded == pytest.approx(estimate.peak("mgpu_fsdp", per_device_batch=0), abs=64)
