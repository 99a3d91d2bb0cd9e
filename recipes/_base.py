"""What every recipe shares: the optimizer from the config, the global batch, classification steps.

The optimizer is built by ``lightning_mgpu.config.optimizer.build_optimizer`` from the config's
class path (``optimizer._component_``) with the schema's defaults.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
import torchmetrics
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset
from typing_extensions import override

from lightning_mgpu.config.optimizer import build_optimizer, with_defaults
from lightning_mgpu.config.schema import DataConfig

__all__ = [
    "ClassifierModule",
    "Recipe",
    "RecipeData",
    "RecipeModule",
    "RegressionModule",
    "per_process_batch_size",
    "same_in_model_and_data",
    "split",
]


@dataclass(frozen=True)
class Recipe:
    """One recipe: its LightningModule, LightningDataModule and the config classes of their arguments.

    Example::

        RECIPE = Recipe("digits", DigitsClassifier, DigitsData, ModelConfig, DigitsDataConfig)
    """

    name: str
    module: type[RecipeModule]
    datamodule: type[RecipeData]
    model_config: type
    data_config: type[DataConfig]
    tasks: tuple[str, ...] = ("fit", "validate")
    check: Callable[[Any], list[str]] = field(default=lambda cfg: [])
    """Cross-section checks (e.g. class count of the data against the model), run during validation."""


def same_in_model_and_data(name: str) -> Callable[[Any], list[str]]:
    """A ``Recipe.check`` requiring ``model.<name>`` and ``data.<name>`` to be equal.

    Example::

        RECIPE = Recipe(..., check=same_in_model_and_data("in_features"))
    """

    def check(cfg: Any) -> list[str]:
        model, data = getattr(cfg.model, name), getattr(cfg.data, name)
        return [] if model == data else [f"data.{name}={data} must equal model.{name}={model}"]

    return check


def per_process_batch_size(batch_size: int, world_size: int) -> int:
    """The batch each process loads for a GLOBAL ``batch_size`` split over ``world_size`` processes.

    Raises:
        ValueError: ``batch_size`` does not divide evenly; the message names the nearest values that do.

    Example::

        per_process_batch_size(64, 2)  # 32
    """
    if batch_size % world_size:
        lower = batch_size // world_size * world_size
        options = [str(v) for v in (lower, lower + world_size) if v > 0]
        raise ValueError(
            f"data.batch_size={batch_size} is the global batch and must divide evenly over the {world_size} "
            f"training processes; use data.batch_size={' or data.batch_size='.join(options)}"
        )
    return batch_size // world_size


def split(dataset: Dataset, val_fraction: float, seed: int) -> tuple[Subset, Subset]:
    """A reproducible train/validation split (the same on every rank: it depends on ``seed`` only)."""
    n = len(dataset)  # type: ignore[arg-type]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = max(1, math.floor(n * val_fraction))
    return Subset(dataset, order[n_val:]), Subset(dataset, order[:n_val])


class RecipeModule(L.LightningModule):
    """Base of the recipe modules: holds the network as ``self.net`` and builds the configured optimizer.

    Args:
        optimizer: the config's ``optimizer`` section as a dict (``_component_`` or ``name``, lr,
            weight_decay, momentum, kwargs, scheduler); what it leaves out takes the schema's default.

    Example::

        class Tiny(RecipeModule):
            def __init__(self, optimizer=None):
                super().__init__(optimizer)
                self.net = nn.Linear(2, 1)
    """

    net: nn.Module

    def __init__(self, optimizer: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.optimizer_config = dict(optimizer or {})

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def make_optimizer(self) -> torch.optim.Optimizer:
        """The configured optimizer over this module's parameters (the schedule needs a Trainer)."""
        return build_optimizer(self.parameters(), self.optimizer_config)

    @override
    def configure_optimizers(self) -> Any:
        opt = self.make_optimizer()
        if with_defaults(self.optimizer_config)["scheduler"] != "cosine":
            return opt
        estimated = self.trainer.estimated_stepping_batches
        if not math.isfinite(estimated):
            raise ValueError(
                "the cosine schedule decays over the run's optimizer steps, but this Trainer has no limit:"
                " set max_steps or max_epochs, or optimizer={'scheduler': 'none'}"
            )
        steps = max(1, int(estimated))
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class RecipeData(L.LightningDataModule):
    """Base of the recipe data modules: loaders that turn the GLOBAL ``batch_size`` into each process's batch.

    Subclasses set ``self.train_set`` and ``self.val_set`` in ``setup`` (and ``self.predict_set``
    when they predict).

    Args:
        batch_size: the global batch per optimizer step (``mgpu_dp`` splits it over devices;
            under DDP each of N processes loads ``batch_size / N``).
        num_workers: loader worker processes per training process.
        shuffle: shuffle the training set every epoch.
        seed: seed of synthetic data and of the train/validation split.

    Example::

        class Tiny(RecipeData):
            def setup(self, stage):
                self.train_set = self.val_set = TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
    """

    train_set: Dataset
    val_set: Dataset
    predict_set: Dataset

    def __init__(
        self, batch_size: int = 64, num_workers: int = 0, shuffle: bool = True, seed: int = 0
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.shuffle = shuffle
        self.seed = seed

    def loader_batch_size(self) -> int:
        """This process's batch: the global batch divided by the number of training processes."""
        world_size = self.trainer.world_size if self.trainer is not None else 1
        return per_process_batch_size(self.batch_size, world_size)

    def _loader(self, dataset: Dataset, shuffle: bool = False) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.loader_batch_size(),
            shuffle=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=self.shuffle)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set)

    @override
    def predict_dataloader(self) -> DataLoader:
        return self._loader(getattr(self, "predict_set", self.val_set))

    def example_batch(self, size: int) -> Any:
        """``size`` training samples collated as one batch: what one device sees, for memory estimates."""
        self.setup("fit")
        loader = DataLoader(self.train_set, batch_size=size)
        return next(iter(loader))


