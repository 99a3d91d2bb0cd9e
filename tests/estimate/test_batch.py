"""batch_rows: Lightning's reading of a batch's size, without its advice about self.log."""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch.utilities.data import extract_batch_size

from lightning_mgpu.estimate.batch import batch_rows, resized


def test_rows_of_nested_batches() -> None:
    assert batch_rows((torch.zeros(16, 3), torch.zeros(16))) == 16
    assert batch_rows({"image": torch.zeros(5, 3, 8, 8), "meta": {"ids": torch.arange(5)}}) == 5
    assert batch_rows([{"ids": [1, 2]}]) is None  # no tensor at all


def test_ambiguous_batch_is_read_quietly_and_lightning_still_warns() -> None:
    batch = (torch.zeros(6, 3), ["a.png", "b.png"])  # file names beside the tensor
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert batch_rows(batch) == 6
    with pytest.warns(UserWarning, match="ambiguous collection"):  # Lightning's own, for self.log
        extract_batch_size(batch)


def test_resized_changes_only_the_batch_dimension() -> None:
    batch = (torch.arange(4.0).reshape(4, 1), torch.tensor(2.0), torch.zeros(3))
    x, scale, other = resized(batch, 4, 6)
    assert x.flatten().tolist() == [0, 1, 2, 3, 0, 1]
    assert scale.item() == 2.0
    assert other.shape == (3,)
    assert resized(batch, 4, 2)[0].flatten().tolist() == [0, 1]
