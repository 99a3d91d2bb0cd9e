"""Tiny models, wrappers and real Lightning checkpoints shared by the checkpoint tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset


def net(seed: int = 0) -> nn.Sequential:
    """Linear + BatchNorm (with its int64 buffer) + Linear; ``seed`` picks the initial values."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))


class Residual(nn.Module):
    """A user's block that keeps its only layer in ``self.module``: named like a wrapper, but not one."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.module(x)


class ResNet(nn.Module):
    """Residual blocks at every depth a wrapper could sit: ``stem.module.``, ``blocks.0.module.``."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.stem = Residual(nn.Linear(4, 4))
        self.blocks = nn.Sequential(Residual(nn.Linear(4, 4)), Residual(nn.Linear(4, 4)))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


class LitNet(L.LightningModule):
    """A LightningModule holding the model as ``self.model``, optionally with config hyperparameters."""

    def __init__(self, model: nn.Module | None = None, cfg: Any = None) -> None:
        super().__init__()
        if cfg is not None:
            self.save_hyperparameters(cfg)
        self.model = model if model is not None else net()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.model(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class LitTwo(LitNet):
    """A LightningModule with a second submodule that has state: a weighted loss."""

    def __init__(self) -> None:
        super().__init__()
        self.loss_fn = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0]))


def loader(n: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(
        TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)), batch_size=8
    )


def trainer(root: Path, **kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    options.update(kwargs)
    return L.Trainer(**options)


def lightning_checkpoint(path: Path, cfg: Any = None) -> LitNet:
    """Fit a LitNet for two steps and save a real Lightning checkpoint at ``path``; returns the module."""
    module = LitNet(net(seed=3), cfg=cfg)
    fit = trainer(path.parent)
    fit.fit(module, loader())
    fit.save_checkpoint(path)
    return module


def init_single_process_group(tmp_path: Path) -> None:
    """A gloo group of one, so DistributedDataParallel can wrap a model inside pytest."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)


# kind -> how users wrap a plain model
WRAPS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "plain": lambda m: m,
    "dataparallel": nn.DataParallel,
    "ddp": DistributedDataParallel,
    "compiled": torch.compile,
    "compiled_dataparallel": lambda m: torch.compile(nn.DataParallel(m)),
    "lightning_module": LitNet,
}
_COMPILED: dict[tuple[str, str], nn.Module] = {}


def wrap(kind: str, model: nn.Module, role: str = "target") -> nn.Module:
    """``WRAPS[kind](model)``; a compiled wrapper is built once per kind and role and given the
    model's values, because each ``torch.compile`` call costs ~0.15 s (the key form is the same)."""
    if not kind.startswith("compiled"):
        return WRAPS[kind](model)
    if (kind, role) not in _COMPILED:
        _COMPILED[kind, role] = WRAPS[kind](net())
    compiled = _COMPILED[kind, role]
    plain_module(compiled).load_state_dict(model.state_dict())
    return compiled


def plain_module(module: nn.Module) -> nn.Module:
    """The model under any wrapper."""
    while True:
        inner = getattr(module, "module", None) or getattr(module, "_orig_mod", None)
        if isinstance(module, LitNet):
            inner = module.model
        if inner is None:
            return module
        module = inner


def plain_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """The model's own state_dict, from under any wrapper."""
    return plain_module(module).state_dict()


def assert_same(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    """Same names (in any order), same dtypes, same values."""
    assert sorted(expected) == sorted(actual)
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=0, atol=0, msg=key)
