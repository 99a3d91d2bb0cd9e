"""SavedBytes: the one counter of bytes saved for backward, for the estimate and for mgpu_dp's replicas."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MGPUDataParallelStrategy
from lightning_mgpu.estimate.live_bytes import SavedBytes

F32 = 4


def saved_by(fn: Any, exclude: list[torch.Tensor] = ()) -> int:  # type: ignore[assignment]
    counter = SavedBytes(exclude)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        fn()
    return counter.total


def test_a_storage_counts_once_whatever_views_saved_it() -> None:
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def step() -> None:
        h = x @ w  # saves x (and w, excluded)
        (h[:, :4] * h[:, :4]).sum()  # saves a view of h, twice
        (h * h.t().t()).sum()  # saves h itself, through two views

    # x and h: 4 x 8 float32 each; h once although saved through three different views
    assert saved_by(step, exclude=[w]) == 2 * 4 * 8 * F32


def test_chunks_of_one_batch_count_their_own_rows() -> None:
    batch = torch.randn(7, 8)
    w = torch.randn(8, 1, requires_grad=True)
    big, small = batch.split([4, 3])  # what mgpu_dp's CPU replicas get: views of one storage
    assert saved_by(lambda: (big @ w).sum(), exclude=[w]) == 4 * 8 * F32
    assert saved_by(lambda: (small @ w).sum(), exclude=[w]) == 3 * 8 * F32
    assert saved_by(lambda: (big @ w).sum(), exclude=[w, batch]) == 0  # the batch lives anyway


class Tanh(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 16)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.layer(x).tanh().square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_mgpu_dp_replicas_count_what_the_counter_counts_for_their_chunks() -> None:
    batch = torch.randn(7, 8)
    strategy = MGPUDataParallelStrategy(track_replica_memory=True)
    model = Tanh()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(batch), batch_size=7))
    expected = [saved_by(lambda c=chunk: Tanh().training_step((c,), 0)) for chunk in batch.split([4, 3])]
    assert strategy.replica_saved_bytes == expected
    assert expected[0] > expected[1] > 0
