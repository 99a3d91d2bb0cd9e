"""Shared test set-up: markers, environment isolation, process-group clean-up."""

from __future__ import annotations

import functools
import multiprocessing.process
import os
import signal
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.processes import starts_processes


def cuda_available() -> bool:
    """The one place that decides whether ``gpu``-marked tests run."""
    return torch.cuda.is_available()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, pytest.Function) and starts_processes(
            item.function, Path(item.path), item.fixturenames
        ):
            item.add_marker(pytest.mark.processes)
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_STARTED: list[str] = []  # what the running test started: subprocess.Popen, multiprocessing's Process


def _noting(kind: str, original: Any) -> Any:
    @functools.wraps(original)
    def start(self: Any, *args: Any, **kwargs: Any) -> Any:
        _STARTED.append(kind)
        return original(self, *args, **kwargs)

    return start


def pytest_configure(config: pytest.Config) -> None:
    # Started in the background (nohup, a CI job, `cmd &`), this process and every command the tests start
    # would inherit SIGINT ignored, and Ctrl-C tests would see their command run through. A terminal gives
    # Python's KeyboardInterrupt: so do the tests, whatever started them.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    popen = subprocess.Popen
    popen.__init__ = _noting("subprocess.Popen", popen.__init__)  # type: ignore[method-assign]
    process = multiprocessing.process.BaseProcess
    process.start = _noting("a multiprocessing Process", process.start)  # type: ignore[method-assign]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _STARTED.clear()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """Warn of a test that started a process without the ``processes`` marker (tests/processes.py missed)."""
    if _STARTED and item.get_closest_marker("processes") is None:
        warnings.warn(
            f"{item.nodeid} started {' and '.join(sorted(set(_STARTED)))} without the `processes` marker,"
            " so `make test-fast` runs it: tests/processes.py should find it, or mark it by hand",
            pytest.PytestWarning,
            stacklevel=1,
        )


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
