"""mgpu_dp on CUDA: the torch.nn.parallel path against torch.nn.DataParallel and one GPU."""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_mgpu  # noqa: F401
from lightning_mgpu.strategies.dp.strategy import MGPUDataParallelStrategy
from tests.strategies.dp._dp_models import QUIET, Regressor, loader, max_difference, regression_data

pytestmark = pytest.mark.gpu


def _devices() -> list[torch.device]:
    count = torch.cuda.device_count()
    # one GPU still runs the multi-replica path: two replicas on the same card
    return [torch.device("cuda", i) for i in range(count)] if count > 1 else [torch.device("cuda", 0)] * 2


class _GradProbe(Regressor):
    """Records the loss, the gradients before the (lr=0) step and the autocast dtype seen in replicas."""

    def __init__(self) -> None:
        super().__init__(lr=0.0)
        self.losses: list[torch.Tensor] = []
        self.grads: dict[str, torch.Tensor] = {}
        self.dtypes: set[torch.dtype] = set()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        self.dtypes.add(out.dtype)  # shared set: every replica adds what autocast gave it
        return F.mse_loss(out.float(), y)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.grads = {n: p.grad.detach().clone() for n, p in self.named_parameters()}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(outputs["loss"].detach())


def test_losses_and_grads_match_torch_data_parallel() -> None:
    devices = _devices()
    data = regression_data(rows=11)  # uneven over 2 (and most) device counts
    x, y = (t.to(devices[0]) for t in data.tensors)

    reference = copy.deepcopy(Regressor().net).to(devices[0])
    wrapped = nn.DataParallel(reference, device_ids=sorted({d.index for d in devices}))
    loss = F.mse_loss(wrapped(x), y)
    loss.backward()

    model = _GradProbe()
    strategy = MGPUDataParallelStrategy(parallel_devices=devices)
    trainer = L.Trainer(strategy=strategy, max_steps=1, **QUIET)
    trainer.fit(model, loader(data, 11))
    assert strategy.last_chunk_sizes[0] > 0
    assert len(strategy.last_chunk_sizes) == len(devices)
    torch.testing.assert_close(model.losses[0], loss.detach(), atol=1e-5, rtol=1e-5)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(model.grads[f"net.{name}"], param.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_mixed_precision_runs_autocast_in_every_replica(precision: str) -> None:
    devices = _devices()
    data = regression_data(rows=16)
    single = Regressor()
    L.Trainer(accelerator="gpu", devices=[0], max_steps=3, precision=precision, **QUIET).fit(
        single, loader(data, 8)
    )
    probe = _GradProbe()
    strategy = MGPUDataParallelStrategy(parallel_devices=devices, track_replica_memory=True)
    L.Trainer(strategy=strategy, max_steps=1, precision=precision, **QUIET).fit(probe, loader(data, 8))
    assert probe.dtypes == {torch.float16 if precision == "16-mixed" else torch.bfloat16}
    assert len(strategy.replica_saved_bytes) == len(devices)
    assert min(strategy.replica_saved_bytes) > 0

    model = Regressor()
    strategy = MGPUDataParallelStrategy(parallel_devices=devices)
    L.Trainer(strategy=strategy, max_steps=3, precision=precision, **QUIET).fit(model, loader(data, 8))
    assert max_difference(model, single) < 1e-2  # half precision: rounding differs with the chunking


def test_manual_optimization_and_checkpoint_on_cuda(tmp_path: Any) -> None:
    from tests.strategies.dp._dp_models import ManualRegressor

    devices = _devices()
    data = regression_data(rows=15)
    single = ManualRegressor()
    L.Trainer(accelerator="gpu", devices=[0], max_steps=6, **QUIET).fit(single, loader(data, 5))
    model = ManualRegressor()
    trainer = L.Trainer(strategy=MGPUDataParallelStrategy(parallel_devices=devices), max_steps=6, **QUIET)
    trainer.fit(model, loader(data, 5))
    assert max_difference(model, single) < 1e-5
    trainer.save_checkpoint(tmp_path / "dp.ckpt")
    checkpoint = torch.load(tmp_path / "dp.ckpt", map_location="cpu", weights_only=True)
    assert list(checkpoint["state_dict"]) == list(ManualRegressor().state_dict())
