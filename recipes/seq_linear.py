"""``seq_linear``: the DataParallel tutorial's ``nn.Linear(5, 5)`` over batches shaped ``[batch, 10, 5]``.

Usage::

    lightning-mgpu run seq_linear trainer.strategy=mgpu_dp trainer.devices=2
    lightning-mgpu run seq_linear trainer.devices=1

The first step says which input shape each forward pass sees: the whole ``[16, 10, 5]`` batch on
one device, ``[8, 10, 5]`` per replica under ``mgpu_dp`` over two devices (the tutorial's
"In Model: input size" lines), ``[8, 10, 5]`` per process under ``mgpu_ddp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset
from typing_extensions import override

from lightning_mgpu.config import schema

from ._base import Recipe, RecipeData, RegressionModule, log_input_shape, same_in_model_and_data, split


@dataclass
class ModelConfig:
    """The per-position linear map.

    Example::

        lightning-mgpu run seq_linear model.features=8
    """

    features: int = 5
    """Input and output features per position (the tutorial uses 5)."""

    def problems(self) -> list[str]:
        """Impossible values, one message each."""
        return schema.at_least("features", self.features, 1)


@dataclass
class DataConfig(schema.SplitDataConfig):
    """Synthetic sequences ``x`` of shape ``[seq_len, features]`` and targets ``x @ A.T + b``.

    Example::

        lightning-mgpu run seq_linear data.seq_len=32
    """

    num_samples: int = 1024
    """Sequences in the train and validation sets together."""
    seq_len: int = 10
    """Positions per sequence (the tutorial's 10)."""
    features: int = 5
    """Features per position; must equal ``model.features``."""
    val_fraction: float = 0.25
    """Share of the sequences held out for validation."""

    @override
    def problems(self) -> list[str]:
        return super().problems() + schema.minimums(self, num_samples=1, seq_len=1, features=1)


class SeqData(RecipeData):
    """Random sequences and their image under a fixed random linear map.

    Example::

        data = SeqData(batch_size=16)
        data.train_set[0][0].shape  # (10, 5)
    """

    def __init__(
        self,
        num_samples: int = 1024,
        seq_len: int = 10,
        features: int = 5,
        val_fraction: float = 0.25,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        gen = torch.Generator().manual_seed(self.seed)
        weight = torch.randn(features, features, generator=gen) / features**0.5
        bias = torch.randn(features, generator=gen)
        x = torch.randn(num_samples, seq_len, features, generator=gen)
        self.train_set, self.val_set = split(TensorDataset(x, x @ weight.T + bias), val_fraction, self.seed)


class SeqLinear(RegressionModule):
    """``nn.Linear(features, features)`` applied at every position, trained with MSE.

    Example::

        model = SeqLinear(features=5)
        model(torch.randn(16, 10, 5)).shape  # (16, 10, 5)
    """

    def __init__(self, features: int = 5, optimizer: dict[str, Any] | None = None) -> None:
        super().__init__(optimizer)
        self.save_hyperparameters()
        self.net = nn.Linear(features, features)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        log_input_shape("seq_linear", batch[0], batch_idx, self.current_epoch)
        return super().training_step(batch, batch_idx)


RECIPE = Recipe(
    "seq_linear", SeqLinear, SeqData, ModelConfig, DataConfig, check=same_in_model_and_data("features")
)
