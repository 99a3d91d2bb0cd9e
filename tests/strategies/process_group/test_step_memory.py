"""An optimizer step that runs out of memory: the numbers and the options, on every rank within seconds.

The message is plain data in, text out (``step_oom_message``); one real run of two ``mgpu_ddp``
processes shows it: rank 0's address space is limited before AdamW allocates its state in the first
step, so the step fails in the allocator as it would on a full GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_mgpu.devices import format_bytes
from lightning_mgpu.strategies.process_group.step_memory import StepMemory, step_memory, step_oom_message
from tests.helpers import run_file, script_env
from tests.strategies.microbatch._models import LIMITED_MEMORY

MiB = 1024**2


def test_under_mgpu_ddp_the_message_gives_the_state_and_sharding_first() -> None:
    memory = StepMemory(0, "mgpu_ddp", 2, "AdamW", 4 * MiB, 4 * MiB, 8 * MiB, 0, "cpu")
    assert step_oom_message(memory) == "\n".join(
        [
            "[rank 0] out of memory in the optimizer step (AdamW allocating its state in its first step:"
            " 8.00 MiB of optimizer state, beside 4.00 MiB of parameters and 4.00 MiB of gradients on this"
            " rank, mgpu_ddp over 2 process(es))",
            "What would fit:",
            "- strategy='mgpu_fsdp' (or mgpu_auto, which picks it from the numbers): over 2 processes each"
            " holds about 8.00 MiB of parameters, gradients and optimizer state instead of 20.00 MiB with"
            " DDP's gradient buckets;",
            "- precision='bf16-true': parameters, gradients and optimizer state in 2 bytes, about 10.00 MiB"
            " here ('bf16-mixed' keeps them in float32);",
            "- an optimizer with less state: AdamW keeps 8.00 MiB here; SGD with momentum keeps one copy of"
            " the parameters (4.00 MiB), plain SGD none;",
        ]
    )


def test_under_mgpu_fsdp_on_a_gpu_more_devices_offloading_and_what_else_holds_the_memory() -> None:
    memory = StepMemory(
        1, "mgpu_fsdp", 4, "AdamW", MiB, MiB, 2 * MiB, 2 * MiB, "cuda:1", 80 * 1024 * MiB, half=True
    )
    message = step_oom_message(memory)
    assert message.splitlines()[0] == (
        "[rank 1] out of memory in the optimizer step (AdamW: 2.00 MiB of optimizer state for this rank's"
        " shards, beside 1.00 MiB of parameters and 1.00 MiB of gradients on this rank, mgpu_fsdp over 4"
        " process(es) on a device of 80.00 GiB)"
    )
    assert "- more devices: over 8 processes each holds about 2.00 MiB instead of 4.00 MiB;" in message
    assert "MGPUFSDPStrategy(cpu_offload=True)" in message
    assert "bf16-true" not in message  # 2-byte parameters already
    assert "by the count they fit the 80.00 GiB of cuda:1: the rest is held by" in message


def test_the_numbers_are_read_from_the_run_without_allocating_the_state() -> None:
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    memory = step_memory("mgpu_ddp", 0, 2, model, optimizer, torch.device("cpu"))
    params = (256 * 256 + 256 + 256 + 1) * 4
    assert (memory.parameters, memory.gradients, memory.state, memory.held) == (params, params, 2 * params, 0)
    assert not optimizer.state  # counted on meta tensors


@pytest.mark.slow
def test_a_step_that_runs_out_stops_every_rank_with_the_numbers(tmp_path: Path) -> None:
    result = run_file("step_out_of_memory.py", tmp_path, timeout=240, env=script_env(**LIMITED_MEMORY))
    assert result.returncode != 0, result.output[-3000:]
    weights = (1024 * 1024 + 1024 + 1024 + 1) * 4
    line = (
        f"[rank 0] out of memory in the optimizer step (AdamW allocating its state in its first step:"
        f" {format_bytes(2 * weights)} of optimizer state, beside {format_bytes(weights)} of parameters and"
        f" {format_bytes(weights)} of gradients on this rank, mgpu_ddp over 2 process(es))"
    )
    assert line in result.output, result.output[-4000:]
    assert "- strategy='mgpu_fsdp' (or mgpu_auto, which picks it from the numbers): over 2 processes" in (
        result.output
    )
    # rank 1 names rank 0's failure, numbers included, instead of waiting for stall_timeout (300 s)
    told = [row for row in result.output.splitlines() if row.startswith("[rank1]: [rank 1] ")]
    assert any("rank 0 (pid" in row and f"failed with RuntimeError: {line}" in row for row in told), told
    assert "stalled: no progress" not in result.output, result.output[-4000:]
