"""What the small recipes promise: linear finds the true weights, seq_linear shows the batch being split."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import pytest

from lightning_mgpu.cli.main import main

ONE_CPU = ["trainer.accelerator=cpu", "trainer.enable_progress_bar=false"]


def test_linear_gets_close_to_the_true_weights(tmp_path: Path) -> None:
    args = ["run", "linear", *ONE_CPU, "trainer.devices=1", "trainer.max_epochs=3", f"run_dir={tmp_path}"]
    assert main(args) == 0
    with (tmp_path / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    distances = [float(r["val/weight_distance"]) for r in rows if r.get("val/weight_distance")]
    assert len(distances) == 3
    assert distances[-1] < distances[0] / 10
    assert distances[-1] < 0.02  # the true weights are drawn from N(0, 1): about 3 away from the start


@pytest.mark.parametrize(
    ("strategy", "shapes"),
    [("single", ["[16, 10, 5]"]), ("mgpu_dp", ["[8, 10, 5]", "[8, 10, 5]"])],
)
def test_seq_linear_shows_what_each_forward_sees(
    strategy: str, shapes: list[str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    devices = "1" if strategy == "single" else "2"
    args = ["run", "seq_linear", *ONE_CPU, f"trainer.devices={devices}", "trainer.fast_dev_run=true"]
    if strategy != "single":
        args.append(f"trainer.strategy={strategy}")
    with caplog.at_level(logging.INFO):
        assert main([*args, f"run_dir={tmp_path}"]) == 0
    seen = [r.getMessage() for r in caplog.records if r.getMessage().startswith("seq_linear: forward sees")]
    assert [m.split("shape ")[1].split(" on")[0] for m in seen] == shapes
