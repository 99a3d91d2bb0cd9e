"""The one optimizer-state counter: stepped on meta tensors, torch's known state where that cannot run."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_mgpu import estimate_memory
from lightning_mgpu.estimate.optimizer_state import OptimizerState, count_optimizer_state

KiB = 1024


def stack() -> nn.Module:
    """Two 64x64 layers with biases: 8320 float32 parameters, 32.5 KiB."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params),
    "amsgrad": lambda params: torch.optim.Adam(params, amsgrad=True, fused=True),
    "rmsprop": lambda params: torch.optim.RMSprop(params, momentum=0.9, centered=True),
    "adagrad": lambda params: torch.optim.Adagrad(params),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_the_count_is_what_estimate_memory_measures_after_its_steps(name: str, precision: str) -> None:
    model = stack()
    optimizer = OPTIMIZERS[name](model.parameters())
    estimate = estimate_memory(model, torch.randn(4, 64), optimizer=optimizer, precision=precision)
    dtype = torch.bfloat16 if precision == "bf16-true" else None
    counted = count_optimizer_state(model, optimizer=optimizer, param_dtype=dtype)
    assert counted == OptimizerState(
        estimate.optimizer_state_bytes, type(optimizer).__name__, step_temporaries=counted.step_temporaries
    )
    copies = {"sgd": 0, "momentum": 1, "adamw": 2, "amsgrad": 3, "rmsprop": 3, "adagrad": 1}[name]
    assert counted.bytes == copies * 33280 // (2 if dtype else 1)


class ClippingAdamW(torch.optim.AdamW):
    """Reads the gradients' norm before each step: a value, which meta tensors do not have."""

    def step(self, closure: Any = None) -> Any:
        norm = torch.stack([p.grad.norm() for g in self.param_groups for p in g["params"]]).norm()
        if norm.item() > 1e6:
            raise RuntimeError("gradients exploded")
        return super().step(closure)


def test_an_optimizer_that_cannot_step_on_meta_counts_by_its_class_known_state() -> None:
    model = stack()
    optimizer = ClippingAdamW(model.parameters())
    counted = count_optimizer_state(model, optimizer=optimizer)
    # the estimate falls back to stepping on CPU: the same bytes
    measured = estimate_memory(model, torch.randn(4, 64), optimizer=optimizer)
    assert "could not step on meta tensors" in " ".join(measured.notes)
    assert counted == OptimizerState(
        measured.optimizer_state_bytes,
        "ClippingAdamW",
        "ClippingAdamW's known state per parameter: it cannot step on meta tensors",
    )  # and no temporaries: they are measured by stepping
    assert counted.counted


@pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="this torch has no Adafactor")
def test_a_factored_state_that_cannot_step_on_meta_counts_what_a_real_step_keeps() -> None:
    """Adafactor keeps a row and a column statistic per matrix, not moments of the weight's shape."""
    model = stack()
    counted = count_optimizer_state(model, optimizer=torch.optim.Adafactor(model.parameters()))
    real = torch.optim.Adafactor(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    real.step()
    kept = [t for state in real.state.values() for t in state.values() if torch.is_tensor(t) and t.dim() > 0]
    assert counted.bytes == sum(t.numel() * t.element_size() for t in kept) == 2 * (64 + 64 + 64) * 4
    assert "known state per parameter" in counted.note


def test_an_optimizer_of_sparse_gradients_is_counted() -> None:
    model = nn.Sequential(nn.Embedding(100, 16))  # 6.25 KiB of float32 weights
    counted = count_optimizer_state(model, optimizer=torch.optim.SparseAdam(list(model.parameters())))
    assert counted.bytes == 2 * 100 * 16 * 4  # two moments of the weight's shape
    assert "SparseAdam's known state per parameter" in counted.note


def test_what_cannot_be_counted_says_why() -> None:
    model = stack()
    lbfgs = count_optimizer_state(model, optimizer=torch.optim.LBFGS(model.parameters()))
    assert lbfgs == OptimizerState(
        0, "LBFGS", "not counted: LBFGS cannot step on meta tensors and its state is not known"
    )
    assert not lbfgs.counted
    assert count_optimizer_state(model).note == (
        "not counted: no optimizer given, and the model has no configure_optimizers"
    )


def test_meta_parameters_count_by_their_shape() -> None:
    with torch.device("meta"):
        model = nn.Linear(1024, 1024, bias=False)  # 4 MiB, never allocated
    counted = count_optimizer_state(model, optimizer=torch.optim.Adam(model.parameters()))
    assert counted.bytes == 8 * 1024 * KiB


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_step_s_temporaries_are_what_estimate_memory_s_step_holds_beside_the_model_state(
    name: str,
) -> None:
    model = stack()
    optimizer = OPTIMIZERS[name](model.parameters())
    estimate = estimate_memory(model, torch.randn(4, 64), optimizer=optimizer)
    held = estimate.parameter_bytes + estimate.gradient_bytes + estimate.optimizer_state_bytes
    counted = count_optimizer_state(model, optimizer=optimizer)
    assert counted.step_temporaries == estimate.optimizer_step[0] - held
    # foreach's AdamW keeps one parameter-sized list for a moment, Adagrad two (its state, built with the
    # optimizer, counts beside them); SGD's momentum updates in place
    expected = {"sgd": 0, "momentum": 0, "adamw": 33280, "adagrad": 2 * 33280}
    assert counted.step_temporaries == expected.get(name, counted.step_temporaries)
