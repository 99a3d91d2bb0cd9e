"""Fixtures shared by the checkpoint tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checkpoint._sharded import save_sharded_run


@pytest.fixture(scope="session")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """The folder a 2-rank ``ModelParallelStrategy`` saved, and its full weights gathered by torch.

    Built once per session (a real 2-process run takes seconds): tests read it, or copy it first
    (``copy_of``) to damage it.
    """
    return save_sharded_run(tmp_path_factory.mktemp("fsdp"))
