"""Small LightningModules shared by the mgpu_dp tests (and the DDP resume script)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import CatMetric, Metric
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

QUIET: dict[str, Any] = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
}


def regression_data(rows: int = 24, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 4, generator=g)
    return TensorDataset(x, x @ torch.randn(4, 1, generator=g) + 0.1 * torch.randn(rows, 1, generator=g))


def loader(dataset: TensorDataset, batch_size: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False)


def fit(
    model: L.LightningModule,
    strategy: Any,
    devices: int,
    data: Any,
    ckpt_path: str | None = None,
    **trainer_kwargs: Any,
) -> L.Trainer:
    options = {**QUIET, **trainer_kwargs}
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, **options)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer


def max_difference(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa)


class Regressor(L.LightningModule):
    """A mean-MSE MLP trained with SGD + momentum (so optimizer state matters too)."""

    def __init__(self, lr: float = 0.05, step_lr: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.lr = lr
        self.step_lr = step_lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if not self.step_lr:
            return opt
        return {
            "optimizer": opt,
            "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        }


class ManualRegressor(Regressor):
    """Two optimizers driven by hand: toggling, clipping, a second forward after a step, a scheduler."""

    def __init__(self, diverge: bool = False, toggle_model: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.diverge = diverge
        self.toggle_model = toggle_model  # LightningOptimizer.toggle_model instead of toggle_optimizer

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt_first, opt_last = self.optimizers()
        first, last = self.net[0], self.net[2]
        with opt_first.toggle_model() if self.toggle_model else self._toggled(opt_first):
            loss = F.mse_loss(self.net(x), y)
            opt_first.zero_grad()
            self.manual_backward(loss)
            if self.diverge and len(x) == 3:
                self.manual_backward(loss)  # only the replica with the larger chunk does this
            self.clip_gradients(opt_first, gradient_clip_val=0.1, gradient_clip_algorithm="norm")
            opt_first.step()
        # a second forward after the first update must see the new weights
        loss_last = F.mse_loss(last(torch.tanh(first(x))), y)
        opt_last.zero_grad()
        self.manual_backward(loss_last)
        opt_last.step()
        self.lr_schedulers().step()
        self.log("loss_last", loss_last)

    @contextlib.contextmanager
    def _toggled(self, optimizer: Any) -> Iterator[None]:
        self.toggle_optimizer(optimizer)
        yield
        self.untoggle_optimizer(optimizer)

    def configure_optimizers(self) -> Any:
        opt_first = torch.optim.SGD(self.net[0].parameters(), lr=0.1)
        opt_last = torch.optim.Adam(self.net[2].parameters(), lr=0.01)
        return [opt_first, opt_last], [torch.optim.lr_scheduler.StepLR(opt_first, step_size=1, gamma=0.5)]


class MeanTarget(Metric):
    """A user metric as most are written: ``full_state_update`` left unset, so ``merge_state`` refuses it."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0), dist_reduce_fx="sum")

    def update(self, target: torch.Tensor) -> None:
        self.total += target.float().sum()
        self.count += target.numel()

    def compute(self) -> torch.Tensor:
        return self.total / self.count


class Classifier(L.LightningModule):
    """Logs every kind of value and uses torchmetrics the usual ways (forward, update, logged object)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(6, 3)
        self.train_f1 = MulticlassF1Score(num_classes=3, average="macro")
        self.val_acc = MulticlassAccuracy(num_classes=3)
        self.val_f1 = MulticlassF1Score(num_classes=3, average="macro")
        self.val_preds = CatMetric()
        self.val_target = MeanTarget()
        self.val_order: torch.Tensor | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_rows", len(x), reduce_fx="sum", on_step=True, on_epoch=True)
        self.log("train_max", logits.max(), reduce_fx="max", on_epoch=True)
        self.train_f1(logits, y)
        self.log("train_f1", self.train_f1, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.val_acc.update(logits, y)
        self.val_f1.update(logits, y)
        self.val_preds.update(logits.argmax(-1).float())
        self.val_target.update(y)
        self.log("val_acc", self.val_acc)
        self.log("val_target", self.val_target)

    def on_validation_epoch_end(self) -> None:
        self.log("val_f1", self.val_f1.compute())
        self.val_f1.reset()
        self.val_order = self.val_preds.compute()
        self.val_preds.reset()

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("test_loss", loss)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        hits = self.net(x).argmax(-1) == y
        # counts in two integer dtypes: summing over the replicas must keep each dtype
        probs = self.net(x).softmax(-1)
        return {"probs": probs, "correct": hits.sum(), "correct32": hits.sum(dtype=torch.int32)}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def classification_data(rows: int = 20, seed: int = 2) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 6, generator=g)
    return TensorDataset(x, (x[:, :3] @ torch.randn(3, 3, generator=g)).argmax(-1))
