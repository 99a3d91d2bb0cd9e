"""``digits`` (the default recipe): a small conv classifier on real handwritten digits, no download needed.

Usage::

    lightning-mgpu run digits                                       # all local devices, mgpu_auto
    lightning-mgpu run digits trainer.devices=1                     # one device
    lightning-mgpu run digits trainer.strategy=mgpu_dp trainer.devices=2

The data is scikit-learn's bundled copy of the UCI handwritten digits: 1797 grey 8x8 images of
0-9 (install the ``recipes`` extra: ``pip install 'lightning-mgpu[recipes]'``). A fixed 20 % is
held out; ``val/acc`` is the accuracy on it. The same network serves the ``mnist`` recipe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from lightning_mgpu.config import schema

from ._base import ClassifierModule, Recipe, RecipeData, split


@dataclass
class ModelConfig:
    """The conv classifier.

    Example::

        lightning-mgpu run digits model.hidden=256 model.dropout=0
    """

    channels: int = 32
    """Filters of the first conv layer (the second has twice as many)."""
    hidden: int = 128
    """Width of the hidden fully connected layer."""
    dropout: float = 0.1
    """Dropout before the last layer. Each ``mgpu_dp`` replica draws its own masks, so only 0 makes
    ``mgpu_dp`` match one device step for step (and makes runs exactly repeatable)."""
    num_classes: int = 10
    """Classes to tell apart."""

    def problems(self) -> list[str]:
        """Impossible values, one message each."""
        out = schema.minimums(self, channels=1, hidden=1, num_classes=2)
        if not 0.0 <= self.dropout < 1.0:
            out.append(f"dropout: must be in [0, 1), got {self.dropout:g}")
        return out


@dataclass
class DataConfig(schema.SplitDataConfig):
    """scikit-learn's digits, split once into train and validation.

    Example::

        lightning-mgpu run digits data.val_fraction=0.3
    """


class ConvClassifier(ClassifierModule):
    """Two conv layers, pooled to 2x2 whatever the image size, then two linear layers.

    Works on any single-channel image size from 8x8 up (digits are 8x8, MNIST 28x28).

    Example::

        model = ConvClassifier()
        model(torch.randn(4, 1, 8, 8)).shape  # (4, 10)
    """

    def __init__(
        self,
        channels: int = 32,
        hidden: int = 128,
        dropout: float = 0.1,
        num_classes: int = 10,
        optimizer: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(num_classes, optimizer)
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveMaxPool2d(2),
            nn.Flatten(),
            nn.Linear(8 * channels, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits as images ``[1797, 1, 8, 8]`` scaled to [0, 1] and labels ``[1797]``.

    Raises:
        ModuleNotFoundError: scikit-learn is not installed; the message gives the install command.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ModuleNotFoundError(
            "the digits recipe reads scikit-learn's bundled digits: pip install 'lightning-mgpu[recipes]'"
        ) from err
    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return images, torch.tensor(bunch.target, dtype=torch.long)


class DigitsData(RecipeData):
    """The 1797 digits, split into train and validation by ``seed``.

    Example::

        data = DigitsData(batch_size=64)
        len(data.val_set)  # 359
    """

    def __init__(self, val_fraction: float = 0.2, **loader: Any) -> None:
        super().__init__(**loader)
        self.train_set, self.val_set = split(TensorDataset(*load_digits_tensors()), val_fraction, self.seed)


RECIPE = Recipe(
    "digits", ConvClassifier, DigitsData, ModelConfig, DataConfig, tasks=("fit", "validate", "predict")
)
