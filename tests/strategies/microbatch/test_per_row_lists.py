"""A per-row list in the batch (``default_collate``'s list of string ids) goes with its rows into every part.

Under ``micro_batch_size`` (fixed, and under ``"auto"`` after a real out-of-memory), on ``mgpu_ddp``'s
ranks and over ``mgpu_dp``'s replicas each part's ids are its rows' ids; predictions bring them back whole
and in order. A list that is not one item per row is refused at the first batch, before any
out-of-memory, naming the entry and the ``split_batch_rows`` hook, which then cuts the batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_mgpu.strategies.dp.strategy import MGPUDataParallelStrategy
from tests.helpers import run_file, script_env
from tests.strategies.microbatch._models import LIMITED_MEMORY, QUIET


class WithIds(Dataset):
    """Row ``i``: ``x`` whose first value is ``i``, a target, and the id ``"row<i>"``."""

    def __init__(self, rows: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(rows, 4, generator=g)
        self.x[:, 0] = torch.arange(rows, dtype=torch.float32)
        self.y = torch.randn(rows, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, str]:
        return self.x[i], self.y[i], f"row{i}"


class IdModel(L.LightningModule):
    """Records, for every part a step runs on, its ids and the rows they came with."""

    def __init__(self, parts: list[tuple[list[str], list[int]]]) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.parts = parts  # shared with mgpu_dp's replicas, which are copies of the module

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, ids = batch
        self.parts.append((list(ids), [int(v) for v in x[:, 0].tolist()]))
        return F.mse_loss(self.layer(x), y)

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, _, ids = batch
        return {"ids": ids, "rows": x[:, 0]}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(devices: int, micro_batch_size: int | str | None) -> L.Trainer:
    strategy = MGPUDataParallelStrategy(micro_batch_size=micro_batch_size)
    return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=2, **QUIET)


def assert_ids_match_rows(parts: list[tuple[list[str], list[int]]], rows_per_part: int) -> None:
    assert parts, "no step ran"
    for ids, rows in parts:
        assert ids == [f"row{r}" for r in rows]
        assert len(rows) == rows_per_part


@pytest.mark.parametrize("devices", [1, 2])
def test_each_micro_batch_gets_its_own_rows_ids(devices: int) -> None:
    parts: list[tuple[list[str], list[int]]] = []
    trainer(devices, 4).fit(IdModel(parts), DataLoader(WithIds(), batch_size=8))
    # micro-batches of 4 rows, each spread over the replicas: 2 rows per replica on 2 devices
    assert_ids_match_rows(parts, 4 // devices)
    assert len(parts) == 2 * 2 * devices
    assert sorted(i for ids, _ in parts for i in ids) == sorted(f"row{r}" for r in range(16))


def test_predicted_ids_come_back_whole_and_in_order() -> None:
    run = trainer(2, 3)
    out = run.predict(IdModel([]), DataLoader(WithIds(), batch_size=8))
    assert out is not None
    for batch, pred in enumerate(out):
        expected = list(range(batch * 8, batch * 8 + 8))
        assert list(pred["ids"]) == [f"row{r}" for r in expected]  # type: ignore[index]
        assert pred["rows"].tolist() == expected  # type: ignore[index]


def with_names(rows: list[tuple[torch.Tensor, torch.Tensor, str]]) -> tuple[Any, ...]:
    """A collate that adds the dataset's three class names: a list that is not one item per row."""
    x = torch.stack([r[0] for r in rows])
    y = torch.stack([r[1] for r in rows])
    return x, y, ["cat", "dog", "fish"]


class Names(IdModel):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, names = batch
        self.parts.append((list(names), [int(v) for v in x[:, 0].tolist()]))
        return F.mse_loss(self.layer(x), y)


@pytest.mark.parametrize(("devices", "micro_batch_size"), [(1, "auto"), (1, 4), (2, None)])
def test_a_list_that_is_not_one_item_per_row_is_refused_at_the_first_batch(
    devices: int, micro_batch_size: int | str | None
) -> None:
    parts: list[tuple[list[str], list[int]]] = []
    loader = DataLoader(WithIds(), batch_size=8, collate_fn=with_names)
    # "auto" runs its first batch whole: refused all the same, before a step and before any out-of-memory
    with pytest.raises(ValueError, match=r"batch\[2\] is a list of 3 items, not one per row") as err:
        trainer(devices, micro_batch_size).fit(Names(parts), loader)
    assert "the batch's 8 rows" in str(err.value)
    assert "`split_batch_rows(self, batch, sizes)` on the LightningModule" in str(err.value)
    assert parts == []


class NamesCut(Names):
    def split_batch_rows(self, batch: Any, sizes: list[int]) -> list[Any]:
        x, y, names = batch
        return [(xs, ys, names) for xs, ys in zip(x.split(sizes), y.split(sizes), strict=True)]


@pytest.mark.parametrize(("devices", "micro_batch_size"), [(1, 4), (2, None)])
def test_the_module_s_split_batch_rows_cuts_what_the_rules_cannot(
    devices: int, micro_batch_size: int | None
) -> None:
    parts: list[tuple[list[str], list[int]]] = []
    loader = DataLoader(WithIds(), batch_size=8, collate_fn=with_names)
    trainer(devices, micro_batch_size).fit(NamesCut(parts), loader)
    assert parts
    assert all(names == ["cat", "dog", "fish"] and len(rows) == 4 for names, rows in parts)


def test_after_a_real_out_of_memory_the_halves_get_their_own_rows_ids(tmp_path: Path) -> None:
    result = run_file("per_row_ids_oom.py", tmp_path, timeout=240, env=script_env(**LIMITED_MEMORY))
    assert result.returncode == 0, result.output
    assert "out of memory in backward at batch 0 of epoch 0 with micro-batches of 8 rows" in result.output
    seen = __import__("json").loads((tmp_path / "seen.json").read_text())
    assert seen["sizes"] == [8, 4, 4, 4, 4]  # the first attempt whole, then halves
    # the whole batch's attempt holds all 8 ids; every half after it holds its own 4
    assert_ids_match_rows([tuple(p) for p in seen["parts"][1:]], 4)  # type: ignore[misc]
    assert_ids_match_rows([tuple(seen["parts"][0])], 8)  # type: ignore[list-item]


def test_under_mgpu_ddp_each_rank_s_micro_batches_get_their_own_rows_ids(tmp_path: Path) -> None:
    result = run_file("per_row_ids_ddp.py", tmp_path, timeout=240)
    assert result.returncode == 0, result.output
    for rank in (0, 1):
        parts = __import__("json").loads((tmp_path / f"parts_rank{rank}.json").read_text())
        assert len(parts) == 2 * 2  # two batches of 4 rows, each in micro-batches of 2
        assert_ids_match_rows([tuple(p) for p in parts], 2)  # type: ignore[misc]
