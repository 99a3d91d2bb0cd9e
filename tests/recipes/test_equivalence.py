"""``digits`` ends with the same weights on one device, under ``mgpu_ddp`` (2 CPU processes) and ``mgpu_dp``.

``data.batch_size`` is the global batch: one device loads 64, each DDP process 32, and ``mgpu_dp``
splits 64 over its two replicas; with no shuffling and no dropout every run takes the same steps.
SGD rather than the config's AdamW: Adam's first step divides each gradient by its own size, which
turns float rounding in near-zero gradients into differences as large as the learning rate.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch

from lightning_mgpu.cli.main import main
from tests.helpers import run_command

DETERMINISTIC = [
    "model.dropout=0",
    "data.shuffle=false",
    "data.batch_size=64",
    "trainer.max_steps=4",
    "optimizer._component_=sgd",
    "optimizer.lr=0.05",
    "optimizer.scheduler=none",
    "trainer.limit_val_batches=0",
    "callbacks.checkpoint.monitor=null",
    "trainer.accelerator=cpu",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert ckpt["global_step"] == 4
    return {k: v for k, v in ckpt["state_dict"].items() if k.startswith("net.")}


def test_single_device_ddp_and_dp_give_the_same_weights(tmp_path: Path) -> None:
    assert main(["run", "digits", *DETERMINISTIC, "trainer.devices=1", f"run_dir={tmp_path / 'single'}"]) == 0
    single = final_weights(tmp_path / "single")

    two = [*DETERMINISTIC, "trainer.devices=2"]
    assert main(["run", "digits", *two, "trainer.strategy=mgpu_dp", f"run_dir={tmp_path / 'dp'}"]) == 0
    torch.testing.assert_close(final_weights(tmp_path / "dp"), single, atol=1e-6, rtol=0)

    ddp = [*two, "trainer.strategy=mgpu_ddp", f"run_dir={tmp_path / 'ddp'}"]
    result = run_command([sys.executable, "-m", "lightning_mgpu", "run", "digits", *ddp], cwd=tmp_path)
    assert result.returncode == 0, result.output
    assert "with mgpu_ddp on 2 cpu devices" in result.stdout
    torch.testing.assert_close(final_weights(tmp_path / "ddp"), single, atol=1e-6, rtol=0)

    L.seed_everything(0, verbose=False)  # the run's seed: the same initial weights
    from lightning_mgpu.recipes.digits import ConvClassifier

    initial = {f"net.{k}": v for k, v in ConvClassifier(dropout=0).net.state_dict().items()}
    assert not torch.allclose(initial["net.0.weight"], single["net.0.weight"]), "the runs did not train"
