"""What every recipe shares: the configured optimizer and its schedule under a real Trainer."""

from __future__ import annotations

import lightning as L
import pytest

from lightning_mgpu.recipes.linear import LinearData, LinearRegression


def test_cosine_without_a_step_limit_is_a_clear_error() -> None:
    module = LinearRegression(optimizer={"name": "sgd", "lr": 0.1, "scheduler": "cosine"})
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
