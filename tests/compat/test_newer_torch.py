"""Features that need a newer torch than the declared floor: refused when used, naming the version they need.

``make test-compat`` runs these on the floor's torch. Where this torch has the feature the test is
skipped: the feature's own tests run it there (``tests/strategies/microbatch/test_fsdp.py``).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MGPUFSDPStrategy


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.steps = 0

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.steps += 1
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.skipif(hasattr(FSDPModule, "reset_iter_state"), reason="this torch has reset_iter_state")
def test_auto_micro_batches_under_mgpu_fsdp_are_refused_at_the_first_step_naming_torch_2_13() -> None:
    model = Net()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=MGPUFSDPStrategy(micro_batch_size="auto"), max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=8)
    with pytest.raises(RuntimeError) as refused:
        trainer.fit(model, data)
    message = str(refused.value)
    assert message.startswith("micro_batch_size='auto' under mgpu_fsdp needs torch>=2.13")
    assert f"this is torch {torch.__version__}" in message
    assert "use a fixed micro_batch_size" in message
    assert "\n" not in message
    assert model.steps == 0  # refused before the first batch ran, not after an out-of-memory
