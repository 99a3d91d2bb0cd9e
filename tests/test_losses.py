"""losses.py: ``global_mean`` on one device, where it is the plain total over the count."""

from __future__ import annotations

import pytest
import torch

import lightning_mgpu
from tests.strategies.microbatch._models import TokenModel, max_difference, reference, token_data
from tests.strategies.microbatch.test_global_mean import ATOL, fit


@pytest.mark.parametrize("kind", ["masked", "sum"])
def test_one_device_is_total_over_count(kind: str) -> None:
    model = TokenModel(kind)
    fit(model, "auto", 1, 8, 3)
    assert max_difference(model.state_dict(), reference(token_data(), kind, 8, 3).state_dict()) < ATOL


def test_count_must_be_a_scalar() -> None:
    with pytest.raises(ValueError, match=r"`count` must be a number or a 0-dim tensor .* shape \(3,\)"):
        lightning_mgpu.global_mean(torch.ones(()), torch.ones(3))
