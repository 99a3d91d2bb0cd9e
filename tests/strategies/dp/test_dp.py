"""mgpu_dp against a single device: the same weights, logs, metrics, checkpoints and predictions."""

from __future__ import annotations

import logging
import warnings
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, default_collate

import lightning_mgpu
from lightning_mgpu.strategies.dp.lockstep import LockstepError
from lightning_mgpu.strategies.dp.strategy import MGPUDataParallelStrategy
from tests.strategies.dp._dp_models import (
    QUIET,
    Classifier,
    ManualRegressor,
    Regressor,
    classification_data,
    fit,
    loader,
    max_difference,
    regression_data,
)

ATOL = 1e-6


@pytest.mark.parametrize(
    ("devices", "batch_size", "chunks"),
    [
        (2, 6, [3, 3]),  # even
        (3, 6, [2, 2, 2]),
        (2, 5, [3, 2]),  # uneven: each replica's loss weighted by its share
        (3, 7, [3, 2, 2]),
        (2, 1, [1]),  # fewer rows than devices: fewer replicas
        (3, 2, [1, 1]),
    ],
)
def test_one_step_equals_single_device(devices: int, batch_size: int, chunks: list[int]) -> None:
    data = regression_data(rows=3 * batch_size)
    single = Regressor()
    fit(single, "auto", 1, loader(data, batch_size), max_steps=3)
    model = Regressor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(model, "mgpu_dp", devices, loader(data, batch_size), max_steps=3)
    assert isinstance(trainer.strategy, MGPUDataParallelStrategy)
    assert trainer.strategy.last_chunk_sizes == chunks
    assert max_difference(model, single) < ATOL
    uneven = [w for w in caught if "unevenly" in str(w.message)]
    assert len(uneven) == (1 if len(set(chunks)) > 1 else 0)


@dataclass
class _Features:
    x: torch.Tensor
    fold: str


_Target = namedtuple("_Target", ["y", "weight"])


def _nested(rows: list[Any]) -> dict[str, Any]:
    x, y = default_collate(rows)
    return {
        "features": _Features(x, "fold-1"),
        "target": _Target(y, torch.tensor(2.0)),
        "ids": list(range(len(x))),
    }


class _NestedRegressor(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int, str, float]] = []  # shared by the replicas: one entry per chunk

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        features, target = batch["features"], batch["target"]
        self.seen.append((len(features.x), len(batch["ids"]), features.fold, target.weight.item()))
        return target.weight * F.mse_loss(self.net(features.x), target.y)


def test_nested_batches_are_split_and_other_values_shared(caplog: pytest.LogCaptureFixture) -> None:
    data = DataLoader(regression_data(rows=5), batch_size=5, collate_fn=_nested)
    single = _NestedRegressor()
    fit(single, "auto", 1, data, max_steps=1)
    model = _NestedRegressor()
    with caplog.at_level(logging.DEBUG, logger="lightning_mgpu.strategies.dp"):
        fit(model, "mgpu_dp", 2, data, max_steps=1)
    assert "batch of 5 rows split over 2 of 2 devices as [3, 2]" in caplog.text  # the debug view
    # tensors split along dim 0 (dataclass and namedtuple fields too), and the list of one id per row
    # with them; the string and the 0-dim tensor reach every replica whole
    assert sorted(model.seen) == [(2, 2, "fold-1", 2.0), (3, 3, "fold-1", 2.0)]
    assert max_difference(model, single) < ATOL


def test_logs_metrics_callbacks_and_loops_equal_single_device(tmp_path: Path) -> None:
    data = classification_data()

    def run(strategy: str, devices: int) -> tuple[Classifier, L.Trainer, dict[str, float], list[dict]]:
        model = Classifier()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=devices,
            strategy=strategy,
            max_epochs=3,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[
                ModelCheckpoint(dirpath=tmp_path / strategy, monitor="val_loss"),
                EarlyStopping(monitor="val_acc", mode="max", patience=1),
            ],
        )
        trainer.fit(model, loader(data, 7), loader(data, 6))
        metrics = {k: v.item() for k, v in trainer.callback_metrics.items()}
        metrics.update({f"logged/{k}": v.item() for k, v in trainer.logged_metrics.items()})
        metrics.update(trainer.validate(model, loader(data, 6), verbose=False)[0])
        metrics.update(trainer.test(model, loader(data, 9), verbose=False)[0])
        metrics["best"] = trainer.checkpoint_callback.best_model_score.item()  # type: ignore[union-attr]
        metrics["epoch"] = trainer.current_epoch
        predictions = trainer.predict(model, loader(data, 7))
        return model, trainer, metrics, predictions  # type: ignore[return-value]

    single, _, expected, expected_predictions = run("auto", 1)
    model, trainer, metrics, predictions = run("mgpu_dp", 3)
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=ATOL), key
    assert {"train_f1_step", "train_rows_epoch", "val_acc", "val_f1", "val_target", "train_max"} <= set(
        expected
    )
    assert expected["train_rows_epoch"] == 20
    assert expected["logged/train_rows_step"] == 6
    torch.testing.assert_close(model.val_order, single.val_order)  # CatMetric keeps the batch order
    assert len(predictions) == len(expected_predictions)
    for got, want in zip(predictions, expected_predictions, strict=True):
        torch.testing.assert_close(got["probs"], want["probs"], atol=ATOL, rtol=0)
        # integer outputs are summed over the chunks, in the dtype one device returns
        torch.testing.assert_close(got["correct"], want["correct"])
        torch.testing.assert_close(got["correct32"], want["correct32"])
    assert max_difference(model, single) < ATOL
    assert sorted(p.name for p in (tmp_path / "mgpu_dp").iterdir()) == sorted(
        p.name for p in (tmp_path / "auto").iterdir()
    )


