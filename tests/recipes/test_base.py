"""What every recipe shares: the configured optimizer and its schedule under a real Trainer."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch

from lightning_mgpu.config.optimizer import OptimizerConfig
from lightning_mgpu.recipes.linear import LinearData, LinearRegression


def test_cosine_without_a_step_limit_is_a_clear_error() -> None:
    module = LinearRegression(optimizer={"_component_": "sgd", "lr": 0.1, "scheduler": "cosine"})
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=-1,
        max_steps=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(ValueError, match="cosine schedule .* no limit: set max_steps or max_epochs"):
        trainer.fit(module, datamodule=LinearData(num_samples=64, batch_size=16))
    assert trainer.global_step == 0


def test_optimizer_is_built_from_the_class_path_with_the_schema_defaults(
    caplog: pytest.LogCaptureFixture,
) -> None:
    section = {"_component_": "torch.optim.RMSprop", "lr": 0.01, "kwargs": {"alpha": 0.9}}
    with caplog.at_level(logging.DEBUG, logger="lightning_mgpu.config.optimizer"):
        rmsprop = LinearRegression(optimizer=section).make_optimizer()
    assert type(rmsprop) is torch.optim.RMSprop
    chosen = (rmsprop.defaults["lr"], rmsprop.defaults["alpha"], rmsprop.defaults["momentum"])
    assert chosen == (0.01, 0.9, 0.9)
    assert "optimizer torch.optim.rmsprop.RMSprop for 'torch.optim.RMSprop'" in caplog.text

    defaults = OptimizerConfig()
    sgd = LinearRegression(optimizer={"_component_": "sgd"}).make_optimizer()
    assert type(sgd) is torch.optim.SGD
    assert (sgd.defaults["lr"], sgd.defaults["momentum"]) == (defaults.lr, defaults.momentum)
    adamw = LinearRegression().make_optimizer()
    assert type(adamw) is torch.optim.AdamW
    assert adamw.defaults["weight_decay"] == defaults.weight_decay
    with pytest.raises(ValueError, match="'adan' is not an optimizer; did you mean adam?"):
        LinearRegression(optimizer={"_component_": "adan"}).make_optimizer()
    with pytest.raises(ValueError, match="unknown key.s. name; valid keys: _component_"):
        LinearRegression(optimizer={"name": "sgd"}).make_optimizer()
