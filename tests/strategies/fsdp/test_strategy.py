"""``mgpu_fsdp`` in one process: registration, bad input refused early, and the options applied.

A one-process run still goes through ``fully_shard`` over a one-device mesh, so the
sharding, activation checkpointing and precision paths run here without spawning.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MGPUFSDPStrategy


class Net(L.LightningModule):
    def __init__(self, layers: nn.Module | None = None) -> None:
        super().__init__()
        self.net = (
            layers if layers is not None else nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        )

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ShardsItself(Net):
    def configure_model(self) -> None:
        fully_shard(self.net[0], mesh=self.device_mesh["data_parallel"])
        fully_shard(self, mesh=self.device_mesh["data_parallel"])


class BuildsLayers(Net):
    def __init__(self) -> None:
        super().__init__(nn.Identity())

    def configure_model(self) -> None:
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def fit(model: L.LightningModule, steps: int = 3, precision: str = "32-true", **options: object) -> L.Trainer:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4 * steps, 4), torch.randn(4 * steps, 1))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=MGPUFSDPStrategy(**options), max_steps=steps,
        precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, DataLoader(data, batch_size=4))
    return trainer


def test_registered_with_its_description() -> None:
    assert "mgpu_fsdp" in StrategyRegistry
    assert "1/N of the model state" in StrategyRegistry["mgpu_fsdp"]["description"]
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="mgpu_fsdp", logger=False)
    assert isinstance(trainer.strategy, MGPUFSDPStrategy)


@pytest.mark.parametrize(
    ("bad", "error"), [("yes", TypeError), (1.5, TypeError), (None, TypeError), (1, ValueError)]
)
def test_reshard_after_forward_of_the_wrong_type_or_value(bad: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="reshard_after_forward"):
        MGPUFSDPStrategy(reshard_after_forward=bad)  # type: ignore[arg-type]


def test_a_reshard_count_that_does_not_divide_the_processes_fails_inside_trainer() -> None:
    with pytest.raises(
        ValueError, match=r"reshard_after_forward=2 must divide the 2 processes and be smaller"
    ):
        L.Trainer(accelerator="cpu", devices=2, strategy=MGPUFSDPStrategy(reshard_after_forward=2))


def test_cpu_offload_on_cpu_devices_fails_inside_trainer() -> None:
    with pytest.raises(
        ValueError, match="cpu_offload=True keeps the model state in CPU memory while GPUs compute"
    ):
        L.Trainer(accelerator="cpu", devices=2, strategy=MGPUFSDPStrategy(cpu_offload=True))


def test_a_precision_fsdp2_cannot_run_fails_inside_trainer() -> None:
    with pytest.raises(ValueError, match=r"mgpu_fsdp does not support precision='64-true'"):
        L.Trainer(accelerator="cpu", devices=2, strategy="mgpu_fsdp", precision="64-true")


@pytest.mark.parametrize("name", ["cpu_offload", "activation_checkpointing"])
def test_flags_must_be_booleans(name: str) -> None:
    with pytest.raises(TypeError, match=f"{name} must be True or False"):
        MGPUFSDPStrategy(**{name: "yes"})  # type: ignore[arg-type]


def test_a_model_without_parameters_fails_before_training() -> None:
    with pytest.raises(ValueError, match="Net has no parameters, so mgpu_fsdp has nothing to shard"):
        fit(Net(nn.Tanh()))


def test_block_classes_absent_from_the_model_fail_before_training() -> None:
    with pytest.raises(ValueError, match=r"block_classes=\['Linaer'\] matches no .* Did you mean 'Linear'\?"):
        fit(Net(), block_classes=["Linaer"])


def test_options_beside_a_configure_model_that_shards_are_refused() -> None:
    with pytest.raises(
        ValueError, match=r"mgpu_fsdp: ShardsItself\.configure_model calls fully_shard itself, so activation_"
    ):
        fit(ShardsItself(), activation_checkpointing=True)


def test_a_configure_model_that_shards_is_kept_as_it_is() -> None:
    model = ShardsItself()
    trainer = fit(model)
    assert trainer.strategy.plan is None  # type: ignore[attr-defined]
    assert isinstance(model.net[0], FSDPModule)
    assert not isinstance(model.net[2], FSDPModule)  # the user left it to the root


def test_a_configure_model_that_only_builds_layers_is_sharded_after_it() -> None:
    model = BuildsLayers()
    trainer = fit(model)
    assert trainer.strategy.plan.blocks == ("net.0", "net.2")  # type: ignore[attr-defined]
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_activation_checkpointing_without_blocks_is_refused() -> None:
    with pytest.raises(
        ValueError, match="activation_checkpointing=True checkpoints the model's blocks, but no"
    ):
        fit(Net(nn.Linear(4, 1)), activation_checkpointing=True)


def test_activation_checkpointing_reruns_each_block_and_changes_no_number() -> None:
    class Counted(nn.Linear):
        calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            Counted.calls += 1
            return super().forward(x)

    def run(checkpointing: bool) -> tuple[int, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        Counted.calls = 0
        model = Net(nn.Sequential(Counted(4, 8), nn.Tanh(), Counted(8, 1)))
        fit(model, activation_checkpointing=checkpointing)
        return Counted.calls, {k: v.full_tensor() for k, v in model.state_dict().items()}

    (plain_calls, plain), (checkpointed_calls, checkpointed) = run(False), run(True)
    assert (plain_calls, checkpointed_calls) == (6, 12)  # the backward ran each block's forward again
    assert plain.keys() == checkpointed.keys() == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
    for name, value in plain.items():
        torch.testing.assert_close(checkpointed[name], value, atol=0, rtol=0)


def test_bf16_true_shards_the_model_in_bf16() -> None:
    model = Net()
    fit(model, precision="bf16-true")
    assert {(type(p).__name__, p.dtype) for p in model.parameters()} == {("DTensor", torch.bfloat16)}


class WithHead(Net):
    """Parameters at the root, and steps that do not call ``self(...)``: the strategy gathers the root."""

    def __init__(self) -> None:
        super().__init__(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8)))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.head(self.net(batch[0])), batch[1])

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", nn.functional.mse_loss(self.head(self.net(batch[0])), batch[1]))

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.head(self.net(batch[0]))


def test_validation_and_prediction_gather_the_root_too() -> None:
    model = WithHead()
    trainer = fit(model, activation_checkpointing=True)  # the options apply once; later stages keep the plan
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    predictions = trainer.predict(model, loader)
    strategy = MGPUFSDPStrategy(activation_checkpointing=True)
    other = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)
    (metrics,) = other.validate(model, loader)  # a new Trainer recognises the plan, too
    plain = WithHead()
    plain.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
    with torch.no_grad():
        expected = plain(x)
    assert predictions is not None
    torch.testing.assert_close(predictions[0], expected)
    assert metrics["val_loss"] == pytest.approx(nn.functional.mse_loss(expected, y).item(), rel=1e-5)
    assert trainer.strategy.plan.blocks == ("net.0", "net.2")  # type: ignore[attr-defined]
