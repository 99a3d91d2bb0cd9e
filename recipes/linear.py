"""``linear``: the tutorials' ``nn.Linear(10, 1)``, fitted to synthetic data whose true weights are known.

Usage::

    lightning-mgpu run linear                                  # all local devices
    lightning-mgpu run linear trainer.devices=1                # one device

Logs ``train/loss``, ``val/loss`` and ``val/weight_distance``: the Euclidean distance of the learned
weight and bias to the true ones, which shrinks towards the noise level as training goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset
from typing_extensions import override

from lightning_mgpu.config import schema

from ._base import Recipe, RecipeData, RegressionModule, same_in_model_and_data, split


@dataclass
class ModelConfig:
    """The regression model.

    Example::

        lightning-mgpu run linear model.in_features=20
    """

    in_features: int = 10
    """Inputs per sample (the tutorials use 10)."""

    def problems(self) -> list[str]:
        """Impossible values, one message each."""
        return schema.at_least("in_features", self.in_features, 1)


@dataclass
class DataConfig(schema.SplitDataConfig):
    """Synthetic ``y = x @ w + b + noise`` with ``w`` and ``b`` drawn from ``seed``.

    Example::

        lightning-mgpu run linear data.noise=0.1 data.num_samples=10000
    """

    num_samples: int = 4096
    """Samples in the train and validation sets together."""
    in_features: int = 10
    """Inputs per sample; must equal ``model.in_features``."""
    noise: float = 0.01
    """Standard deviation of the noise added to ``y``."""

    @override
    def problems(self) -> list[str]:
        return super().problems() + schema.minimums(self, num_samples=2, noise=0.0)


class LinearData(RecipeData):
    """Synthetic regression data; ``true_weight`` and ``true_bias`` are the answer.

    Example::

        data = LinearData(batch_size=64)
        data.setup("fit")
        data.true_weight.shape  # (1, 10)
    """

    def __init__(
        self,
        num_samples: int = 4096,
        in_features: int = 10,
        noise: float = 0.01,
        val_fraction: float = 0.2,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        gen = torch.Generator().manual_seed(self.seed)
        self.true_weight = torch.randn(1, in_features, generator=gen)
        self.true_bias = torch.randn(1, generator=gen)
        x = torch.randn(num_samples, in_features, generator=gen)
        y = x @ self.true_weight.T + self.true_bias + noise * torch.randn(num_samples, 1, generator=gen)
        self.train_set, self.val_set = split(TensorDataset(x, y), val_fraction, self.seed)


class LinearRegression(RegressionModule):
    """``nn.Linear(in_features, 1)`` trained with MSE.

    Example::

        model = LinearRegression(in_features=10)
    """

    def __init__(self, in_features: int = 10, optimizer: dict[str, Any] | None = None) -> None:
        super().__init__(optimizer)
        self.save_hyperparameters()
        self.net: nn.Linear = nn.Linear(in_features, 1)

    @override
    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        data = getattr(self.trainer, "datamodule", None)
        if isinstance(data, LinearData):
            learned = torch.cat([self.net.weight.detach().flatten(), self.net.bias.detach()]).cpu()
            truth = torch.cat([data.true_weight.flatten(), data.true_bias])
            distance = torch.linalg.vector_norm(learned - truth)
            self.log("val/weight_distance", distance, prog_bar=True, sync_dist=True)  # equal on every rank


RECIPE = Recipe(
    "linear",
    LinearRegression,
    LinearData,
    ModelConfig,
    DataConfig,
    check=same_in_model_and_data("in_features"),
)
