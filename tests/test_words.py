"""Counts in messages take the singular for one: "micro-batches of 1 row", "rank 1 ran out of memory"."""

from __future__ import annotations

import pytest
import torch

from lightning_mgpu._words import aligned, counted, ranks
from lightning_mgpu.strategies.microbatch.sizes import MicroBatchSizes
from lightning_mgpu.strategies.split.batch import check_cuttable


def test_one_takes_the_singular_and_every_other_count_the_plural() -> None:
    assert [counted(n, "row") for n in (0, 1, 2)] == ["0 rows", "1 row", "2 rows"]
    assert counted(1, "process", "processes") == "1 process"
    assert counted(3, "process", "processes") == "3 processes"
    assert (ranks([1]), ranks([1, 3]), ranks([])) == ("rank 1", "ranks 1, 3", "ranks ")


def test_messages_of_one_row_or_one_item_say_so(caplog: pytest.LogCaptureFixture) -> None:
    check_cuttable((torch.zeros(1, 2), ["b", "c"]), 1, "micro_batch_size")  # one row is never cut
    with pytest.raises(ValueError, match=r"2 rows into parts, but batch\[1\] is a list of 1 item,"):
        check_cuttable((torch.zeros(2, 2), ["a"]), 2, "micro_batch_size")
    sizes = MicroBatchSizes(None, auto=True)
    with caplog.at_level("DEBUG", logger="lightning_mgpu.strategies.microbatch.sizes"):
        sizes.start(1)
    assert "first micro-batch size: 1 row" in caplog.text
    assert "1 rows" not in caplog.text


def test_table_columns_take_their_widest_cell_numbers_right_aligned() -> None:
    rows = [["strategy", "peak"], ["mgpu_fsdp", "1.00 KiB"], ["single", "12 B"]]
    assert aligned(rows, sep=" | ", right_from=1) == [
        "strategy  |     peak",
        "mgpu_fsdp | 1.00 KiB",
        "single    |     12 B",
    ]
    # a column at least as wide as asked, so a table keeps its layout whatever its cells hold
    assert aligned([["a", "b"]], widths=(3, 4)) == ["a   b   "]
