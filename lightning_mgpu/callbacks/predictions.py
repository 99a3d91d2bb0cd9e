"""``PredictionCSV``: a run's predictions in one CSV file, every rank's rows merged on rank 0."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import BasePredictionWriter
from typing_extensions import override

from lightning_mgpu._atomic import atomic_write
from lightning_mgpu.callbacks._distributed import all_gather_objects

__all__ = ["PredictionCSV"]


class PredictionCSV(BasePredictionWriter):
    """Writes ``predictions.csv`` (index, name, pred, prob): every rank's predictions, merged on rank 0.

    ``predict_step`` returns a dict with ``pred`` (class indices) and ``prob`` (their probabilities)
    per row. Rows are keyed by their index in the dataset, so the repeats a distributed sampler adds
    to even out the ranks collapse; ``name`` comes from the datamodule's ``predict_names`` when it
    has them.

    Args:
        path: the CSV file to write (replaced whole, never left half-written).
    """

    def __init__(self, path: Path) -> None:
        super().__init__(write_interval="epoch")
        self.path = path

    @override
    def write_on_epoch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, predictions: Any, batch_indices: Any
    ) -> None:
        rows: dict[int, tuple[int, float]] = {}
        indices = batch_indices[0] if batch_indices and isinstance(batch_indices[0], list) else batch_indices
        offset = 0
        for batch_idx, out in enumerate(predictions):
            ids = indices[batch_idx] if indices else list(range(offset, offset + len(out["pred"])))
            offset += len(out["pred"])
            for i, pred, prob in zip(ids, out["pred"].tolist(), out["prob"].tolist(), strict=True):
                rows[int(i)] = (int(pred), float(prob))
        rows = {k: v for part in all_gather_objects(trainer, rows) for k, v in part.items()}
        if not trainer.is_global_zero:
            return
        names = getattr(getattr(trainer, "datamodule", None), "predict_names", [])
        text = io.StringIO(newline="")
        writer = csv.writer(text)
        writer.writerow(["index", "name", "pred", "prob"])
        for i in sorted(rows):
            writer.writerow([i, names[i] if i < len(names) else "", rows[i][0], f"{rows[i][1]:.6f}"])
        with atomic_write(self.path) as file:
            file.write(text.getvalue().encode())