def test_checkpoint_has_single_device_keys_and_resumes_on_one_device(tmp_path: Path) -> None:
    data = regression_data(rows=20)  # two steps per epoch: the checkpoint ends an epoch
    steady = Regressor()
    fit(steady, "auto", 1, loader(data, 10), max_epochs=2)

    first = Regressor()
    callback = ModelCheckpoint(dirpath=tmp_path)
    fit(first, "mgpu_dp", 2, loader(data, 10), max_epochs=1, callbacks=[callback], enable_checkpointing=True)
    path = tmp_path / "epoch=0-step=2.ckpt"
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    assert list(checkpoint["state_dict"]) == list(Regressor().state_dict())
    Regressor.load_from_checkpoint(path)  # strict

    resumed = Regressor()
    fit(resumed, "auto", 1, loader(data, 10), max_epochs=2, ckpt_path=str(path))
    assert max_difference(resumed, steady) < ATOL
    again = Regressor()
    fit(again, "mgpu_dp", 2, loader(data, 10), max_epochs=2, ckpt_path=str(path))
    assert max_difference(again, steady) < ATOL


@pytest.mark.parametrize("toggle_model", [False, True], ids=["toggle_optimizer", "toggle_model"])
def test_manual_optimization_equals_single_device(toggle_model: bool) -> None:
    data = regression_data(rows=15)
    single = ManualRegressor(toggle_model=toggle_model)
    reference = fit(single, "auto", 1, loader(data, 5), max_steps=3 * 2)  # global_step counts both optimizers
    model = ManualRegressor(toggle_model=toggle_model)
    trainer = fit(model, "mgpu_dp", 2, loader(data, 5), max_steps=3 * 2)
    assert trainer.strategy.last_chunk_sizes == [3, 2]
    assert max_difference(model, single) < ATOL
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    logged = trainer.callback_metrics["loss_last"].item()
    assert logged == pytest.approx(reference.callback_metrics["loss_last"].item(), abs=ATOL)


@pytest.mark.timeout(60)
def test_manual_optimization_replicas_that_diverge_fail_clearly() -> None:
    with pytest.raises(LockstepError, match="same number of times|different actions"):
        fit(ManualRegressor(diverge=True), "mgpu_dp", 2, loader(regression_data(rows=5), 5), max_steps=2)


class _ManualShown(ManualRegressor):
    """Keys a dict by its optimizers and scheduler and keeps their reprs, as user code may."""

    shown: list[dict[Any, str]] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        held = [*self.optimizers(), self.lr_schedulers()]
        self.shown.append({held_one: repr(held_one) for held_one in held})
        super().training_step(batch, batch_idx)


def test_manual_optimization_handles_hash_by_identity_and_print_short() -> None:
    fit(_ManualShown(), "mgpu_dp", 2, loader(regression_data(rows=5), 5), max_steps=2)
    assert len(_ManualShown.shown) == 2  # one batch, one dict per replica
    for shown in _ManualShown.shown:
        assert len(shown) == 3  # two optimizers and a scheduler: three keys
        for text in shown.values():
            # what a user sees printing one: its kind, not the replica's module and optimizer dumped whole
            assert text.startswith("<"), text
            assert "Linear" not in text, text
            assert len(text) < 200, text


class _ManualLBFGS(ManualRegressor):
    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters())

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.optimizers()


def test_manual_optimization_with_lbfgs_is_refused_with_the_fix() -> None:
    model = _ManualLBFGS()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        ValueError, match=r"cannot run LBFGS with manual optimization.*Use automatic optimization"
    ):
        fit(model, "mgpu_dp", 2, loader(regression_data(rows=4), 4), max_steps=1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # no step taken


def test_accumulation_clipping_and_scheduler_equal_single_device() -> None:
    data = regression_data(rows=20)
    options = {"max_steps": 2, "accumulate_grad_batches": 2, "gradient_clip_val": 0.05}
    single = Regressor(step_lr=True)
    reference = fit(single, "auto", 1, loader(data, 5), **options)
    model = Regressor(step_lr=True)
    trainer = fit(model, "mgpu_dp", 2, loader(data, 5), **options)
    assert max_difference(model, single) < ATOL
    assert trainer.optimizers[0].param_groups[0]["lr"] == reference.optimizers[0].param_groups[0]["lr"] < 0.05


class _BatchNormModel(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 1))


