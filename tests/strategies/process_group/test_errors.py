"""A peer's failure told from a rank's own: only the first makes a rank wait for the watchdog's verdict."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lightning_mgpu.strategies.process_group.errors import is_communication_error


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("the database connection timed out"),  # tests/scripts/fault.py's user error
        RuntimeError("DataLoader worker (pid 12) timed out"),
        ValueError("Connection reset by peer"),  # not a RuntimeError: not torch.distributed's
    ],
)
def test_an_error_of_the_users_code_is_not_a_lost_peer(error: Exception) -> None:
    assert not is_communication_error(error)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"),
        RuntimeError("Connection reset by peer"),
        dist.DistError("something torch.distributed raised"),
    ],
)
def test_a_collective_losing_a_peer_is_one(error: Exception) -> None:
    assert is_communication_error(error)
