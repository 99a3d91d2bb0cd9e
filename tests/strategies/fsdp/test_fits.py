"""The lower bound of a device's memory under a sharding plan, and the error when nothing can fit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mgpu.strategies.fsdp.fits import check_fits, sharded_need
from lightning_mgpu.strategies.fsdp.plan import plan_sharding

MiB = 1024**2


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
    assert "Use at least 3 devices" in message  # 36 MiB / 3 + 4 MiB = 16 MiB
    check_fits(sharded_need(model, plan_sharding(model), world=3), 16 * MiB, "cuda:0")


def test_a_unit_larger_than_the_device_cannot_be_helped_by_more_devices() -> None:
    model = big_model()
    need = sharded_need(model, plan_sharding(model), world=8, offloaded=True)
    with pytest.raises(ValueError, match="the shards are in CPU memory; plus 4.00 MiB") as err:
        check_fits(need, 3 * MiB, "cuda:0")
    assert "No number of devices helps while one unit does not fit: shard smaller blocks" in str(err.value)
