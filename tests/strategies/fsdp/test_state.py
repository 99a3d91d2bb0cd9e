"""Bytes of model state one process holds: whole tensors here, local shards under ``fully_shard``."""

from __future__ import annotations

import torch
from torch import nn

from lightning_mgpu.estimate.model_state import measure_model_state


def test_model_state_of_an_unsharded_model_is_held_whole() -> None:
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    state = measure_model_state(model, [optimizer])
    assert state.local == state.whole
    assert (state.local.parameters, state.local.gradients) == (40, 40)
    assert state.local.optimizer == 2 * 40 + 2 * 4  # two moments, and a step count per parameter
    assert state.share == 1.0
