"""mgpu_fsdp's arithmetic: the lower bound the strategy checks, and the peak the estimate predicts."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch import nn

from lightning_mgpu import MemoryEstimate, estimate_memory
from lightning_mgpu._sharding.per_device import sharded_need
from lightning_mgpu._sharding.plan import plan_sharding
from lightning_mgpu.strategies.fsdp.need import check_fits, sharded_model_need

KiB, MiB = 1024, 1024**2


def big_model() -> nn.Module:
    """Four 1024x1024 blocks (4 MiB of float32 weights each) and a 1024x512 head, never allocated."""
    with torch.device("meta"):
        return nn.ModuleDict(
            {"blocks": nn.Sequential(*(nn.Linear(1024, 1024, bias=False) for _ in range(4))),
             "head": nn.Linear(1024, 512, bias=False)}
        )  # fmt: skip


def test_need_counts_shards_of_parameters_and_gradients_and_the_largest_unit() -> None:
    model = big_model()
    need = sharded_need(model, plan_sharding(model), world=2)
    assert need.state == 2 * (16 + 2) * MiB  # parameters and gradients, whole model
    assert need.largest_unit == 4 * MiB  # one block; the root's head is 2 MiB
    assert need.per_device == 18 * MiB + 4 * MiB
    # bf16-mixed gathers in 2 bytes; offloaded shards stay in CPU memory
    assert sharded_need(model, plan_sharding(model), 2, gather_itemsize=2).largest_unit == 2 * MiB
    assert sharded_need(model, plan_sharding(model), 2, offloaded=True).per_device == 4 * MiB


def test_a_model_that_fits_passes() -> None:
    model = big_model()
    check_fits(sharded_need(model, plan_sharding(model), world=2), 22 * MiB, "cuda:0")


def test_a_model_that_does_not_fit_says_how_many_devices_would_hold_it() -> None:
    model = big_model()
    need = sharded_need(model, plan_sharding(model), world=2)
    with pytest.raises(ValueError, match=r"needs at least 22.00 MiB per device on 2 process\(es\)") as err:
        check_fits(need, 16 * MiB, "cuda:0 (H100)")
    message = str(err.value)
    assert "parameters and gradients 36.00 MiB, 1/2 each, plus 4.00 MiB for the largest unit" in message
    assert "but cuda:0 (H100) has 16.00 MiB" in message
    # over 3 devices each weight's 1024 rows pad to 3 x 342: 12.02 MiB of shards and the 4 MiB block
    assert "Use at least 4 devices" in message
    check_fits(sharded_need(model, plan_sharding(model), world=4), 16 * MiB, "cuda:0")
    with_adam = sharded_need(model, plan_sharding(model), 4, optimizer_state=36 * MiB)  # Adam's moments
    with pytest.raises(
        ValueError, match="parameters, gradients and optimizer state 72.00 MiB, 1/4 each"
    ) as err:
        check_fits(with_adam, 16 * MiB, "cuda:0")
    assert "; activations come on top)" in str(err.value)
    assert "Use at least 7 devices" in str(err.value)  # over 6, 1024 rows pad to 6 x 171: just over 12 MiB


class WithAdamW(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = big_model()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


def test_the_check_before_sharding_counts_the_modules_own_optimizer() -> None:
    """What ``mgpu_fsdp`` checks on a GPU: the shards of AdamW's two moments come on top."""
    module = WithAdamW()
    plan = plan_sharding(module)
    check_fits(sharded_need(module, plan, world=2), 22 * MiB, "cuda:0")  # without the optimizer: fits
    need, state = sharded_model_need(module, 2, plan=plan)
    assert (state.optimizer, state.bytes) == ("AdamW", 2 * 18 * MiB)
    assert need.per_device == 22 * MiB + 18 * MiB
    with pytest.raises(ValueError, match=r"needs at least 40.00 MiB per device on 2 process\(es\)") as err:
        check_fits(need, 22 * MiB, "cuda:0")
    assert "parameters, gradients and optimizer state 72.00 MiB, 1/2 each" in str(err.value)
    bf16, _ = sharded_model_need(module, 2, "bf16-true", plan=plan)  # everything in 2 bytes
    assert bf16.per_device == need.per_device // 2


def test_a_unit_larger_than_the_device_cannot_be_helped_by_more_devices() -> None:
    model = big_model()
    need = sharded_need(model, plan_sharding(model), world=8, offloaded=True)
    with pytest.raises(ValueError, match="the shards are in CPU memory; plus 4.00 MiB") as err:
        check_fits(need, 3 * MiB, "cuda:0")
    assert "No number of devices helps while one unit does not fit: shard smaller blocks" in str(err.value)


def adam_stack() -> MemoryEstimate:
    """Four 256x256 blocks: 1 MiB of parameters, 1 MiB of gradients, 2 MiB of Adam's moments."""
    model = nn.Sequential(*(nn.Linear(256, 256, bias=False) for _ in range(4)))
    optimizer = torch.optim.Adam(model.parameters())
    return estimate_memory(model, torch.randn(8, 256), devices=2, device_memory="2MiB", optimizer=optimizer)


def test_fsdp_peak_is_the_state_over_n_plus_the_largest_unit() -> None:
    est = adam_stack()
    assert est.model_state_bytes == 4 * MiB
    assert est.unit_bytes == (256 * KiB,) * 4 + (0,)  # four blocks, then the root, which holds nothing
    (fixed, per_sample), (step_fixed, step_per_sample) = est.forward_backward, est.optimizer_step
    for n in (2, 4, 8):
        assert est.sharded_state_bytes(n) == 4 * MiB // n
        # forward and backward: the shards and one block gathered; the step: everything on the shards
        gathering = fixed - (4 * MiB - 4 * MiB // n) + 256 * KiB + 8 * per_sample
        stepping = step_fixed / n + 8 * step_per_sample  # no buffers here
        assert est.peak("mgpu_fsdp", devices=n) == int(max(gathering, stepping))
    assert est.peak("mgpu_fsdp") < est.peak("mgpu_ddp") / 2
    # 2 MiB holds none of the whole copies, and mgpu_fsdp from 3 devices on
    assert est.peak("mgpu_fsdp", devices=2) > 2 * MiB >= est.peak("mgpu_fsdp", devices=3)
    assert est.devices_to_fit() == 3
    report = str(est)
    assert "mgpu_fsdp fits 8 sample(s) per device in 2.00 MiB from 3 device(s)" in report
    assert "strategy='mgpu_fsdp' on 3 devices" in report
    assert est.devices_to_fit(device_memory=KiB) is None  # not even one unit fits


def test_padding_of_dim_0_counts_on_the_fullest_rank() -> None:
    est = estimate_memory(nn.Linear(6, 33), torch.randn(4, 6), devices=2, optimizer=None)
    # weight 33 rows of 6 numbers, bias 33 rows of 1: 17 rows of each on rank 0
    assert est.parameter_rows == ((33, 24), (33, 4))
    assert est.sharded_state_bytes(2) == math.ceil(est.model_state_bytes * 17 / 33)


def test_bf16_mixed_gathers_in_two_bytes_and_block_classes_name_the_units() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
    est = estimate_memory(model, torch.randn(4, 64), precision="bf16-mixed", optimizer=None)
    assert est.unit_bytes == ((64 * 64 + 64) * 2, (64 * 16 + 16) * 2, 0)  # both Linears, then the root
    est = estimate_memory(model, torch.randn(4, 64), optimizer=None, block_classes=["ReLU"])
    assert est.unit_bytes == (0, (64 * 64 + 64 + 64 * 16 + 16) * 4)  # the ReLU, then the root with the rest
