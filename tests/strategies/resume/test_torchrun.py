"""A torchrun job whose rank is SIGKILLed anywhere finishes as if it had never been cut.

``torchrun --standalone --nproc-per-node=2 --max-restarts=1`` runs ``scripts.SCRIPT``; the first
attempt loses a rank, torchrun starts both again, and the strategy resumes by itself from the
newest complete checkpoint: the job exits 0 with the uncut run's final weights, and every sample
went exactly once per epoch through a step those weights include.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import Result, run_command, script_env
from tests.strategies.resume.scripts import SCRIPT


def _torchrun(
    folder: Path, strategy: str, fault: str, restarts: int = 1, processes: int = 2, **shape: str
) -> tuple[Result, dict[str, Any]]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fit.py").write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
    cmd += [f"--max-restarts={restarts}", "fit.py", strategy, fault, "out.pt"]
    env = script_env(FIT_DEVICES=str(processes), **{f"FIT_{k.upper()}": v for k, v in shape.items()})
    result = run_command(cmd, cwd=folder, env=env, timeout=240)
    assert result.returncode == 0, result.output[-6000:]
    return result, torch.load(folder / "out.pt", weights_only=True)


@pytest.fixture(scope="module")
def uncut(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The uncut runs, one per strategy (about 15 s each)."""
    root = tmp_path_factory.mktemp("uncut")
    return {name: _torchrun(root / name, name, "none", restarts=0)[1] for name in ("mgpu_ddp", "mgpu_fsdp")}


def _assert_as_uncut(out: dict[str, Any], reference: dict[str, Any]) -> None:
    assert out["step"] == reference["step"] == 12
    assert out["visits"] == {epoch: [1] * 16 for epoch in range(3)}
    assert reference["visits"] == out["visits"]
    for name, tensor in reference["weights"].items():
        torch.testing.assert_close(out["weights"][name], tensor, rtol=0, atol=1e-6, msg=name)


def test_a_rank_killed_mid_epoch(tmp_path: Path, uncut: dict[str, dict[str, Any]]) -> None:
    """About 30 s: two attempts, with DeviceTimeMonitor on: the kill and the restart lose nothing else."""
    result, out = _torchrun(tmp_path, "mgpu_ddp", "step", monitor="1")
    _assert_as_uncut(out, uncut["mgpu_ddp"])
    line = f"mgpu_ddp: attempt 2 of this job (restarted by torchrun): resuming from {tmp_path}/ckpts/"
    assert f"{line}epoch=0-step=3.ckpt, saved at global step 3 (epoch 0)" in result.output
    # the monitor of the attempt that finished: both ranks, the 9 steps it trained after step 3
    assert result.output.count("Time per rank over the fit:") == 1
    summary = json.loads((tmp_path / "time_summary.json").read_text())
    assert [(row["rank"], row["steps"]) for row in summary["ranks"]] == [(0, 9), (1, 9)]


def test_a_rank_killed_while_writing_a_checkpoint(tmp_path: Path, uncut: dict[str, dict[str, Any]]) -> None:
    """About 30 s: the half-written step-6 checkpoint is skipped with a line, step 3 resumed from."""
    result, out = _torchrun(tmp_path, "mgpu_ddp", "save")
    _assert_as_uncut(out, uncut["mgpu_ddp"])
    skipped = f"mgpu_ddp: not resuming from {tmp_path}/ckpts/epoch=1-step=6.ckpt: its zip directory"
    assert skipped in result.output
    assert "cut while being written" in result.output
    assert f"resuming from {tmp_path}/ckpts/epoch=0-step=3.ckpt, saved at global step 3" in result.output
    _assert_cut_one_moved_aside(tmp_path / "ckpts", result.output)


def test_a_rank_killed_while_writing_a_sharded_checkpoint(
    tmp_path: Path, uncut: dict[str, dict[str, Any]]
) -> None:
    """About 40 s: under mgpu_fsdp, the step-6 folder without its index is skipped."""
    result, out = _torchrun(tmp_path, "mgpu_fsdp", "save")
    _assert_as_uncut(out, uncut["mgpu_fsdp"])
    skipped = f"mgpu_fsdp: not resuming from {tmp_path}/ckpts/epoch=1-step=6.ckpt: it has no .metadata"
    assert skipped in result.output
    assert f"resuming from {tmp_path}/ckpts/epoch=0-step=3.ckpt, saved at global step 3" in result.output
    _assert_cut_one_moved_aside(tmp_path / "ckpts", result.output)


def _assert_cut_one_moved_aside(folder: Path, output: str) -> None:
    """The cut step-6 checkpoint is renamed, so the step-6 save of the attempt that resumed took its name
    (not ``-v1``) and was replaced by later ones: no cut file is left under a checkpoint's name."""
    assert f"moved aside to {folder}/epoch=1-step=6.ckpt.incomplete" in output
    assert (folder / "epoch=1-step=6.ckpt.incomplete").exists()
    names = sorted(p.name for p in folder.glob("*.ckpt"))
    assert "epoch=1-step=6.ckpt" not in names
    assert not [name for name in names if "-v" in name]
    assert names[-1] == "epoch=2-step=12.ckpt"


@pytest.mark.parametrize(
    ("workers", "every", "checkpoint"),
    [("2", "3", "epoch=0-step=3.ckpt"), ("2p", "4", "epoch=0-step=4.ckpt")],
    ids=["mid-epoch-workers", "epoch-end-persistent-workers"],
)
def test_a_rank_killed_with_loader_workers(
    tmp_path: Path, uncut: dict[str, dict[str, Any]], workers: str, every: str, checkpoint: str
) -> None:
    """About 30 s each: loader workers draw their indices before Lightning sets the epoch; resumed from
    the middle of epoch 0 or from its end, every sample still goes once through each epoch."""
    result, out = _torchrun(tmp_path, "mgpu_ddp", "step", workers=workers, every=every)
    assert f"resuming from {tmp_path}/ckpts/{checkpoint}" in result.output
    _assert_as_uncut(out, uncut["mgpu_ddp"])


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_resumed_on_another_number_of_processes_with_the_same_global_batch(
    tmp_path: Path, uncut: dict[str, dict[str, Any]], before: int, after: int
) -> None:
    """About 25 s: cut at step 5 with ``before`` processes, resumed from step 3 with ``after``; the global
    batch stays 4 rows (processes x rows), so every global batch is the uncut run's."""
    rows = {1: "4", 2: "2"}
    _torchrun(tmp_path, "mgpu_ddp", "none", restarts=0, processes=before, batch=rows[before], max_steps="5")
    result, out = _torchrun(
        tmp_path, "mgpu_ddp", "none", restarts=0, processes=after, batch=rows[after], resume="1"
    )
    assert f"resuming from {tmp_path}/ckpts/epoch=0-step=3.ckpt, saved at global step 3" in result.output
    assert "the global batch is" not in result.output  # nothing changed that needs saying
    _assert_as_uncut(out, uncut["mgpu_ddp"])
