"""``mgpu_fsdp`` saves a sharded checkpoint again over the run's own without torch's overwrite warning.

One process, real ``torch.distributed.checkpoint`` folders: the warning stays for a folder another
run left, and goes for ``last.ckpt`` saved again at every epoch, also after resuming from it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MGPUFSDPStrategy

OVERWRITING = "Detected an existing checkpoint in"


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def overwrite_warnings(
    folder: Path, epochs: int, ckpt_path: Path | None = None, enable_version_counter: bool = True
) -> list[str]:
    """The overwrite warnings of a fit saving ``folder/last.ckpt`` after each epoch."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    last = ModelCheckpoint(
        dirpath=folder, save_last=True, save_top_k=0, enable_version_counter=enable_version_counter
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=MGPUFSDPStrategy(), max_epochs=epochs, logger=False,
        callbacks=[last], enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Net(), DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
    assert (folder / "last.ckpt" / ".metadata").is_file()
    return [str(w.message) for w in caught if OVERWRITING in str(w.message)]


def test_last_ckpt_saved_again_is_quiet_and_a_folder_from_another_run_still_warns(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    assert overwrite_warnings(folder, epochs=2) == []  # the second epoch saves over the first: the run's own
    # resumed from it, the run saves over the checkpoint it started from: its own too
    assert overwrite_warnings(folder, epochs=4, ckpt_path=folder / "last.ckpt") == []
    # a new run writing into a folder that another run left, told not to add a version: torch's warning
    warned = overwrite_warnings(folder, epochs=2, enable_version_counter=False)
    assert len(warned) == 1, warned
    assert str(folder / "last.ckpt") in warned[0]
