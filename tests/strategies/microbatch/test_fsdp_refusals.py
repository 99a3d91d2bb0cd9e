"""``micro_batch_size="auto"`` under ``mgpu_fsdp`` refuses, at the first step, models it cannot recover.

After an out-of-memory every rank must reset FSDP's pass and run each collective the others wait in,
so the LightningModule itself must be an FSDP unit and every unit's collectives must be watchable.
One process (a one-device mesh) is enough: the refusals come before any collective runs. The same
models train with a fixed ``micro_batch_size``, so the refusal is about ``"auto"`` alone.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MGPUFSDPStrategy
from lightning_mgpu._compat.torch import FSDP_RESET_ITER_STATE, fsdp_param_groups
from tests.models import quiet_trainer

pytestmark = pytest.mark.skipif(
    not FSDP_RESET_ITER_STATE.present(), reason="micro_batch_size='auto' under mgpu_fsdp needs torch 2.13"
)


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(torch.tanh(self.body(x))), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ShardsOnlyItsBody(Net):
    def configure_model(self) -> None:
        assert self.device_mesh is not None
        fully_shard(self.body, mesh=self.device_mesh["data_parallel"])


class HeadOnItsOwnMesh(Net):
    """One unit of two parameter groups: the head's parameters go to a mesh of a process group of
    their own (``shard_placement_fn``'s per-parameter meshes, as mixture-of-experts models do)."""

    def configure_model(self) -> None:
        # ShardPlacementResult / FSDPMeshInfo are not exported by torch.distributed.fsdp in torch 2.13
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult

        assert self.device_mesh is not None
        mesh = self.device_mesh["data_parallel"]
        own = FSDPMeshInfo(DeviceMesh.from_group(dist.new_group([0]), "cpu"), shard_mesh_dim=0)
        head = {id(p) for p in self.head.parameters()}

        def placement(param: nn.Parameter) -> ShardPlacementResult | None:
            return ShardPlacementResult(placement=None, mesh_info=own) if id(param) in head else None

        fully_shard(self, mesh=mesh, shard_placement_fn=placement)


def fit(model: Net, micro_batch_size: int | str) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    strategy = MGPUFSDPStrategy(micro_batch_size=micro_batch_size)
    trainer = quiet_trainer(devices=1, strategy=strategy, max_steps=2)
    trainer.fit(model, DataLoader(data, batch_size=8))


def test_a_configure_model_that_leaves_the_module_itself_unsharded_is_refused() -> None:
    with pytest.raises(ValueError, match=r"ShardsOnlyItsBody.s configure_model shards only parts") as error:
        fit(ShardsOnlyItsBody(), "auto")
    assert "end configure_model with fully_shard(self), or use a fixed micro_batch_size" in str(error.value)
    fit(ShardsOnlyItsBody(), 4)


def test_a_unit_of_several_parameter_groups_is_refused() -> None:
    with pytest.raises(ValueError, match=r"1 unit\(s\) hold several parameter groups") as error:
        fit(HeadOnItsOwnMesh(), "auto")
    assert "shard each unit over one mesh, or use a fixed micro_batch_size" in str(error.value)
    model = HeadOnItsOwnMesh()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    fit(model, 4)
    assert len(fsdp_param_groups(model)) == 2  # the grouping the refusal is about
    after = {name: p.detach().full_tensor() for name, p in model.named_parameters()}
    assert after.keys() == before.keys()
    assert all(not torch.equal(after[name], before[name]) for name in before)  # both groups trained
