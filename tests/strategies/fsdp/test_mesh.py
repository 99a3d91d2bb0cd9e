"""Fits of ``mgpu_fsdp`` in one process share one device mesh: none leaves process groups, or files, behind.

Lightning builds a new device mesh for every fit, with new process groups: each fit left four more open
files on each rank (27, 31, 35 on rank 0 over three fits). The run is tests/scripts/fsdp_open_files.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers import run_file


def test_fits_in_one_process_hold_no_more_files_and_train_the_same(tmp_path: Path) -> None:
    """About 20 s: four fits on two processes."""
    result = run_file("fsdp_open_files.py", tmp_path, timeout=240)
    assert result.returncode == 0, result.output[-3000:]
    outside = "OUTSIDE "
    lines = [line.removeprefix(outside) for line in result.stdout.splitlines() if line.startswith(outside)]
    files = {(row["rank"], row["fit"]): row["open_files"] for row in map(json.loads, lines)}
    assert len(files) == 8, result.output[-3000:]
    for rank in (0, 1):
        assert len({files[rank, fit] for fit in ("fit1", "fit2", "fit3", "again")}) == 1, files
    # the same start and data: the later fits, over the first fit's mesh, train exactly as the first
    first = torch.load(tmp_path / "fit1.pt")
    for name in ("fit2", "fit3"):
        later = torch.load(tmp_path / f"{name}.pt")
        assert later.keys() == first.keys()
        for key in first:
            torch.testing.assert_close(later[key], first[key], rtol=0, atol=0)
    # the first model, sharded over that mesh, trained on after the later fits: two more epochs
    again = torch.load(tmp_path / "again.pt")
    assert any(not torch.equal(again[key], first[key]) for key in first)
