"""Micro-batching in one process (``mgpu_dp`` on one device and on two CPU replicas).

The weights after each step equal the unsplit step; logs and metrics combine as over the
whole batch, in validation, test and predict too; under ``"auto"`` a real allocation failure (an
address-space limit) in forward or backward, or in a validation forward, reruns the batch in halves,
growth comes back after clean batches, and a batch that never fits stops the run with every attempt
named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import CatMetric, MeanSquaredError

from lightning_mgpu.strategies.dp.strategy import MGPUDataParallelStrategy
from tests.helpers import run_file, script_env
from tests.strategies.microbatch._models import (
    LIMITED_MEMORY,
    QUIET,
    Hungry,
    LoggedTokenModel,
    LossRecorder,
    TokenModel,
    loader,
    max_difference,
    net,
    reference,
    regression_data,
    token_data,
)

ATOL = 1e-6


def fit(model: L.LightningModule, data: Any, batch_size: int, devices: int = 1, **kwargs: Any) -> L.Trainer:
    micro = kwargs.pop("micro_batch_size", None)
    strategy = MGPUDataParallelStrategy(micro_batch_size=micro)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, **QUIET, **kwargs)
    trainer.fit(model, loader(data, batch_size))
    return trainer


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("kind", ["mean", "masked", "sum"])
def test_micro_batches_give_the_unsplit_step(devices: int, kind: str) -> None:
    model = TokenModel(kind)
    trainer = fit(model, token_data(), 8, devices, micro_batch_size=3, max_steps=3)
    # micro-batches of 3, 3 and 2 rows, each spread over the replicas: the last one was 2 rows
    assert trainer.strategy.last_chunk_sizes == ([2] if devices == 1 else [1, 1])
    expected = reference(token_data(), kind, 8, 3).state_dict()
    assert max_difference(model.state_dict(), expected) < ATOL
    assert max_difference(model.state_dict(), TokenModel(kind).state_dict()) > 1e-3


def test_the_watchdog_sees_each_micro_batch_of_mgpu_ddp() -> None:
    # a batch rerun in small micro-batches may outlast stall_timeout: each micro-batch must count as progress
    from lightning_mgpu.strategies.ddp.strategy import MGPUDDPStrategy

    strategy = MGPUDDPStrategy(micro_batch_size=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, **QUIET)
    trainer.fit(TokenModel("mean"), loader(token_data(), 8))
    # the counter the watchdog reads: two batches of 8 rows, one micro-batch per row
    assert strategy._progress >= 2 * 8


def test_with_accumulation_micro_batches_change_nothing() -> None:
    # a sum over rows is exact across accumulated batches too
    model = TokenModel("sum")
    fit(model, token_data(), 4, micro_batch_size=3, accumulate_grad_batches=2, max_steps=2)
    assert max_difference(model.state_dict(), reference(token_data(), "sum", 8, 2).state_dict()) < ATOL
    # a token mean is averaged per accumulated batch, as Lightning does without micro-batches
    split, whole = TokenModel("masked"), TokenModel("masked")
    fit(split, token_data(), 4, micro_batch_size=3, accumulate_grad_batches=2, max_steps=2)
    fit(whole, token_data(), 4, accumulate_grad_batches=2, max_steps=2)
    assert max_difference(split.state_dict(), whole.state_dict()) < ATOL


class Logged(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)
        self.mse = MeanSquaredError()
        self.firsts = CatMetric()
        self.after_backward: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        loss = F.mse_loss(out, y)
        self.mse(out, y)
        self.firsts.update(x[:, 0])
        self.log("train_mse", self.mse, on_step=True, on_epoch=True)
        self.log("rows", float(len(x)), reduce_fx="sum", on_step=True, on_epoch=False)
        self.log("loss", loss, on_step=True, on_epoch=True)
        return loss

    def on_after_backward(self) -> None:
        self.after_backward.append(self.net.weight.grad.norm().item())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_logs_metrics_and_hooks_see_the_whole_batch() -> None:
    whole, split = Logged(), Logged()
    expected = fit(whole, regression_data(20), 8, max_epochs=1).callback_metrics
    logged = fit(split, regression_data(20), 8, micro_batch_size=3, max_epochs=1).callback_metrics
    assert logged.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(logged[name], value, atol=ATOL, rtol=0, msg=name)
    assert logged["rows"].item() == 4.0  # the last batch: 4 rows, logged once as the sum of its parts
    torch.testing.assert_close(split.firsts.compute(), whole.firsts.compute())
    # on_after_backward runs once per batch, with the whole batch's gradients
    assert split.after_backward == pytest.approx(whole.after_backward, abs=ATOL)
    assert max_difference(split.state_dict(), whole.state_dict()) < ATOL


class LoggedAtBatchEnd(L.LightningModule):
    """A metric updated in ``training_step`` and logged from ``on_train_batch_end``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)
        self.mse = MeanSquaredError()
        self.on_step: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        self.mse(out, y)
        return F.mse_loss(out, y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.log("batch_mse", self.mse, on_step=True, on_epoch=True)
        self.on_step.append(self.mse._forward_cache.item())  # what Lightning logs on step

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("devices", [1, 2])
def test_a_metric_logged_outside_the_step_gets_the_whole_batch_value(devices: int) -> None:
    whole, split = LoggedAtBatchEnd(), LoggedAtBatchEnd()
    expected = fit(whole, regression_data(20), 8, max_epochs=1).callback_metrics
    logged = fit(split, regression_data(20), 8, devices, micro_batch_size=3, max_epochs=1).callback_metrics
    assert len(whole.on_step) == 3
    assert split.on_step == pytest.approx(whole.on_step, abs=ATOL)  # each batch's value, not a micro-batch's
    for name in ("batch_mse_step", "batch_mse_epoch"):
        torch.testing.assert_close(logged[name], expected[name], atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("devices", [1, 2])
def test_a_global_mean_loss_is_logged_and_returned_as_over_the_whole_batch(devices: int) -> None:
    seen = {}
    for micro in (None, 3):
        recorder = LossRecorder()
        model = LoggedTokenModel("masked")
        fit(model, token_data(), 8, devices, micro_batch_size=micro, max_steps=3, callbacks=[recorder])
        seen[micro] = recorder
    x, y, mask = token_data().tensors
    first = ((net()(x[:8]) - y[:8]) ** 2 * mask[:8]).sum() / mask[:8].sum()  # the first batch's token mean
    assert seen[None].logged[0] == pytest.approx(first.item(), abs=ATOL)
    # micro-batches of 3, 3 and 2 rows hold other token counts than rows: the values stay the batch's
    assert seen[3].logged == pytest.approx(seen[None].logged, abs=ATOL)
    assert seen[3].returned == pytest.approx(seen[None].returned, abs=ATOL)


class Evaluated(Logged):
    """``Logged`` with validation, test and predict steps: a loss on step and epoch, a metric, summed rows."""

    def __init__(self) -> None:
        super().__init__()
        self.eval_mse = MeanSquaredError()

    def _evaluate(self, batch: Any, stage: str) -> None:
        x, y = batch
        out = self.net(x)
        self.eval_mse(out, y)
        self.log(f"{stage}_mse", self.eval_mse)
        self.log(f"{stage}_loss", F.mse_loss(out, y), on_step=True, on_epoch=True)
        self.log(f"{stage}_rows", float(len(x)), reduce_fx="sum")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])


