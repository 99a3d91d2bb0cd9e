"""A torchrun restart creates its process group in a key space the dead attempt never wrote.

torchrun keeps its store for the whole job; without a fresh key space the restarted ranks read
the dead attempt's gloo addresses and fail ("connectFullMesh ... Connection refused") or hang.
"""

from __future__ import annotations

import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_mgpu.strategies.process_group.torchrun_store import attempt_token
from tests.helpers import SCRIPTS, free_port, run_command, script_env


def test_a_torchrun_restart_after_a_killed_rank_finishes(tmp_path: Path) -> None:
    """About 25 s: two torchrun attempts of a 16-step run."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    script = str(SCRIPTS / "torchrun_restart.py")
    result = run_command([*cmd, "--max-restarts=1", script], cwd=tmp_path, env=script_env(), timeout=150)
    assert result.returncode == 0, result.output[-5000:]
    assert "attempt 1 rank 0 finished at step 8" in result.stdout, result.output[-5000:]
    assert "attempt 1 rank 1 finished at step 8" in result.stdout
    assert "Connection refused" not in result.output


def _stale_store(port: int) -> dist.TCPStore:
    """A store holding what a dead attempt's handshake left: rank 1's hello, reply and acknowledgement."""
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    prefix = "lightning_mgpu/attempt/"
    server.set(f"{prefix}hello/1", "oldnonce")
    server.set(f"{prefix}reply/1", "oldnonce:oldtoken")
    server.set(f"{prefix}got/1", "oldnonce:oldtoken")
    return server


def test_ranks_agree_on_a_new_token_although_the_store_holds_the_last_attempts() -> None:
    port = free_port()
    server = _stale_store(port)
    tokens: dict[int, str] = {}

    def rank(number: int, delay: float) -> None:
        time.sleep(delay)
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        tokens[number] = attempt_token(client, number, 3, timeout=10)

    # rank 0 comes last, so the others see only the old keys at first
    threads = [threading.Thread(target=rank, args=(r, 0.5 if r == 0 else 0.0)) for r in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert sorted(tokens) == [0, 1, 2]
    assert len(set(tokens.values())) == 1
    assert tokens[0] != "oldtoken"
    del server


def test_a_rank_0_that_never_comes_is_a_clear_error() -> None:
    port = free_port()
    server = _stale_store(port)
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    # attempt_token's own deadline ended the wait (the error names 0.5 s), not a blocking read of the
    # store, whose 10 s timeout raises torch's DistStoreError (a DistError), not a TimeoutError
    with pytest.raises(TimeoutError, match=r"rank 0 did not answer rank 1 within 0.5 s") as caught:
        attempt_token(client, 1, 2, timeout=0.5)
    assert not isinstance(caught.value, dist.DistError)
    del server
