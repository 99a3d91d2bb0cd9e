"""Shared test set-up: markers, environment isolation, process-group clean-up."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist


def cuda_available() -> bool:
    """The one place that decides whether ``gpu``-marked tests run."""
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    """Undo environment changes (MASTER_PORT, LOCAL_RANK, CUDA_VISIBLE_DEVICES, ...) a test made."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _destroy_process_group() -> Iterator[None]:
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
