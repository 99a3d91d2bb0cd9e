"""``ModelStateMeter``: what ``measure_model_state`` reads, at every call, measured again only when needed."""

from __future__ import annotations

import torch
from torch import nn

from lightning_mgpu.estimate.model_state import ModelStateMeter, measure_model_state


def test_the_meter_reads_what_a_fresh_measurement_reads_as_tensors_come_and_go() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    meter = ModelStateMeter()

    def same() -> None:
        assert meter(model, [optimizer]) == measure_model_state(model, [optimizer])

    same()  # parameters only
    model(torch.randn(3, 4)).sum().backward()
    same()  # gradients appeared
    optimizer.step()
    same()  # AdamW's state appeared
    optimizer.zero_grad(set_to_none=True)
    same()  # gradients gone
    model[0].weight.requires_grad_(False)
    model(torch.randn(3, 4)).sum().backward()
    same()  # one gradient fewer
    model.add_module("extra", nn.Linear(2, 2))
    for _ in range(ModelStateMeter.RELIST):
        meter(model, [optimizer])
    same()  # a parameter added in place: seen once the parameters are listed again
    assert meter(nn.Linear(3, 3)) == measure_model_state(nn.Linear(3, 3))  # another module at once


def test_a_step_that_changes_no_tensor_is_not_measured_again() -> None:
    model = nn.Linear(4, 2)
    meter = ModelStateMeter()
    first = meter(model)
    assert meter(model) is first  # the same measurement, not a new one
