"""Micro-batching under ``mgpu_fsdp``: two gloo processes, real allocation failures between FSDP's gathers.

One launch runs every fit: ``global_mean`` losses, whole and in fixed micro-batches, against one device,
a real out-of-memory on rank 1 only in forward, in backward (inside a sharded block, where the
other rank would otherwise wait in the next gather for good) and in backward while recomputing an
activation-checkpointed block, in forward and in backward at the second step (whose collectives the
first taught every rank, so that nobody announces them), a validation batch that runs out of memory
inside a block on rank 1 (its logs equal the unsplit validation's), and last a batch that does not fit
even in micro-batches of one row on rank 1, which must end both ranks (tests/scripts/micro_batch_fsdp.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.helpers import run_file, script_env
from tests.strategies.microbatch._models import (
    LIMITED_MEMORY,
    QUIET,
    HungryBlocks,
    TokenModel,
    assert_both_ranks_stopped,
    loader,
    max_difference,
    reference,
    regression_data,
    token_data,
)

ATOL = 1e-6


def test_fsdp_micro_batches_and_out_of_memory_between_gathers(tmp_path: Path) -> None:
    env = script_env(**LIMITED_MEMORY)
    result = run_file("micro_batch_fsdp.py", tmp_path, timeout=300, env=env)
    final = torch.load(tmp_path / "fsdp.pt")

    # two ranks of 8 rows, whole or in micro-batches of at most 3 = one device with batches of 16
    for kind, micro in (("masked", None), ("masked", 3), ("sum", 3)):
        expected = reference(token_data(), kind, 16, 2).state_dict()
        assert max_difference(final[f"{kind}_{micro}"], expected) < ATOL, (kind, micro)

    # the loss logged with sync_dist=True and the one returned are those of whole batches
    for rank in (0, 1):
        losses = json.loads((tmp_path / f"losses_rank{rank}.json").read_text())
        for what in ("logged", "returned"):
            expected = losses["masked_None"][what]
            assert losses["masked_3"][what] == pytest.approx(expected, abs=ATOL), (rank, what)

    # with accumulate_grad_batches the sharded gradients of earlier batches are kept aside, then added
    assert max_difference(final["accumulated_3"], final["accumulated_None"]) < ATOL
    assert max_difference(final["accumulated_3"], TokenModel("mean").state_dict()) > 1e-4
    single = HungryBlocks()
    L.Trainer(accelerator="cpu", devices=1, max_steps=2, **QUIET).fit(single, loader(regression_data(), 16))
    sizes = [json.loads((tmp_path / f"sizes_rank{r}.json").read_text()) for r in (0, 1)]
    # one line per out-of-memory, from rank 1 only: the three recovered fits, then the one that never fits
    lines = re.findall(
        r"\[rank \d\] out of memory in \w+ at batch 0 .*? of (\d+) rows?: .*? of (\d+) rows? \(",
        result.output,
    )
    assert re.findall(r"\[rank (\d)\] out of memory in (\w+) at batch 0", result.output) == [
        ("1", "forward"),
        ("1", "backward"),
        ("1", "backward"),
        ("1", "forward"),
        ("1", "forward"),
        ("1", "forward"),
    ], result.output
    assert lines == [("8", "4"), ("8", "4"), ("8", "4"), ("8", "4"), ("4", "2"), ("2", "1")]
    assert "(8 rows on this rank; the global batch is unchanged)" in result.output
    for phase in ("forward", "backward", "recompute"):
        assert max_difference(final[phase], single.state_dict()) < ATOL, phase
        # every rank runs the batch again in as many micro-batches as the rank that failed (FSDP gathers)
        assert sizes[0][phase] == {"final": None, "seen": [8, 4, 4, 4, 4]}
        assert sizes[1][phase] == {"final": 4, "seen": [8, 4, 4, 4, 4]}
    for phase in ("later_forward", "later_backward"):  # rank 1 runs out of memory at the second step
        assert max_difference(final[phase], single.state_dict()) < ATOL, phase
        assert sizes[0][phase] == {"final": None, "seen": [8, 8, 4, 4]}
        assert sizes[1][phase] == {"final": 4, "seen": [8, 8, 4, 4]}
    later = re.findall(r"\[rank (\d)\] out of memory in (\w+) at batch 1 of epoch 0", result.output)
    assert later == [("1", "forward"), ("1", "backward")], result.output[-4000:]
    assert max_difference(final["forward"], HungryBlocks().state_dict()) > 1e-4  # training moved the weights
    # the memory summary says what each rank ran: micro-batches of 4 rows on both
    table = result.output[result.output.index("Device memory over the fit (peaks):") :].splitlines()
    rows = {line.split("|")[1].strip(): line.split("|")[-2].strip() for line in table[4:6]}
    assert rows == {"cpu:rank0": "4 rows", "cpu:rank1": "4 rows"}, "\n".join(table[:8])
    memory = json.loads((tmp_path / "memory_summary.json").read_text())["devices"]
    assert [(d["device"], d["micro_batch_size"]) for d in memory] == [("cpu:rank0", 4), ("cpu:rank1", 4)]

    # a validation batch that ran out of memory on rank 1: every rank runs it again in halves (FSDP
    # gathers), and the logged loss and metric are those of the unsplit validation
    for rank in (0, 1):
        validated = json.loads((tmp_path / f"validated_rank{rank}.json").read_text())
        assert validated["None"]["seen"] == [8, 8]
        assert validated["auto"]["seen"] == [8, 4, 4, 4, 4]
        assert validated["auto"]["metrics"].keys() == {"val_loss_epoch", "val_mse"}
        assert validated["auto"]["metrics"] == pytest.approx(validated["None"]["metrics"], abs=ATOL)
    assert (
        "[rank 1] out of memory in forward at validation batch 0 with micro-batches of 8 rows"
        in result.output
    )

    assert_both_ranks_stopped(result)
