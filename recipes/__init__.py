"""The tutorial models as recipes: a LightningModule, its LightningDataModule and YAML configs.

- one module per recipe (``linear.py``, ``seq_linear.py``, ``heatmap.py``, ``digits.py``,
  ``mnist.py``, ``resnet.py``), each defining ``RECIPE`` and its ``ModelConfig``/``DataConfig``;
- ``_base.py``: what they share (the optimizer built from the config, the global batch,
  regression and classification steps);
- ``configs/``: the shipped YAML configs, each opening with the command that runs it.

Installed as ``lightning_mgpu.recipes``; the configs ship in ``configs/``. Run one with
``lightning-mgpu run digits`` and list them with ``lightning-mgpu recipes``. Importing this
package does not import torch; ``load_recipe`` imports one recipe's module.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

__all__ = ["CONFIG_DIR", "DEFAULT_RECIPE", "RECIPES", "load_recipe"]

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
"""Folder of the shipped configs."""

DEFAULT_RECIPE = "digits"
"""What ``lightning-mgpu run`` runs without a config."""

# name -> one-line description; each name is a module of this package defining RECIPE
RECIPES: dict[str, str] = {
    "linear": "nn.Linear(10, 1) regression on synthetic data; reports the distance to the true weights",
    "seq_linear": "nn.Linear(5, 5) over [batch, 10, 5] sequences: watch the batch being split",
    "heatmap": "small conv net predicting keypoint heatmaps of synthetic Gaussian blobs (MSE)",
    "digits": "conv classifier on scikit-learn's bundled 8x8 handwritten digits (no download)",
    "mnist": "the same classifier on MNIST IDX files from a folder you give (data.root)",
    "resnet": "ResNet-18/50 with torchvision's state_dict keys: image folders, prediction on a chosen device",
}


def load_recipe(name: str) -> Any:
    """Import recipe ``name`` and return its ``Recipe`` (module, datamodule and config classes).

    Raises:
        KeyError: ``name`` is not a recipe; the message lists them.

    Example::

        spec = load_recipe("digits")
        model = spec.module()
    """
    if name not in RECIPES:
        raise KeyError(f"no recipe named {name!r}; recipes: {', '.join(RECIPES)}")
    return importlib.import_module(f"{__name__}.{name}").RECIPE
