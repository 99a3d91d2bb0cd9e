"""``global_mean``: sum and masked-token losses give the single-device step however the batch is split."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import run_file
from tests.strategies.microbatch._models import (
    QUIET,
    TokenModel,
    loader,
    max_difference,
    reference,
    token_data,
)

ATOL = 1e-6


def fit(model: TokenModel, strategy: object, devices: int, batch_size: int, steps: int) -> None:
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, **QUIET)
    trainer.fit(model, loader(token_data(), batch_size))


@pytest.mark.parametrize("devices", [2, 3])  # 3: chunks of 3, 3 and 2 rows
@pytest.mark.parametrize("kind", ["masked", "sum"])
def test_dp_replicas_match_one_device(kind: str, devices: int) -> None:
    model = TokenModel(kind)
    fit(model, "mgpu_dp", devices, 8, 3)
    assert max_difference(model.state_dict(), reference(token_data(), kind, 8, 3).state_dict()) < ATOL


def test_dp_without_the_helper_differs_and_a_replica_that_skips_it_is_named() -> None:
    naive = TokenModel("naive")
    fit(naive, "mgpu_dp", 2, 8, 3)  # err.sum() / mask.sum() per replica: not the single-device step
    assert max_difference(naive.state_dict(), reference(token_data(), "masked", 8, 3).state_dict()) > 1e-4

    class Skipping(TokenModel):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, mask = batch
            if len(x) == 3:  # the second replica's chunk of a batch of 7 rows
                return ((self.net(x) - y) ** 2).mean()
            return super().training_step(batch, batch_idx)

    with pytest.raises(RuntimeError) as caught:
        fit(Skipping("masked"), "mgpu_dp", 2, 7, 1)
    # which replica thread gets there first is up to the scheduler: either way the error names the
    # call and the replica that skipped it
    text = f"{caught.value} {caught.value.__cause__}"
    assert (
        "replica 1 returned from training_step while replica(s) wait in {0: 'global_mean'}" in text
        or "replica 0 calls `global_mean` but replica(s) [1] already returned from training_step" in text
    ), text


def test_ddp_ranks_match_one_device(tmp_path: Path) -> None:
    result = run_file("global_mean_ddp.py", tmp_path, timeout=240)
    assert result.returncode == 0, result.output
    final = torch.load(tmp_path / "ddp.pt")
    # two ranks of 8 rows = one device with batches of 16
    for kind in ("masked", "sum"):
        assert max_difference(final[kind], reference(token_data(), kind, 16, 2).state_dict()) < ATOL, kind
    # the same masked loss written as err.sum() / mask.sum() per rank is not the single-device step
    assert max_difference(final["naive"], reference(token_data(), "masked", 16, 2).state_dict()) > 1e-4
