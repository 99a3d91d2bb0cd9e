"""``lightning-mgpu demo``: fit a small regression model with ``mgpu_ddp`` on every local device.

On a CUDA machine this uses every visible GPU; on a CPU machine it starts one
process per core, up to ``--max-cpu-processes``.
"""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=int, default=3, help="epochs to train (default: 3)")
    parser.add_argument(
        "--max-cpu-processes", type=int, default=2, help="CPU processes when no GPU is present (default: 2)"
    )


def run(args: argparse.Namespace) -> int:
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_mgpu  # noqa: F401  registers mgpu_ddp

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    L.seed_everything(0, verbose=False)
    x = torch.randn(2048, 16)
    y = x @ torch.randn(16, 1) + 0.1 * torch.randn(2048, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)

    if torch.cuda.is_available():
        accelerator, devices = "gpu", torch.cuda.device_count()
    else:
        accelerator, devices = "cpu", max(1, min(args.max_cpu_processes, os.cpu_count() or 1))
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy="mgpu_ddp",
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regression()
    trainer.fit(model, loader)
    if trainer.is_global_zero:
        loss = trainer.callback_metrics["train_loss"].item()
        params = sum(p.numel() for p in model.parameters())
        print(
            f"demo: trained a {params}-parameter MLP for {args.epochs} epochs"
            f" with mgpu_ddp on {trainer.world_size} {accelerator} process(es); final train_loss={loss:.4f}"
        )
    return 0
