"""Rank 0 holds the run's store: it keeps it until the other ranks have read why the run ends.

On a loaded machine rank 1's watchdog read the store late. Rank 0 had published its error, or finished
the run, and left, taking the store with it: rank 1 could only report "lost the connection to the run's
store" instead of the real cause. Here rank 1 gets no CPU at all (SIGSTOP) while rank 0 leaves, and is
resumed 1.5 s later (tests/scripts/frozen_peer.py).
"""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import torch.distributed as dist

from lightning_mgpu.strategies.process_group.watchdog.heartbeats import Heartbeats
from lightning_mgpu.strategies.process_group.watchdog.shutdown import wait_until_settled
from lightning_mgpu.strategies.process_group.watchdog.verdicts import RankInfo, Verdict
from tests.helpers import run_file


def joined(store: dist.Store, rank: int, world_size: int = 4) -> Heartbeats:
    run = Heartbeats(store, rank, world_size, progress=lambda: 0, stall_timeout=None, dead_after=10.0)
    run.introduce(RankInfo(rank, 1000 + rank, 1, "node-a", 0, f"cuda:{rank}", "GPU"))
    return run


def test_the_holder_waits_only_for_live_ranks_that_did_not_settle() -> None:
    store = dist.HashStore()
    holder, late, child, _ = (joined(store, rank) for rank in range(4))  # rank 3 is named dead below
    verdict = Verdict("rank 3 (pid 1003 on node-a) was killed by signal 9 (SIGKILL)", dead=(3,))
    assert holder.unsettled(None, {}) == [1, 2, 3]
    assert holder.unsettled(verdict, {}) == [1, 2]
    ended = subprocess.Popen(["true"])  # rank 2, a launched child, has ended: it reads nothing any more
    ended.wait()
    assert holder.unsettled(verdict, {2: ended}) == [1]
    assert wait_until_settled(holder, verdict, {2: ended}, limit=0.1) == [1]  # bounded: rank 1 never settled
    threading.Timer(0.2, late.settle).start()
    assert wait_until_settled(holder, verdict, {2: ended}, limit=120.0) == []  # returns once rank 1 settled
    child.settle()
    assert holder.unsettled(None, {}) == [3]


def test_a_rank_that_never_joined_the_exchange_is_not_waited_for() -> None:
    store = dist.HashStore()
    holder = joined(store, 0, world_size=2)  # rank 1 could not reach the store: it wrote no info
    assert holder.unsettled(None, {}) == []


def test_a_late_rank_names_rank_0s_error_not_a_lost_store(tmp_path: Path) -> None:
    """About 15 s: rank 0 fails by itself at its third batch while rank 1 is frozen."""
    result = run_file("frozen_peer.py", tmp_path, args=["raise", "1.5"])
    assert result.returncode == 1, result.output[-3000:]
    assert "lost the connection to the run's store" not in result.output, result.output[-3000:]
    told = [row for row in result.output.splitlines() if "[rank 1] stopped because rank 0 (pid " in row]
    assert any("failed with RuntimeError: a bad sample on rank 0" in row for row in told), result.output[
        -3000:
    ]


def test_a_late_rank_left_behind_names_the_finished_rank_0(tmp_path: Path) -> None:
    """About 15 s: rank 1 has two batches more; rank 0 finishes the run while rank 1 is frozen."""
    result = run_file("frozen_peer.py", tmp_path, args=["more", "1.5"])
    assert result.returncode == 1, result.output[-3000:]
    assert "lost the connection to the run's store" not in result.output, result.output[-3000:]
    assert "[rank 1] stopped because rank 0 has already finished the run" in result.output, result.output[
        -3000:
    ]
    assert "[rank 0] lightning_mgpu: the run failed after this rank ended: rank 1 (pid " in result.output
