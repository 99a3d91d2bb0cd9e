"""``micro_batch_size="auto"`` under ``mgpu_fsdp`` starts at the size the estimate says fits, as elsewhere.

The model is sharded for real (``fully_shard`` on a one-process gloo group); the strategy is the real
``MGPUFSDPStrategy`` of a two-process run, so the estimate is the ``mgpu_fsdp`` peak over two ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_mgpu import estimate_memory
from lightning_mgpu._sharding.plan import plan_sharding
from lightning_mgpu.devices import parse_bytes
from lightning_mgpu.strategies.fsdp.sharding import ShardingOptions, apply_plan
from lightning_mgpu.strategies.fsdp.strategy import MGPUFSDPStrategy
from lightning_mgpu.strategies.microbatch.first_size import estimated_start, start_from_estimate
from tests.helpers import free_port
from tests.strategies.auto._gpt import TinyGPT2, token_batch

ROWS = 64


@pytest.fixture
def sharded(monkeypatch: pytest.MonkeyPatch) -> nn.Module:
    """``TinyGPT2`` sharded by ``mgpu_fsdp``'s plan: its parameters are DTensors, its units FSDP modules."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = TinyGPT2()
    apply_plan(model, plan_sharding(model), init_device_mesh("cpu", (1,)), ShardingOptions(), None, False)
    return model  # the conftest destroys the process group


def _strategy() -> MGPUFSDPStrategy:
    """Rank 0 of two, as the Trainer sets the strategy up."""
    strategy = MGPUFSDPStrategy()
    strategy.parallel_devices = [torch.device("cpu")] * 2
    strategy.cluster_environment = LightningEnvironment()
    strategy.set_world_ranks()
    return strategy


@pytest.mark.parametrize("memory", ["6MiB", "8MiB"])
def test_a_sharded_model_starts_where_the_estimate_of_the_whole_one_says(
    sharded: nn.Module, memory: str
) -> None:
    strategy = _strategy()
    assert strategy.world_size == 2
    assert type(next(sharded.parameters())).__name__ == "DTensor"
    batch = token_batch(rows=ROWS)
    whole = estimate_memory(TinyGPT2(), batch, devices=2, device_memory=memory, measure_on="meta")
    expected = start_from_estimate(whole, ROWS, "mgpu_fsdp")
    assert expected is not None
    assert 1 < expected < ROWS
    assert estimated_start(strategy, sharded, batch, ROWS, parse_bytes(memory)) == expected
    # FSDP's hooks are back on its units: a step gathers, trains and leaves the shards
    sharded.training_step(batch, 0).backward()
    assert all(type(p.grad).__name__ == "DTensor" for p in sharded.parameters())


def test_where_the_memory_is_unknown_the_whole_batch_comes_first(sharded: nn.Module) -> None:
    assert estimated_start(_strategy(), sharded, token_batch(rows=ROWS), ROWS) is None  # CPU
