"""One ``mgpu_ddp`` step on GPU 0 (tests/strategies/ddp/test_options.py runs it with one GPU visible).

Usage: ``CUDA_VISIBLE_DEVICES=N python ddp_one_gpu.py``; the start-up summary names the physical GPU.
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu  # noqa: F401  (registers the strategies)
from tests.models import Regression

trainer = L.Trainer(accelerator="gpu", devices=[0], strategy="mgpu_ddp", max_steps=1, logger=False)
trainer.fit(Regression(), DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4))
