"""``micro_batch_size="auto"`` on CUDA: a real CUDA out-of-memory (a memory fraction) is survived."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lightning_mgpu.strategies.dp.strategy import MGPUDataParallelStrategy
from tests.strategies.microbatch._models import QUIET, Hungry, loader, max_difference, regression_data

pytestmark = pytest.mark.gpu


class CudaHungry(Hungry):
    """``Hungry`` with 16 MiB rows, limited by ``torch.cuda.set_per_process_memory_fraction`` instead."""

    ROW_FLOATS = 2**22

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.limit_rank is None or self._limited:
            return
        self._limited = True
        torch.cuda.synchronize()
        total = torch.cuda.get_device_properties(self.device).total_memory
        allowed = torch.cuda.memory_reserved(self.device) + self.budget * self.ROW_FLOATS * 4
        torch.cuda.set_per_process_memory_fraction(allowed / total, self.device)


def fit(model: L.LightningModule, micro: Any) -> MGPUDataParallelStrategy:
    strategy = MGPUDataParallelStrategy(micro_batch_size=micro)
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=strategy, max_steps=3, **QUIET)
    trainer.fit(model, loader(regression_data(), 8))
    return strategy


def test_a_cuda_out_of_memory_in_backward_reruns_the_batch_in_halves() -> None:
    try:
        limited = CudaHungry(limit_rank=0, budget=24)  # whole batch: backward needs about 32 rows
        strategy = fit(limited, "auto")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert limited.sizes_seen[:3] == [8, 4, 4]
    assert strategy.micro_batches.failed == 8
    whole = CudaHungry()
    fit(whole, None)
    assert max_difference(limited.state_dict(), whole.state_dict()) < 1e-5