def test_batchnorm_follows_data_parallel() -> None:
    data = regression_data(rows=6)
    model = _BatchNormModel()
    fit(model, "mgpu_dp", 2, loader(data, 6), max_steps=1)
    first_chunk = data.tensors[0][:3]
    bn = model.net[0]
    torch.testing.assert_close(bn.running_mean, 0.1 * first_chunk.mean(0))
    torch.testing.assert_close(bn.running_var, 0.9 + 0.1 * first_chunk.var(0))
    assert bn.num_batches_tracked.item() == 1


@pytest.mark.parametrize("how", ["torch.compile(m)", "m.compile()"])
def test_compiled_submodules_give_uncompiled_results_and_stay_intact(how: str) -> None:
    data = regression_data(rows=12)
    reference = _BatchNormModel()
    fit(reference, "mgpu_dp", 2, loader(data, 6), max_steps=2)

    model = _BatchNormModel()
    if how == "m.compile()":
        model.net.compile(backend="eager")
    else:
        model.net = torch.compile(model.net, backend="eager")  # type: ignore[assignment]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(model, "mgpu_dp", 2, loader(data, 6), max_steps=2)
    compiled = [str(w.message) for w in caught if "torch.compile" in str(w.message)]
    assert len(compiled) == 1
    assert "(net)" in compiled[0]

    # replicas ran their own (uncompiled) copies: BatchNorm statistics come from the first
    # replica's chunk only, as without compilation, and the weights match
    inner = model.net._orig_mod if how == "torch.compile(m)" else model.net
    for key, value in reference.net.state_dict().items():
        torch.testing.assert_close(inner.state_dict()[key], value, atol=ATOL, rtol=0)
    # the user's module is still the compiled one, with its tree intact
    if how == "torch.compile(m)":
        assert type(model.net).__name__ == "OptimizedModule"
        assert list(inner._modules) == ["0", "1"]
        assert [k for k, _ in model.named_parameters()][0] == "net._orig_mod.0.weight"
    else:
        assert model.net._compiled_call_impl is not None


def test_replica_devices_and_saved_bytes_for_the_memory_callback() -> None:
    data = regression_data(rows=7)
    strategy = MGPUDataParallelStrategy(track_replica_memory=True)
    fit(Regressor(), strategy, 2, loader(data, 7), max_steps=1)
    assert strategy.replica_devices == [torch.device("cpu")] * 2
    assert strategy.last_chunk_sizes == [4, 3]
    big, small = strategy.replica_saved_bytes
    # each replica keeps at least its input and its hidden activations (rows x 16 floats)
    assert big >= 4 * (4 + 16) * 4
    assert small >= 3 * (4 + 16) * 4
    assert big - small >= (4 + 16) * 4  # one row more

    untracked = MGPUDataParallelStrategy()
    fit(Regressor(), untracked, 2, loader(data, 7), max_steps=1)
    assert untracked.replica_saved_bytes == []
    assert untracked.track_replica_memory is False


class _FailingRegressor(Regressor):
    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        if len(batch[0]) == 2:
            raise KeyError("missing feature 'z'")
        return super().training_step(batch, batch_idx)


def test_errors_are_clear() -> None:
    # an error inside one replica reaches the user as itself
    with pytest.raises(KeyError, match="missing feature"):
        fit(_FailingRegressor(), "mgpu_dp", 2, loader(regression_data(rows=5), 5), max_steps=1)
    # tensors that cannot be split along one batch dimension
    bad = DataLoader(
        regression_data(rows=6), batch_size=6, collate_fn=lambda rows: (*default_collate(rows), torch.ones(3))
    )
    with pytest.raises(ValueError, match=r"first dimensions differ: \[6, 6, 3\]"):
        fit(Regressor(), "mgpu_dp", 2, bad, max_steps=1)
    with pytest.raises(ValueError, match="sync_batchnorm"):
        fit(_BatchNormModel(), "mgpu_dp", 2, loader(regression_data(), 6), max_steps=1, sync_batchnorm=True)
    with pytest.raises(ValueError, match="num_nodes=2"):
        L.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy="mgpu_dp", **QUIET)


def test_public_name_and_registry() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    assert lightning_mgpu.MGPUDataParallelStrategy is MGPUDataParallelStrategy
    assert StrategyRegistry["mgpu_dp"]["strategy"] is MGPUDataParallelStrategy
