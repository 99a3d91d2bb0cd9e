"""split/: cutting a batch along dim 0, replaying self.log and merging torchmetrics, on their own."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import BinaryAccuracy
from torchmetrics.regression import MeanSquaredError

from lightning_mgpu.strategies.ddp.strategy import MGPUDDPStrategy
from lightning_mgpu.strategies.split.batch import (
    check_cuttable,
    combine_outputs,
    scatter_batch,
    split_rows,
    split_sizes,
)
from lightning_mgpu.strategies.split.logs import LogCapture, replay_logs
from lightning_mgpu.strategies.split.merge_metrics import merge_in_order


def test_split_rows_needs_every_tensor_to_agree_and_names_the_feature() -> None:
    assert split_rows({"x": torch.zeros(6, 2), "scale": torch.tensor(2.0), "ids": [1, 2]}, "mgpu_dp") == 6
    assert split_rows({"ids": [1, 2]}, "mgpu_dp") is None
    with pytest.raises(ValueError, match=r"^micro_batch_size under mgpu_ddp cuts .* differ: \[6, 5\]"):
        split_rows((torch.zeros(6, 2), torch.zeros(5)), "micro_batch_size under mgpu_ddp")


def test_cut_and_combined_again_gives_the_batch() -> None:
    x = torch.arange(14.0).reshape(7, 2)
    sizes = split_sizes(7, 3)
    assert sizes == [3, 2, 2]
    parts = scatter_batch({"x": x, "k": 5}, sizes, [torch.device("cpu")] * 3)
    assert [p["k"] for p in parts] == [5, 5, 5]
    outputs = [{"loss": p["x"].mean(), "y": p["x"] * 2} for p in parts]
    combined = combine_outputs(outputs, sizes, torch.device("cpu"))
    torch.testing.assert_close(combined["y"], x * 2)
    torch.testing.assert_close(combined["loss"], x.mean())  # the parts' means weighted by their rows


def test_replayed_logs_equal_one_call_over_the_whole_batch() -> None:
    logged: dict[str, tuple[torch.Tensor, dict]] = {}

    class Module(L.LightningModule):
        def log(self, name: str, value: object, **options: object) -> None:  # type: ignore[override]
            logged[name] = (value, options)  # type: ignore[assignment]

    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    captures = []
    for part in (values[:3], values[3:]):
        capture = LogCapture()
        capture.log("mean", part.mean())
        capture.log("total", part.sum(), reduce_fx="sum")
        capture.log("weighted", part.mean(), batch_size=len(part) * 10)
        captures.append(capture)
    replay_logs(Module(), captures, [3, 2], torch.device("cpu"), {})
    torch.testing.assert_close(logged["mean"][0], values.mean())
    torch.testing.assert_close(logged["total"][0], values.sum())
    torch.testing.assert_close(logged["weighted"][0], values.mean())
    assert logged["weighted"][1]["batch_size"] == 50


@pytest.mark.parametrize("metric", [BinaryAccuracy, MeanSquaredError])
def test_merged_metrics_equal_one_update_over_the_whole_batch(metric: type) -> None:
    preds, target = torch.tensor([0.9, 0.2, 0.7, 0.4, 0.6]), torch.tensor([1, 0, 0, 0, 1])
    whole, merged = metric(), metric()
    whole.update(preds, target)
    parts = [metric(), metric()]
    parts[0].update(preds[:2], target[:2])
    parts[1].update(preds[2:], target[2:])
    merge_in_order(merged, parts)
    torch.testing.assert_close(merged.compute(), whole.compute())


def test_a_batch_that_cannot_be_cut_names_micro_batching_under_mgpu_ddp() -> None:
    class TwoSizes(BoringModel):
        def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
            x, _ = batch  # type: ignore[misc]
            return self.layer(x).sum()

    data = TensorDataset(torch.randn(8, 32), torch.randn(8, 3))  # dim 0 of the second is not the batch
    loader = DataLoader(
        data, batch_size=4, collate_fn=lambda rows: (torch.stack([r[0] for r in rows]), data[0][1])
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=MGPUDDPStrategy(micro_batch_size=2),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(ValueError, match=r"micro_batch_size under mgpu_ddp cuts every tensor") as caught:
        trainer.fit(TwoSizes(), loader)
    assert "mgpu_dp" not in str(caught.value)
    assert "replica" not in str(caught.value)


def test_per_row_sequences_are_cut_with_their_rows_and_others_named() -> None:
    x = torch.arange(6.0)
    cpu = [torch.device("cpu")] * 2
    batch = {"x": x, "ids": ("a", "b", "c", "d", "e", "f"), "tags": [["t0"] * 6, ["t1"] * 6], "k": "train"}
    first, second = scatter_batch(batch, [4, 2], cpu)
    assert first["ids"] == ("a", "b", "c", "d")
    assert second["ids"] == ("e", "f")
    assert second["tags"] == [["t0", "t0"], ["t1", "t1"]]  # default_collate's transposed list field
    assert (first["k"], second["k"]) == ("train", "train")
    # what the parts return with one item per row comes back whole and in order
    combined = combine_outputs([{"ids": p["ids"]} for p in (first, second)], [4, 2], torch.device("cpu"))
    assert combined["ids"] == batch["ids"]
    with pytest.raises(
        ValueError, match=r"mgpu_dp cuts the batch's 6 rows .* batch\['names'\] is a list of 3"
    ):
        scatter_batch({"x": x, "names": ["cat", "dog", "fish"]}, [3, 3], cpu)
    with pytest.raises(ValueError, match=r"micro .* batch\[1\]\[0\] is a list of 2 items.*`split_batch_rows"):
        check_cuttable((x, [["a", "b"]]), 6, "micro")
