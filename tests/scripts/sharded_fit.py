"""A 2-rank ``ModelParallelStrategy`` fit (FSDP2 on gloo) that saves a sharded checkpoint folder.

Usage: ``python sharded_fit.py`` in the folder to save into (tests/checkpoint/_sharded.py). Writes
``last.ckpt/`` (every tensor split over both ranks' files) and ``reference.pt``: the full weights
torch gathers, saved by rank 0.
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from tests.models import quiet_trainer


class Lit(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def configure_model(self) -> None:
        assert self.device_mesh is not None  # ModelParallelStrategy sets it before configure_model
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.1)


def main() -> None:
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(16, 8), torch.randn(16, 4))
    trainer = quiet_trainer(
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=2,
    )
    lit = Lit()
    trainer.fit(lit, DataLoader(data, batch_size=4))
    trainer.save_checkpoint("last.ckpt")
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(lit.model, options=options)
    if trainer.global_rank == 0:
        torch.save(full, "reference.pt")
    # a process group left to the interpreter's exit now and then aborts it ("terminate called without
    # an active exception") as gloo's threads are torn down; both ranks meet first, so neither tears it
    # down while the other still writes
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
