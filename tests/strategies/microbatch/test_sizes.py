"""The micro-batch size of one rank: fixed, halved on out-of-memory, grown back below what failed."""

from __future__ import annotations

import re

import numpy
import pytest

from lightning_mgpu.strategies.microbatch.mixin import check_micro_batch_size
from lightning_mgpu.strategies.microbatch.sizes import MicroBatchSizes


def test_a_fixed_size_never_changes_and_caps_at_the_batch() -> None:
    sizes = MicroBatchSizes(4, auto=False)
    assert sizes.rows(10) == 4
    assert sizes.rows(3) == 3
    for _ in range(500):
        assert sizes.succeeded() is None
    assert sizes.size == 4


def test_auto_halves_on_out_of_memory_and_gives_up_at_one_row() -> None:
    sizes = MicroBatchSizes(None, auto=True)
    assert sizes.rows(12) == 12  # starts with the whole batch
    assert sizes.out_of_memory(12) == 6
    assert sizes.rows(12) == 6
    assert sizes.out_of_memory(6) == 3
    assert sizes.out_of_memory(3) == 1
    assert sizes.out_of_memory(1) is None
    assert sizes.failed == 1


def test_auto_grows_after_clean_batches_but_never_to_a_size_that_failed() -> None:
    sizes = MicroBatchSizes(None, auto=True, grow_after=3)
    sizes.rows(32)
    sizes.out_of_memory(32)  # -> 16
    sizes.out_of_memory(16)  # -> 8
    # doubling stops below 16; 15 rows would cut 32 as 11, 11 and 10: it grows to what runs
    assert [sizes.succeeded() for _ in range(3)] == [None, None, 11]
    assert sizes.rows(32) == 11
    assert [sizes.succeeded() for _ in range(6)] == [None] * 6  # nothing larger to try
    assert sizes.size == 11


def test_a_size_that_changes_nothing_is_not_a_growth() -> None:
    sizes = MicroBatchSizes(None, auto=True, grow_after=1)
    sizes.rows(8)
    sizes.out_of_memory(8)  # -> 4
    # below 8 rows, batches of 8 can only be cut in two halves of 4: nothing to grow to
    assert [sizes.succeeded() for _ in range(3)] == [None] * 3
    assert sizes.rows(8) == 4


def test_the_rows_that_ran_are_recorded_and_never_tried_again() -> None:
    sizes = MicroBatchSizes(7, auto=True, grow_after=1)
    assert sizes.rows(8) == 4  # at most 7 rows: 8 rows run as 4 and 4
    assert sizes.out_of_memory(sizes.rows(8)) == 2
    assert sizes.failed == 4
    assert sizes.succeeded() == 3  # 3, 3 and 2 rows; 4 failed
    assert sizes.rows(8) == 3
    assert [sizes.succeeded() for _ in range(3)] == [None] * 3
    # what the last batch ran, as the memory summary reports it: whole batches are None
    sizes.ran(8, 3)
    assert sizes.last_rows == 3
    sizes.ran(5, 5)  # a smaller last batch of the epoch leaves it as it was
    assert sizes.last_rows == 3
    sizes.ran(8, 8)
    assert sizes.last_rows is None


def test_auto_without_failure_grows_back_to_the_whole_batch() -> None:
    sizes = MicroBatchSizes(2, auto=True, grow_after=1)
    sizes.rows(8)
    assert [sizes.succeeded() for _ in range(3)] == [4, 8, None]
    assert sizes.size is None  # the whole batch, whatever its size
    assert sizes.rows(20) == 20


def test_an_out_of_memory_resets_the_clean_count() -> None:
    sizes = MicroBatchSizes(None, auto=True, grow_after=2)
    sizes.rows(8)
    sizes.out_of_memory(8)  # -> 4
    assert sizes.succeeded() is None  # one clean batch
    sizes.out_of_memory(4)  # -> 2, and the count starts again
    assert sizes.succeeded() is None
    assert sizes.succeeded() == 3  # below 4, which failed


@pytest.mark.parametrize("bad", [0, -3, 2.5, "half", True, numpy.int64(0)])
def test_a_bad_setting_is_named(bad: object) -> None:
    expected = rf"micro_batch_size must be a positive number .* got {re.escape(repr(bad))}"
    with pytest.raises(ValueError, match=expected):
        check_micro_batch_size(bad)


def test_any_integer_type_is_a_number_of_rows() -> None:
    size = check_micro_batch_size(numpy.int64(4))  # a size computed with numpy
    assert size == 4
    assert type(size) is int


def test_auto_can_start_below_the_whole_batch_and_still_grows_back() -> None:
    sizes = MicroBatchSizes(None, auto=True, grow_after=1)
    sizes.start(3)
    assert sizes.rows(16) == 3
    assert sizes.succeeded() == 6
    fixed = MicroBatchSizes(4, auto=False)
    fixed.start(2)  # a size the user fixed is kept
    assert fixed.rows(16) == 4


def test_the_first_size_is_what_the_estimate_says_fits() -> None:
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from lightning_mgpu import estimate_memory
    from lightning_mgpu.strategies.microbatch.first_size import estimated_start
    from tests.strategies.microbatch._models import Hungry, regression_data

    model = Hungry()
    batch = list(regression_data().tensors)
    x = [t[:16] for t in batch]
    strategy = SingleDeviceStrategy(device="cpu")
    memory = 40 * Hungry.ROW_FLOATS * 4  # room for a few rows' activations, not 16
    start = estimated_start(strategy, model, x, 16, device_memory=memory)
    expected = estimate_memory(model, x, device_memory=memory).largest_per_device_batch()
    assert start == expected
    assert start is not None
    assert 1 <= start < 16
    assert estimated_start(strategy, model, x, 16, device_memory=100 * memory) is None  # all 16 fit
    assert estimated_start(strategy, model, x, 16) is None  # a CPU's memory is not known: the whole batch
