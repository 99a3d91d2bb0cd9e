"""``mgpu_fsdp`` on CUDA: NCCL, CPU offload, and the memory drop the allocator measures."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MGPUFSDPStrategy
from tests.helpers import run_file

pytestmark = pytest.mark.gpu


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
        self.dtypes: set[torch.dtype] = set()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        self.dtypes.add(out.dtype)
        return nn.functional.mse_loss(out.float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def fit(model: Net, precision: str = "32-true", **options: object) -> L.Trainer:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 16), torch.randn(32, 1))
    trainer = L.Trainer(
        accelerator="gpu", devices=1, strategy=MGPUFSDPStrategy(**options), max_steps=4, precision=precision,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, DataLoader(data, batch_size=8))
    return trainer


def test_nccl_and_shards_on_the_gpu() -> None:
    model = Net()
    trainer = fit(model)
    assert trainer.strategy._process_group_backend == "nccl"  # type: ignore[attr-defined]
    assert {(type(p), p.to_local().device.type) for p in model.parameters()} == {(DTensor, "cuda")}


def test_cpu_offload_keeps_the_shards_and_their_state_in_cpu_memory() -> None:
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = fit(model, cpu_offload=True)
    assert {p.to_local().device.type for p in model.parameters()} == {"cpu"}
    state = trainer.optimizers[0].state
    assert {
        v.to_local().device.type for s in state.values() for v in s.values() if isinstance(v, DTensor)
    } == {"cpu"}
    after = model.state_dict()
    assert not torch.equal(after["net.0.weight"].full_tensor().cpu(), before["net.0.weight"])


def test_bf16_mixed_computes_in_bf16_on_the_gpu() -> None:
    model = Net()
    fit(model, precision="bf16-mixed")
    assert model.dtypes == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_each_gpu_holds_about_half_the_model_state_of_ddp(tmp_path: Path) -> None:
    for strategy in ("mgpu_ddp", "mgpu_fsdp"):
        result = run_file("fsdp_memory_gpu.py", tmp_path, args=[strategy], timeout=300)
        assert result.returncode == 0, result.output
    for rank in (0, 1):
        ddp = int((tmp_path / f"mgpu_ddp_rank{rank}.txt").read_text())
        fsdp = int((tmp_path / f"mgpu_fsdp_rank{rank}.txt").read_text())
        # 8 x 4M parameters x (weights, gradients, two AdamW moments) = 512 MiB under DDP
        assert fsdp <= 0.6 * ddp, (rank, fsdp, ddp)


class Huge(Net):
    def configure_model(self) -> None:
        with torch.device("meta"):  # 8 x 16 GiB of float32 weights, never allocated
            self.big = nn.Sequential(*(nn.Linear(65536, 65536, bias=False) for _ in range(8)))


def test_a_model_no_gpu_can_hold_is_refused_with_the_estimate_before_training() -> None:
    # 128 GiB of weights, as much of gradients, twice as much of AdamW's moments, one 16 GiB layer
    with pytest.raises(ValueError, match=r"needs at least 528.00 GiB per device on 1 process") as err:
        fit(Huge())
    assert "parameters, gradients and optimizer state 512.00 GiB" in str(err.value)
    assert "Use at least" in str(err.value)
