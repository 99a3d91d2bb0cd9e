"""Micro-batching under ``mgpu_fsdp``: two gloo processes, real allocation failures between FSDP's gathers.

One launch runs every fit: ``global_mean`` losses, whole and in fixed micro-batches, against one device,
a real out-of-memory on rank 1 only in forward, in backward (inside a sharded block, where the
other rank would otherwise wait in the next gather for good) and in backward while recomputing an
activation-checkpointed block, in forward and in backward at the second step (whose collectives the
first taught every rank, so that nobody announces them), a validation batch that runs out of memory
inside a block on rank 1 (its logs equal the unsplit validation's), and last a batch that does not fit
even in micro-batches of one row on rank 1, which must end both ranks.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.helpers import run_script, script_env
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

SCRIPT = """
import json, torch, lightning as L
from lightning_mgpu import DeviceMemoryMonitor, MGPUFSDPStrategy
from tests.strategies.microbatch._models import QUIET, HungryBlocks, LoggedTokenModel, LossRecorder
from tests.strategies.microbatch._models import TokenModel, loader, regression_data, token_data

def fit(model, data, batch_size, steps, accumulate=1, callbacks=(), **strategy):
    strategy = MGPUFSDPStrategy(**strategy)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, accumulate_grad_batches=accumulate,
        callbacks=list(callbacks), **QUIET,
    )
    trainer.fit(model, loader(data, batch_size))
    return trainer, strategy

def full(model):
    return {k: v.full_tensor() for k, v in model.state_dict().items()}

results, losses = {}, {}
for kind, micro in (("masked", None), ("masked", 3), ("sum", 3)):  # global_mean; 8 rows per rank
    model, recorder = LoggedTokenModel(kind), LossRecorder()
    trainer, _ = fit(model, token_data(), 8, 2, callbacks=[recorder], micro_batch_size=micro)
    results[f"{kind}_{micro}"] = full(model)
    losses[f"{kind}_{micro}"] = recorder.losses()
with open(f"losses_rank{trainer.global_rank}.json", "w") as f:
    json.dump(losses, f)
for micro in (None, 3):  # two batches of 4 rows per rank accumulated into each step
    model = TokenModel("mean")
    trainer, _ = fit(model, token_data(), 4, 2, accumulate=2, micro_batch_size=micro)
    results[f"accumulated_{micro}"] = full(model)

sizes = {}
# rank 1 fails with its whole batch of 8 rows; "recompute": in backward, recomputing a checkpointed block
for phase, budget, recompute in [("forward", 24, False), ("backward", 32, False), ("recompute", 24, True)]:
    model = HungryBlocks(limit_rank=1, budget=budget)
    # the memory summary of the first: rank 0 ran micro-batches too, as many as rank 1
    monitor = [DeviceMemoryMonitor(every_n_steps=1)] if phase == "forward" else []
    trainer, strategy = fit(
        model, regression_data(), 8, 2, callbacks=monitor, micro_batch_size="auto",
        activation_checkpointing=recompute,
    )
    results[phase] = full(model)
    sizes[phase] = {"final": strategy.micro_batches.size, "seen": model.sizes_seen}
# the same at the second step, whose collectives the first taught: nobody announces them
for phase, budget in [("later_forward", 24), ("later_backward", 32)]:
    model = HungryBlocks(limit_rank=1, budget=budget, limit_from=1)
    model._lift()  # the limit the fit before set on rank 1 stays until a new one is set
    trainer, strategy = fit(model, regression_data(), 8, 2, micro_batch_size="auto")
    results[phase] = full(model)
    sizes[phase] = {"final": strategy.micro_batches.size, "seen": model.sizes_seen}
with open(f"sizes_rank{trainer.global_rank}.json", "w") as f:
    json.dump(sizes, f)
# validation: rank 1 fits 4 rows, not 8 (forward only: 2 row-sizes per row), and fails inside a block
validated = {}
for micro, limit in ((None, None), ("auto", 1)):
    model = HungryBlocks(limit_rank=limit, budget=12, limit_in="eval")
    strategy = MGPUFSDPStrategy(micro_batch_size=micro)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, **QUIET)
    metrics = trainer.validate(model, loader(regression_data(), 8), verbose=False)[0]
    validated[str(micro)] = {"metrics": metrics, "seen": model.eval_sizes_seen}
with open(f"validated_rank{trainer.global_rank}.json", "w") as f:
    json.dump(validated, f)
if trainer.is_global_zero:
    torch.save(results, "fsdp.pt")

# rank 1 cannot hold the activations of one row: both ranks must stop
fit(HungryBlocks(limit_rank=1, budget=32, forward_extra=40), regression_data(), 8, 2, micro_batch_size="auto")
"""


def test_fsdp_micro_batches_and_out_of_memory_between_gathers(tmp_path: Path) -> None:
    env = script_env(**LIMITED_MEMORY)
    result = run_script(SCRIPT, tmp_path, timeout=300, env=env)
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
