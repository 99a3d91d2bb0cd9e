"""A 16-step ``mgpu_ddp`` fit under ``torchrun --max-restarts=1`` whose first attempt loses rank 1.

Rank 1 is SIGKILLed at step 6 of the first attempt. In the second, rank 0 starts 1 s late, so rank 1
looks for rank 0's address while only the dead attempt's is in the store
(tests/strategies/process_group/test_torchrun_store.py).
"""

from __future__ import annotations

import os
import signal
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MGPUDDPStrategy
from tests.models import Regression, quiet_trainer

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt == 1 and os.environ["RANK"] == "0":
    time.sleep(1)


class KilledOnce(Regression):
    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if attempt == 0 and self.global_step == 6 and self.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)


trainer = quiet_trainer(
    devices=2,
    strategy=MGPUDDPStrategy(),
    max_epochs=1,
)
trainer.fit(KilledOnce(), DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=4))
print(f"attempt {attempt} rank {trainer.global_rank} finished at step {trainer.global_step}")