@pytest.mark.parametrize("devices", [1, 2])
def test_evaluation_batches_run_in_micro_batches_over_the_replicas(devices: int) -> None:
    data, seen = regression_data(20), {}
    for micro in (None, 3):
        strategy = MGPUDataParallelStrategy(micro_batch_size=micro)
        trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, **QUIET)
        model = Evaluated()
        trainer.fit(model, loader(data, 8), loader(data, 8))
        validated = dict(trainer.callback_metrics)
        tested = trainer.test(model, loader(data, 8), verbose=False)[0]
        predicted = trainer.predict(model, loader(data, 8))
        seen[micro] = (validated, tested, predicted, strategy)
    (validated, tested, predicted, strategy), whole = seen[3], seen[None]
    assert validated.keys() == whole[0].keys()
    for name, value in whole[0].items():
        torch.testing.assert_close(validated[name], value, atol=ATOL, rtol=0, msg=name)
    assert validated["val_rows"].item() == 20.0  # each batch's rows logged once, as the sum of its parts
    assert tested == pytest.approx(whole[1], abs=ATOL)
    assert [len(p) for p in predicted] == [8, 8, 4]  # whole and in order
    torch.testing.assert_close(torch.cat(predicted), torch.cat(whole[2]), atol=ATOL, rtol=0)
    # the last predict batch of 4 rows ran as micro-batches of 2, each spread over the replicas
    assert strategy.last_chunk_sizes == ([2] if devices == 1 else [1, 1])
    assert {stage: s.last_rows for stage, s in strategy.micro_batches_eval.items()} == dict.fromkeys(
        ("validation_step", "test_step", "predict_step"), 3
    )