class RegressionModule(RecipeModule):
    """Mean-squared-error regression: logs ``train/loss`` and ``val/loss`` (over the whole validation set).

    Subclasses set ``self.net``; ``validation_step`` returns the predictions for further metrics.

    Args:
        optimizer: the config's ``optimizer`` section.

    Example::

        class Tiny(RegressionModule):
            def __init__(self, optimizer=None):
                super().__init__(optimizer)
                self.net = nn.Linear(4, 1)
    """

    def __init__(self, optimizer: dict[str, Any] | None = None) -> None:
        super().__init__(optimizer)
        self.val_loss = torchmetrics.MeanSquaredError()

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        pred = self(x)
        self.val_loss.update(pred, y)
        return pred

    @override
    def on_validation_epoch_end(self) -> None:
        self.log("val/loss", self.val_loss, prog_bar=True)


class ClassifierModule(RecipeModule):
    """Cross-entropy classification: logs ``train/loss``, ``val/loss`` and ``val/acc``; predicts classes.

    Subclasses set ``self.net``. ``predict_step`` returns ``pred`` (class) and ``prob`` (its softmax
    probability) per sample.

    Args:
        num_classes: number of classes.
        optimizer: the config's ``optimizer`` section.

    Example::

        class Tiny(ClassifierModule):
            def __init__(self, optimizer=None):
                super().__init__(num_classes=3, optimizer=optimizer)
                self.net = nn.Linear(4, 3)
    """

    def __init__(self, num_classes: int, optimizer: dict[str, Any] | None = None) -> None:
        super().__init__(optimizer)
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes, average="micro")
        self.val_loss = torchmetrics.MeanMetric()

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_loss.update(nn.functional.cross_entropy(logits, y), weight=len(y))
        self.val_acc.update(logits, y)

    @override
    def on_validation_epoch_end(self) -> None:
        # Logging the Metric objects lets Lightning sync them over processes, compute and reset them.
        self.log("val/loss", self.val_loss)
        self.log("val/acc", self.val_acc, prog_bar=True)

    @override
    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> dict[str, torch.Tensor]:
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        prob, pred = torch.softmax(self(x), dim=-1).max(dim=-1)
        return {"pred": pred, "prob": prob}


def log_input_shape(name: str, x: torch.Tensor, batch_idx: int, epoch: int) -> None:
    """Say once which input shape a forward pass sees, as the DataParallel tutorial prints it."""
    if batch_idx == 0 and epoch == 0:
        rank_zero_info(f"{name}: forward sees input of shape {list(x.shape)} on {x.device}")
