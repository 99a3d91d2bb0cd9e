"""FSDP's own buffers out of memory under ``mgpu_fsdp``: recovered before the collective, or a fast stop.

One launch of two processes (tests/scripts/fsdp_buffers.py), two fits. Rank 0's address space is
limited right before the unit ``wide`` (4.13 MiB of parameters gathered) runs its first forward, with
room for:

- 2 MiB, while the pass holds 16 MiB: FSDP's all-gather buffer does not fit. With
  ``micro_batch_size="auto"`` rank 0 leaves its pass, which frees the 16 MiB, and runs the all-gather
  rank 1 announced and entered with a buffer of its own; rank 1 finishes its pass, and every rank
  runs the batch again in micro-batches of 8 rows (the limit is lifted for the rerun); the weights
  are those of plain training;
- 6 MiB: the buffer fits, but gloo's own copy inside the all-gather does not, while rank 1 is in it:
  every rank stops on rank 0's error, which names the all-gather, instead of after ``stall_timeout``
  (gloo, left alone, aborts both processes on the collectives that no longer match).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mgpu.devices import format_bytes
from tests.helpers import run_file, script_env
from tests.strategies.microbatch._models import LIMITED_MEMORY

WIDE_BYTES = (16 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 16 + 16) * 4


class Reference(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 16)
        self.wide = nn.ModuleDict({"up": nn.Linear(16, 1024), "mid": nn.Linear(1024, 1024)})
        self.wide["down"] = nn.Linear(1024, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.wide
        h = w["down"](torch.tanh(w["mid"](torch.tanh(w["up"](torch.tanh(self.lin(x)))))))
        return self.head(h)


def trained_reference() -> dict[str, torch.Tensor]:
    """Two plain steps on the global batches: rows 0-31, then 32-63 (each rank's 16 of every other row)."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)
    model = Reference()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for start in (0, 32):
        optimizer.zero_grad()
        F.mse_loss(model(x[start : start + 32]), y[start : start + 32]).backward()
        optimizer.step()
    return model.state_dict()


@pytest.fixture(scope="module")
def buffers_run(tmp_path_factory: pytest.TempPathFactory):
    tmp_path = tmp_path_factory.mktemp("buffers")
    result = run_file("fsdp_buffers.py", tmp_path, timeout=240, env=script_env(**LIMITED_MEMORY))
    return tmp_path, result


@pytest.mark.slow
def test_no_room_for_the_all_gather_buffer_reruns_the_batch_smaller_on_every_rank(buffers_run) -> None:
    tmp_path, result = buffers_run
    assert (tmp_path / "recovered.pt").exists(), result.output[-4000:]
    line = f"[rank 0] out of memory allocating {format_bytes(WIDE_BYTES)} for mgpu_fsdp's all-gather of the"
    assert f"{line} parameters of unit 'wide'" in result.output
    assert (
        "[rank 0] out of memory in forward at batch 0 of epoch 0 with micro-batches of 16 rows: running the"
        " batch again in micro-batches of 8 rows"
    ) in result.output
    # both ranks abandoned the 16-row pass and ran both batches in micro-batches of 8 rows
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rows_rank{rank}.json").read_text()) == [16, 8, 8, 8, 8]
    recovered = torch.load(tmp_path / "recovered.pt", weights_only=True)
    expected = trained_reference()
    assert recovered.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(recovered[name], value, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_no_room_inside_the_all_gather_stops_every_rank_naming_it(buffers_run) -> None:
    tmp_path, result = buffers_run
    assert result.returncode != 0, result.output[-4000:]
    error = (
        "failed with CollectiveOutOfMemoryError: [rank 0] out of memory inside mgpu_fsdp's all-gather of the"
        " parameters of unit 'wide', which the other ranks had entered, so the batch cannot run again in"
        " smaller micro-batches"
    )
    told = [row for row in result.output.splitlines() if row.startswith("[rank1]: [rank 1] stopped because")]
    assert told, result.output[-4000:]
    # rank 1 gives rank 0's error, or, when rank 0's exit closed the collective before its report was
    # read, that rank 0 exited; rank 0's own error names the collective either way
    assert any(error in row or "rank 0 (pid" in row for row in told), result.output[-4000:]
    assert "[rank 0] out of memory inside mgpu_fsdp's all-gather of the parameters of unit 'wide'" in (
        result.output
    ), result.output[-4000:]
    assert "Received data size doesn't match" not in result.output  # no collective out of step
    # rank 0's error stopped rank 1, not stall_timeout (300 s)
    assert "stalled: no progress" not in result.output, result.output[-4000:]