class Manual(TokenModel):
    def __init__(self) -> None:
        super().__init__("mean")
        self.automatic_optimization = False
        self.steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.steps += 1
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        optimizer.step()


def test_manual_optimization_is_refused_at_the_start_of_fit_with_the_fix() -> None:
    model = Manual()
    # batches of 8 rows would never be split by micro-batches of 16: refused all the same, before a step
    with pytest.raises(ValueError, match=r"micro_batch_size needs automatic optimization"):
        fit(model, token_data(), 8, micro_batch_size=16, max_steps=2)
    assert model.steps == 0
    fit(Manual(), token_data(), 8, max_steps=2)  # without micro_batch_size it trains


def test_auto_recovers_from_real_out_of_memory(tmp_path: Path) -> None:
    env = script_env(**LIMITED_MEMORY)
    result = run_file("micro_batch_auto.py", tmp_path, timeout=240, env=env)
    seen = __import__("json").loads((tmp_path / "seen.json").read_text())
    out = result.output
    assert seen["backward"] == [8, 4, 4, 4, 4]
    assert (
        "[rank 0] out of memory in backward at batch 0 of epoch 0 with micro-batches of 8 rows: running"
        " the batch again in micro-batches of 4 rows" in out
    )
    assert seen["forward"] == [8, 4, 4, 4, 4]
    assert "[rank 0] out of memory in forward at batch 0 of epoch 0 with micro-batches of 8 rows" in out
    # a token mean logged and returned as over the whole batch, before and after the out-of-memory
    assert seen["masked"] == [8, 4, 4, 4, 4]
    whole = LossRecorder()
    fit(Hungry(masked=True), regression_data(), 8, max_steps=2, callbacks=[whole])
    assert seen["masked_losses"]["logged"] == pytest.approx(whole.logged, abs=ATOL)
    assert seen["masked_losses"]["returned"] == pytest.approx(whole.returned, abs=ATOL)
    assert seen["grow"] == [16, 8] + [4] * 8 + [6, 5, 5] * 2
    # the size it grows to is the one that runs: 7 rows would cut 16 rows as 6, 5 and 5
    assert "[rank 0] micro-batches grow to 6 rows after clean batches" in out
    assert "grow to 7" not in out
    assert "micro-batches of 16 rows: running the batch again in micro-batches of 8 rows" in out
    assert "micro-batches of 8 rows: running the batch again in micro-batches of 4 rows" in out
    assert seen["validate"] == [8] + [4] * 8  # the first batch again in halves, the others at 4 rows
    assert "[rank 0] out of memory in forward at validation batch 0 with micro-batches of 8 rows" in out
    assert result.returncode != 0
    assert (
        "MicroBatchOutOfMemoryError: [rank 0] out of memory at batch 0 of epoch 0 even with micro-batches"
        " of 1 row." in out
    )
    assert "8 rows (out of memory in forward); 4 rows (out of memory in forward);" in out


def test_auto_weights_equal_the_unsplit_step_after_an_out_of_memory(tmp_path: Path) -> None:
    """The fit of the script above that recovered in backward ends where one unsplit fit ends."""
    model = Hungry()
    fit(model, regression_data(), 4, micro_batch_size=2, max_steps=3)
    whole = Hungry()
    fit(whole, regression_data(), 4, max_steps=3)
    assert max_difference(model.state_dict(), whole.state_dict()) < ATOL
