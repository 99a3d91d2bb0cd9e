"""Every public name keeps the import paths it was documented at before strategies/ got its rooms."""

from __future__ import annotations

import importlib

import pytest

import lightning_mgpu

PLACES = {
    "lightning_mgpu": [
        "MGPUDDPStrategy",
        "MGPUDataParallelStrategy",
        "MGPUFSDPStrategy",
        "MGPUAutoStrategy",
        "choose_strategy",
        "StrategyChoice",
        "global_mean",
    ],
    "lightning_mgpu.strategies.auto": [
        "MGPUAutoStrategy",
        "choose_strategy",
        "StrategyChoice",
        "EnvironmentFacts",
        "decide",
    ],
    "lightning_mgpu.strategies.ddp": ["MGPUDDPStrategy"],
    "lightning_mgpu.strategies.ddp.strategy": ["MGPUDDPStrategy"],
    "lightning_mgpu.strategies.dp": ["MGPUDataParallelStrategy"],
    "lightning_mgpu.strategies.dp.strategy": ["MGPUDataParallelStrategy"],
    "lightning_mgpu.strategies.fsdp": [
        "MGPUFSDPStrategy",
        "ModelState",
        "ShardingPlan",
        "StateBytes",
        "find_blocks",
        "measure_model_state",
        "plan_sharding",
    ],
    "lightning_mgpu.strategies.fsdp.strategy": ["MGPUFSDPStrategy"],
    "lightning_mgpu.strategies.microbatch": [
        "MicroBatchOutOfMemoryError",
        "MicroBatchSizes",
        "MicroBatching",
        "check_micro_batch_size",
        "is_out_of_memory",
    ],
}


@pytest.mark.parametrize("module", sorted(PLACES))
def test_names_import_from_their_documented_place(module: str) -> None:
    imported = importlib.import_module(module)
    for name in PLACES[module]:
        value = getattr(imported, name)
        if hasattr(lightning_mgpu, name):  # one object, wherever it is imported from
            assert value is getattr(lightning_mgpu, name), (module, name)
