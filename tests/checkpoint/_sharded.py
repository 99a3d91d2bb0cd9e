"""A real sharded checkpoint folder, shared by the tests that read one: what a 2-rank run saves.

One 2-process run of Lightning's ``ModelParallelStrategy`` (FSDP2 on gloo) writes it, every tensor
split over both ranks' files; ``conftest.py`` runs it once per session (``fsdp_run``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

from tests.helpers import run_script

FIT = """
import sys
import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset


class Lit(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)


torch.manual_seed(1)
data = TensorDataset(torch.randn(16, 8), torch.randn(16, 4))
trainer = L.Trainer(
    accelerator="cpu",
    devices=2,
    strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
    max_steps=2,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
lit = Lit()
trainer.fit(lit, DataLoader(data, batch_size=4))
trainer.save_checkpoint("last.ckpt")
full = get_model_state_dict(lit.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if trainer.global_rank == 0:
    torch.save(full, "reference.pt")
# a process group left to the interpreter's exit now and then aborts it ("terminate called without
# an active exception") as gloo's threads are torn down; both ranks meet first, so neither tears it down
# while the other still writes
torch.distributed.barrier()
torch.distributed.destroy_process_group()
"""


def save_sharded_run(folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Run :data:`FIT` in ``folder``: the folder it saved, and its full weights gathered by torch."""
    result = run_script(FIT, folder, timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    return folder / "last.ckpt", torch.load(folder / "reference.pt", weights_only=True)


def plain_model() -> nn.Sequential:
    """The model the run trained, without Lightning, FSDP or its ``model.`` attribute."""
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def copy_of(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / folder.name))


def only_inputs_left(folder: Path, *names: str) -> None:
    assert sorted(p.name for p in folder.iterdir()) == sorted(names)


class Touch:
    """Unpickling this creates ``marker``: a payload no reader may run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))
