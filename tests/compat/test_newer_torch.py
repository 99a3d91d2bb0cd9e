"""Features that need a newer torch than the declared floor: refused when used, naming the version they need.

``make test-compat`` runs these on the floor's torch (2.6) and on 2.8. Where this torch has the feature the
test is skipped: the feature's own tests run it there (``tests/strategies/fsdp/``,
``tests/strategies/microbatch/test_fsdp.py``).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.torch_version import TorchVersion
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MGPUFSDPStrategy
from lightning_mgpu._compat.torch import FEATURES, FSDP_ON_CPU, FSDP_RESET_ITER_STATE, TorchFeature


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


@pytest.mark.parametrize("feature", FEATURES, ids=lambda feature: feature.name.split(" (")[0])
def test_each_feature_is_found_exactly_from_the_release_it_names(feature: TorchFeature) -> None:
    release = TorchVersion(torch.__version__.split("+")[0])
    assert feature.present() == (release >= feature.since), (torch.__version__, feature.since, feature.needs)


def one_line(message: str, feature: str, since: str, instead: str) -> None:
    assert message.startswith(f"{feature} needs torch>={since}"), message
    assert f"this is torch {torch.__version__}" in message
    assert instead in message
    assert "\n" not in message


@pytest.mark.skipif(FSDP_ON_CPU.present(), reason="this torch runs FSDP2 on CPU")
def test_mgpu_fsdp_on_cpu_is_refused_inside_trainer_naming_torch_2_7() -> None:
    with pytest.raises(RuntimeError) as refused:
        L.Trainer(accelerator="cpu", devices=2, strategy="mgpu_fsdp", logger=False)
    one_line(str(refused.value), "mgpu_fsdp on CPU", "2.7", "strategy='mgpu_ddp'")


@pytest.mark.skipif(not FSDP_ON_CPU.present(), reason="this torch cannot run FSDP2 on CPU at all")
@pytest.mark.skipif(FSDP_RESET_ITER_STATE.present(), reason="this torch has reset_iter_state")
def test_auto_micro_batches_under_mgpu_fsdp_are_refused_at_the_first_step_naming_torch_2_13() -> None:
    model = Net()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=MGPUFSDPStrategy(micro_batch_size="auto"), max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=8)
    with pytest.raises(RuntimeError) as refused:
        trainer.fit(model, data)
    one_line(
        str(refused.value), "micro_batch_size='auto' under mgpu_fsdp", "2.13", "use a fixed micro_batch_size"
    )
    assert model.steps == 0  # refused before the first batch ran, not after an out-of-memory
