"""Evaluation in micro-batches under ``mgpu_ddp``: two gloo processes, real allocation failures in forward.

One launch runs every check. Rank 1's validation runs out of memory with its whole batch (first in
the sanity check, whose first forward broadcasts DDP's buffers); its logs and metric must equal an
unsplit fit's, and its sizes must stay apart from training's. Then ``trainer.predict`` runs out of
memory on rank 1 over 17 rows, which Lightning's predict sampler gives rank 0 in two batches and
rank 1 in one: the predictions come back whole and in order. The run: tests/scripts/micro_batch_evaluation.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import run_file, script_env
from tests.strategies.microbatch._models import LIMITED_MEMORY, Hungry, regression_data

ATOL = 1e-6


@pytest.fixture(scope="module")
def evaluation_run(tmp_path_factory: pytest.TempPathFactory):
    tmp_path = tmp_path_factory.mktemp("evaluation")
    result = run_file("micro_batch_evaluation.py", tmp_path, timeout=300, env=script_env(**LIMITED_MEMORY))
    assert result.returncode == 0, result.output
    return tmp_path, result


def _fits(tmp_path: Path, rank: int) -> dict:
    return json.loads((tmp_path / f"fits_rank{rank}.json").read_text())


def test_a_validation_out_of_memory_on_one_rank_is_run_again_in_halves(evaluation_run) -> None:
    tmp_path, result = evaluation_run
    line = (
        "[rank 1] out of memory in forward at sanity-check validation batch 0 of epoch 0 with micro-batches"
        " of 8 rows: running the batch again in micro-batches of 4 rows (8 rows on this rank; the global"
        " batch is unchanged)"
    )
    assert result.output.count(line) == 1, result.output
    assert "[rank 0] out of memory" not in result.output
    # rank 1 ran the sanity check's first batch again in halves, and its other batches at the size it
    # learned; rank 0 never split; neither rank's training did
    assert _fits(tmp_path, 1)["auto"]["seen"] == {"train": [8, 8], "eval": [8] + [4] * 8}
    assert _fits(tmp_path, 0)["auto"]["seen"] == {"train": [8, 8], "eval": [8] * 4}


def test_logged_values_and_metrics_equal_the_unsplit_validation(evaluation_run) -> None:
    tmp_path, _ = evaluation_run
    for rank in (0, 1):
        fits = _fits(tmp_path, rank)
        whole, auto = fits["whole"]["logged"], fits["auto"]["logged"]
        assert len(whole) == len(auto) == 2  # the sanity check, the end of the epoch
        for run_whole, run_auto in zip(whole, auto, strict=True):
            # the loss logged on step and on epoch with sync_dist=True, the torchmetrics metric
            assert run_whole.keys() == run_auto.keys() == {"val_loss", "val_loss_epoch", "val_mse"}
            assert run_auto == pytest.approx(run_whole, abs=ATOL), rank
    # and they are the validation set's: one mean over both ranks' two batches of 8 rows
    x, y = regression_data(32, seed=3).tensors
    with torch.no_grad():
        mse = torch.nn.functional.mse_loss(Hungry().predictions(x), y).item()
    assert _fits(tmp_path, 0)["whole"]["logged"][0]["val_mse"] == pytest.approx(mse, abs=ATOL)


def test_validation_sizes_are_kept_apart_from_training_sizes(evaluation_run) -> None:
    tmp_path, result = evaluation_run
    assert _fits(tmp_path, 1)["auto"]["sizes"] == {
        "train": None,
        "train_last": None,
        "eval": 4,
        "eval_failed": 8,
        "eval_last": 4,
    }
    assert _fits(tmp_path, 0)["auto"]["sizes"]["eval"] is None
    # the memory monitor's summary shows the training sizes: whole batches on both ranks
    table = result.output[result.output.index("Device memory over the fit (peaks):") :].splitlines()
    rows = {line.split("|")[1].strip(): line.split("|")[-2].strip() for line in table[4:6]}
    assert rows == {"cpu:rank0": "whole batch", "cpu:rank1": "whole batch"}, "\n".join(table[:8])


def test_predictions_come_back_whole_and_in_order(evaluation_run) -> None:
    tmp_path, result = evaluation_run
    x, _ = regression_data(17, seed=4).tensors
    with torch.no_grad():
        expected = Hungry().predictions(x)
    runs = [torch.load(tmp_path / f"predict_rank{rank}.pt") for rank in (0, 1)]
    assert [len(batch) for batch in runs[0]["predictions"]] == [8, 1]
    assert [len(batch) for batch in runs[1]["predictions"]] == [8]
    for rank, run in enumerate(runs):  # Lightning's predict sampler gives rank r the rows r, r + 2, ...
        torch.testing.assert_close(torch.cat(run["predictions"]), expected[rank::2], atol=ATOL, rtol=0)
    assert runs[1]["seen"] == [8, 4, 4]
    assert runs[0]["seen"] == [8, 1]
    assert (
        "[rank 1] out of memory in forward at predict batch 0 with micro-batches of 8 rows" in result.output
    )
    # the predict step's size is its own
    assert (runs[1]["size"], runs[1]["validation"], runs[1]["train"]) == (4, None, None)
