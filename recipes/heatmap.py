"""``heatmap``: a small conv net that predicts one heatmap per keypoint, trained with MSE.

Usage::

    lightning-mgpu run heatmap                     # all local devices
    lightning-mgpu run heatmap trainer.devices=1   # one device

The data are synthetic grey images holding one Gaussian blob per keypoint (keypoint ``k`` has
its own brightness, so the net can tell them apart); the target of keypoint ``k`` is a Gaussian
at its centre. Logs ``train/loss``, ``val/loss`` and ``val/keypoint_error_px``: the mean distance
in pixels between the predicted (arg-max) and true keypoint positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torchmetrics
from torch import nn
from torch.utils.data import TensorDataset
from typing_extensions import override

from lightning_mgpu.config import schema

from ._base import Recipe, RecipeData, RegressionModule, same_in_model_and_data, split


@dataclass
class ModelConfig:
    """The heatmap network.

    Example::

        lightning-mgpu run heatmap model.channels=64
    """

    keypoints: int = 2
    """Heatmaps predicted per image; must equal ``data.keypoints``."""
    channels: int = 32
    """Width of the hidden conv layers."""

    def problems(self) -> list[str]:
        """Impossible values, one message each."""
        return schema.minimums(self, keypoints=1, channels=1)


@dataclass
class DataConfig(schema.SplitDataConfig):
    """Synthetic images with Gaussian blobs.

    Example::

        lightning-mgpu run heatmap data.image_size=64 data.sigma=3
    """

    num_samples: int = 2048
    """Images in the train and validation sets together."""
    image_size: int = 32
    """Height and width of each image."""
    keypoints: int = 2
    """Blobs per image, one per keypoint."""
    sigma: float = 2.0
    """Standard deviation of each blob and target, in pixels."""

    @override
    def problems(self) -> list[str]:
        out = super().problems() + schema.minimums(self, num_samples=2, image_size=8, keypoints=1)
        return out + ([] if self.sigma > 0 else [f"sigma: must be > 0, got {self.sigma:g}"])


def gaussian_maps(centres: torch.Tensor, size: int, sigma: float) -> torch.Tensor:
    """Gaussian bumps of height 1 at ``centres`` (``[..., 2]`` as row, column) on ``size x size`` grids."""
    grid = torch.arange(size, dtype=torch.float32)
    dy = (grid.view(-1, 1) - centres[..., 0, None, None]) ** 2
    dx = (grid.view(1, -1) - centres[..., 1, None, None]) ** 2
    return torch.exp(-(dy + dx) / (2 * sigma**2))


class HeatmapData(RecipeData):
    """Images ``[1, size, size]`` and target heatmaps ``[keypoints, size, size]``.

    Example::

        data = HeatmapData(keypoints=2, image_size=32)
        image, target = data.train_set[0]
    """

    def __init__(
        self,
        num_samples: int = 2048,
        image_size: int = 32,
        keypoints: int = 2,
        sigma: float = 2.0,
        val_fraction: float = 0.2,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        gen = torch.Generator().manual_seed(self.seed)
        margin = 2 * sigma
        centres = margin + torch.rand(num_samples, keypoints, 2, generator=gen) * (
            image_size - 1 - 2 * margin
        )
        targets = gaussian_maps(centres, image_size, sigma)
        brightness = torch.linspace(1.0, 0.4, keypoints).view(1, -1, 1, 1)
        images = (targets * brightness).amax(dim=1, keepdim=True)
        images = images + 0.05 * torch.randn(images.shape, generator=gen)
        self.train_set, self.val_set = split(TensorDataset(images, targets), val_fraction, self.seed)


class HeatmapNet(RegressionModule):
    """Three 3x3 conv layers keeping the resolution, then one 1x1 conv to ``keypoints`` heatmaps.

    Example::

        model = HeatmapNet(keypoints=2)
        model(torch.randn(4, 1, 32, 32)).shape  # (4, 2, 32, 32)
    """

    def __init__(
        self, keypoints: int = 2, channels: int = 32, optimizer: dict[str, Any] | None = None
    ) -> None:
        super().__init__(optimizer)
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=2, dilation=2),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, keypoints, 1),
        )
        self.val_error = torchmetrics.MeanMetric()

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        pred = super().validation_step(batch, batch_idx)
        self.val_error.update(torch.linalg.vector_norm(_argmax_2d(pred) - _argmax_2d(batch[1]), dim=-1))
        return pred

    @override
    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        self.log("val/keypoint_error_px", self.val_error, prog_bar=True)


def _argmax_2d(maps: torch.Tensor) -> torch.Tensor:
    """Row and column of each map's maximum, as floats: ``[..., H, W] -> [..., 2]``."""
    width = maps.shape[-1]
    flat = maps.flatten(-2).argmax(dim=-1)
    return torch.stack([flat // width, flat % width], dim=-1).float()


RECIPE = Recipe(
    "heatmap", HeatmapNet, HeatmapData, ModelConfig, DataConfig, check=same_in_model_and_data("keypoints")
)
