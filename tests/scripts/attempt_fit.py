"""One process under ``mgpu_ddp``, checkpointed every 2 steps in ``ckpts/`` (resume/test_attempt_record.py).

Usage: ``python attempt_fit.py KILL_AT`` in the run's folder: it SIGKILLs itself at step KILL_AT when the
folder holds ``kill-once`` (which it removes first); FIT_LR in the environment sets the learning rate.
It saves the final weight and step to ``out.pt``.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MGPUDDPStrategy
from tests.models import Regression, quiet_trainer

kill_at = int(sys.argv[1])


class Net(Regression):
    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_step == kill_at and os.path.exists("kill-once"):
            os.remove("kill-once")
            os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=float(os.environ.get("FIT_LR", "0.1")), momentum=0.9)


generator = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(32, 4, generator=generator), torch.randn(32, 1, generator=generator))
trainer = quiet_trainer(
    devices=1,
    strategy=MGPUDDPStrategy(),
    max_epochs=2,
    enable_checkpointing=True,
    callbacks=[ModelCheckpoint(dirpath="ckpts", every_n_train_steps=2)],
)
module = Net()
trainer.fit(module, DataLoader(data, batch_size=4, shuffle=True))
torch.save({"weight": module.net.weight.detach(), "step": trainer.global_step}, "out.pt")
