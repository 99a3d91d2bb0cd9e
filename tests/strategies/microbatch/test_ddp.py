"""Micro-batching and ``global_mean`` under ``mgpu_ddp``: two gloo processes, real allocation failures.

One launch runs every fit: ``global_mean`` losses and fixed micro-batches against one device, a
real out-of-memory in backward on rank 1 only (the case that deadlocks plain DDP; the memory
monitor's end-of-fit table then shows each rank's final size), and last a batch that does not
fit even in micro-batches of one row on rank 1, which must end both ranks: tests/scripts/micro_batch_ddp.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.helpers import run_file, script_env
from tests.strategies.microbatch._models import (
    LIMITED_MEMORY,
    QUIET,
    Hungry,
    assert_both_ranks_stopped,
    loader,
    max_difference,
    net,
    reference,
    regression_data,
    token_data,
)

ATOL = 1e-6


def test_ddp_global_mean_micro_batches_and_out_of_memory(tmp_path: Path) -> None:
    env = script_env(**LIMITED_MEMORY)
    result = run_file("micro_batch_ddp.py", tmp_path, timeout=300, env=env)
    final = torch.load(tmp_path / "ddp.pt")

    # two ranks of 8 rows = one device with batches of 16
    for kind in ("masked", "sum"):
        assert max_difference(final[kind], reference(token_data(), kind, 16, 2).state_dict()) < ATOL, kind
    # the masked loss written as err.sum() / mask.sum() per rank is not the single-device step
    assert max_difference(final["naive"], reference(token_data(), "masked", 16, 2).state_dict()) > 1e-4
    for kind in ("masked", "mean"):
        expected = reference(token_data(), kind, 16, 2).state_dict()
        assert max_difference(final["micro_" + kind], expected) < ATOL, kind
    # the loss logged with sync_dist=True is the token mean of the global batch, in micro-batches too;
    # each rank returns its share of it (the progress bar's value), as without micro-batches
    x, y, mask = token_data().tensors
    first = ((net()(x[:16]) - y[:16]) ** 2 * mask[:16]).sum() / mask[:16].sum()
    for rank in (0, 1):
        losses = json.loads((tmp_path / f"losses_rank{rank}.json").read_text())
        assert losses["masked"]["logged"][0] == pytest.approx(first.item(), abs=ATOL)
        for what in ("logged", "returned"):
            expected = losses["masked"][what]
            assert losses["micro_masked"][what] == pytest.approx(expected, abs=ATOL), (rank, what)

    big, small, strided = final["averaged"]
    assert torch.equal(big, torch.full((300_000,), 1.5))
    assert torch.equal(small, torch.full((3,), 15.0))
    assert torch.equal(strided, torch.arange(6.0).reshape(2, 3).t() * 1.5)

    # the out-of-memory in rank 1's backward: one line, the batch run again in halves, nothing hung
    line = (
        "[rank 1] out of memory in backward at batch 0 of epoch 0 with micro-batches of 8 rows: running"
        " the batch again in micro-batches of 4 rows (8 rows on this rank; the global batch is unchanged)"
    )
    assert result.output.count(line) == 1, result.output
    assert "[rank 0] out of memory" not in result.output
    sizes = [json.loads((tmp_path / f"sizes_rank{r}.json").read_text()) for r in (0, 1)]
    assert sizes[0] == {"final": None, "seen": [8, 8]}  # rank 0 never split
    assert sizes[1] == {"final": 4, "seen": [8, 4, 4, 4, 4]}  # ranks settle on different sizes
    # the memory monitor's end-of-fit table and JSON give each rank's final size, on its one device
    table = result.output[result.output.index("Device memory over the fit (peaks):") :].splitlines()
    assert table[2].split("|")[-2].strip() == "Micro-batch (rank)"
    rows = {line.split("|")[1].strip(): line.split("|")[-2].strip() for line in table[4:6]}
    assert rows == {"cpu:rank0": "whole batch", "cpu:rank1": "4 rows"}
    memory = json.loads((tmp_path / "memory_summary.json").read_text())["devices"]
    assert [(d["device"], d["micro_batch_size"]) for d in memory] == [("cpu:rank0", None), ("cpu:rank1", 4)]
    single = Hungry()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, **QUIET)
    trainer.fit(single, loader(regression_data(), 16))
    assert max_difference(final["oom"], single.state_dict()) < ATOL
    assert max_difference(final["oom"], Hungry().state_dict()) > 1e-4  # training moved the weights

    # a batch that never fits: both ranks stop with the guidance, rank 1 listing its attempts
    assert_both_ranks_stopped(result)
