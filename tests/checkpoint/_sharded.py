"""A real sharded checkpoint folder, shared by the tests that read one: what a 2-rank run saves.

One 2-process run of Lightning's ``ModelParallelStrategy`` (FSDP2 on gloo) writes it, every tensor
split over both ranks' files (``tests/scripts/sharded_fit.py``); ``conftest.py`` runs it once per
session (``fsdp_run``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

from tests.helpers import run_file


def save_sharded_run(folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Run ``sharded_fit.py`` in ``folder``: the folder it saved, and its full weights gathered by torch."""
    result = run_file("sharded_fit.py", folder, timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    return folder / "last.ckpt", torch.load(folder / "reference.pt", weights_only=True)


def plain_model() -> nn.Sequential:
    """The model the run trained, without Lightning, FSDP or its ``model.`` attribute."""
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def copy_of(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / folder.name))


def only_inputs_left(folder: Path, *names: str) -> None:
    assert sorted(p.name for p in folder.iterdir()) == sorted(names)


class Touch:
    """Unpickling this creates ``marker``: a payload no reader may run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))
