"""``mgpu_ddp``'s arguments and checks, in one process (and on GPUs where there are some): what it
accepts, and the clear errors inside the Trainer for what it cannot run.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MGPUDDPStrategy
from lightning_mgpu.strategies.process_group.checks import check_devices
from tests.helpers import free_port, run_file, script_env


# A tiny regression fit. Rank 0 saves the data, the initial and the final weights, so the
# test can train the single-process reference on the same global batches.
def test_registered_names_and_their_arguments() -> None:
    assert StrategyRegistry["mgpu_ddp"]["strategy"] is MGPUDDPStrategy
    entry = StrategyRegistry["mgpu_ddp_find_unused_parameters_true"]
    assert entry["strategy"] is MGPUDDPStrategy
    assert entry["init_params"] == {"find_unused_parameters": True}
    strategy = StrategyRegistry.get("mgpu_ddp_find_unused_parameters_true")
    assert strategy._ddp_kwargs == {"find_unused_parameters": True}


def test_every_ddp_argument_still_works() -> None:
    strategy = MGPUDDPStrategy(
        process_group_backend="gloo",
        timeout=timedelta(seconds=42),
        start_method="spawn",
        find_unused_parameters=True,
        static_graph=False,
        stall_timeout=30,
    )
    assert strategy.process_group_backend == "gloo"
    assert strategy._timeout == timedelta(seconds=42)
    assert strategy._start_method == "spawn"
    assert strategy._ddp_kwargs == {"find_unused_parameters": True, "static_graph": False}
    assert strategy.stall_timeout == 30.0
    assert MGPUDDPStrategy(stall_timeout=None).stall_timeout is None


@pytest.mark.parametrize("bad", [0, -5, "60", True])
def test_stall_timeout_must_be_positive_seconds(bad: object) -> None:
    with pytest.raises(ValueError, match=r"stall_timeout must be a positive number of seconds or None .*got"):
        MGPUDDPStrategy(stall_timeout=bad)  # type: ignore[arg-type]


def test_backend_follows_the_device_and_an_explicit_choice_wins() -> None:
    cpu = MGPUDDPStrategy(parallel_devices=[torch.device("cpu")] * 2)
    assert cpu._get_process_group_backend() == "gloo"
    cuda = MGPUDDPStrategy(parallel_devices=[torch.device("cuda", 0)])
    assert cuda._get_process_group_backend() == ("nccl" if torch.distributed.is_nccl_available() else "gloo")
    explicit = MGPUDDPStrategy(parallel_devices=[torch.device("cpu")], process_group_backend="mpi")
    assert explicit._get_process_group_backend() == "mpi"


def _trainer(**kwargs: object) -> L.Trainer:
    quiet = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    return L.Trainer(**quiet, **kwargs)  # type: ignore[arg-type]


def test_unknown_backend_fails_inside_trainer_with_the_available_ones() -> None:
    match = r"process_group_backend='glooo' is not available .* available here: gloo"
    with pytest.raises(ValueError, match=match):
        _trainer(accelerator="cpu", devices=2, strategy=MGPUDDPStrategy(process_group_backend="glooo"))


@pytest.mark.skipif(torch.distributed.is_nccl_available(), reason="this torch build has NCCL")
def test_nccl_without_nccl_fails_inside_trainer() -> None:
    match = r"process_group_backend='nccl' is not available in this torch build"
    with pytest.raises(ValueError, match=match):
        _trainer(accelerator="cpu", devices=2, strategy=MGPUDDPStrategy(process_group_backend="nccl"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_that_does_not_exist_lists_what_exists() -> None:
    # Trainer refuses CUDA devices here before the strategy sees them; the check itself
    # is the one a GPU machine runs inside Trainer(...) (see the gpu tests below)
    os.environ["CUDA_VISIBLE_DEVICES"] = "2,5"
    match = r"devices cuda:0, cuda:3 do not exist: no CUDA device is visible \(CUDA_VISIBLE_DEVICES=2,5"
    with pytest.raises(ValueError, match=match):
        check_devices([torch.device("cuda", 0), torch.device("cuda", 3)], None)


class TwoHeads(L.LightningModule):
    """A model whose ``unused`` head never reaches the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(2, 1)
        self.unused = nn.Linear(2, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.used(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TwoBackwards(TwoHeads):
    """Manual optimization: the first backward of each step leaves ``unused`` out."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        assert isinstance(optimizer, L.pytorch.core.optimizer.LightningOptimizer)
        self.manual_backward(nn.functional.mse_loss(self.used(batch[0]), batch[1]))
        self.manual_backward(nn.functional.mse_loss(self.unused(batch[0]), batch[1]))
        optimizer.step()
        optimizer.zero_grad()


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(16, 2), torch.randn(16, 1)), batch_size=4)


def _watchdog_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "lightning-mgpu-watchdog"]


def test_unused_parameters_are_named_with_both_fixes() -> None:
    # DDP's reducer raises this in a one-process group too; "auto" picks one CPU device
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    trainer = _trainer(accelerator="cpu", devices="auto", strategy="mgpu_ddp", max_steps=3)
    with pytest.raises(RuntimeError) as error:
        trainer.fit(TwoHeads(), _loader())
    message = str(error.value)
    assert "received no gradient in the previous training step: unused.weight, unused.bias." in message
    assert 'Trainer(strategy="mgpu_ddp_find_unused_parameters_true")' in message
    assert "MGPUDDPStrategy(find_unused_parameters=True)" in message
    assert "change the model" in message
    assert "Expected to have finished reduction" not in message

    # under manual optimization the previous backward can be one of the same step
    trainer = _trainer(accelerator="cpu", devices="auto", strategy="mgpu_ddp", max_steps=3)
    with pytest.raises(RuntimeError) as error:
        trainer.fit(TwoBackwards(), _loader())
    message = str(error.value)
    backward = "an earlier manual_backward of this training step, or the last one of the previous step"
    assert f"received no gradient in the previous backward pass ({backward}): unused.weight," in message
    assert "use these parameters in every loss you pass to manual_backward" in message

    # the first fix works, and nothing started for the run outlives it
    strategy = "mgpu_ddp_find_unused_parameters_true"
    trainer = _trainer(accelerator="cpu", devices="auto", strategy=strategy, max_steps=3)
    trainer.fit(TwoHeads(), _loader())
    assert trainer.world_size == 1
    assert trainer.global_step == 3
    assert _watchdog_threads() == []


class _StringDevices(CPUAccelerator):
    """An accelerator that lists its devices as strings, as some custom accelerators do."""

    @staticmethod
    def get_parallel_devices(devices: int | str | list[int]) -> list[str]:  # type: ignore[override]
        return ["cpu"] * int(devices) if not isinstance(devices, list) else ["cpu"] * len(devices)


def test_devices_that_are_not_torch_devices_are_left_to_their_accelerator() -> None:
    # Lightning's DDPStrategy takes them inside Trainer(...); so must mgpu_ddp and mgpu_auto
    for strategy in ("ddp", "mgpu_ddp", "mgpu_auto"):
        trainer = _trainer(accelerator=_StringDevices(), devices=2, strategy=strategy)
        assert trainer.strategy.parallel_devices == ["cpu", "cpu"]
    assert type(trainer.strategy) is MGPUDDPStrategy
    check_devices(["cpu", object(), torch.device("cpu")], "gloo")


def test_sync_batchnorm_on_cpu_fails_inside_trainer() -> None:
    # torch's SyncBatchNorm refuses CPU tensors; found in Trainer(...), not in every started rank
    match = r"sync_batchnorm=True needs GPUs: .* on cpu devices\. Train on GPUs"
    with pytest.raises(ValueError, match=match):
        _trainer(accelerator="cpu", devices=2, strategy="mgpu_ddp", sync_batchnorm=True)
    _trainer(accelerator="cpu", devices=2, strategy="mgpu_ddp")  # without it, the same Trainer is fine


# ----------------------------------------------------------------------- GPU only


@pytest.mark.gpu
def test_nccl_on_cuda_devices() -> None:
    strategy = MGPUDDPStrategy(parallel_devices=[torch.device("cuda", 0)])
    assert strategy._get_process_group_backend() == "nccl"


@pytest.mark.gpu
def test_a_missing_cuda_index_lists_the_visible_devices() -> None:
    count = torch.cuda.device_count()
    strategy = MGPUDDPStrategy(parallel_devices=[torch.device("cuda", 0), torch.device("cuda", count)])
    match = rf"cuda:{count} do not exist: {count} CUDA device\(s\) visible.*cuda:0 "
    with pytest.raises(ValueError, match=match):
        _trainer(accelerator="gpu", devices=1, strategy=strategy)


@pytest.mark.gpu
def test_a_device_chosen_twice_fails() -> None:
    match = r"each device may appear once, got \['cuda:0', 'cuda:0'\]: .*cuda:0 "
    with pytest.raises(ValueError, match=match):
        check_devices([torch.device("cuda", 0), torch.device("cuda", 0)], None)


@pytest.mark.gpu
def test_nccl_for_cpu_devices_fails_inside_trainer() -> None:
    match = r"process_group_backend='nccl' needs CUDA devices, but this run uses cpu"
    with pytest.raises(ValueError, match=match):
        _trainer(accelerator="cpu", devices=2, strategy=MGPUDDPStrategy(process_group_backend="nccl"))


@pytest.mark.gpu
def test_summary_names_the_physical_gpu(tmp_path: Path) -> None:
    last = str(torch.cuda.device_count() - 1)
    env = script_env(CUDA_VISIBLE_DEVICES=last)
    result = run_file("ddp_one_gpu.py", tmp_path, env=env, timeout=180)
    assert result.returncode == 0, result.output
    assert "backend nccl" in result.output
    assert f"rank 0 cuda:0 {torch.cuda.get_device_name(int(last))} (physical GPU {last})" in result.output
