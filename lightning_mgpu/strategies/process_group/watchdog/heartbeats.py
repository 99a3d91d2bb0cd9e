"""Every key the watchdog reads or writes in the run's store, for one fit/validate/test call.

Keys, under a prefix unique to the run:

- ``info/<rank>``: the rank's :class:`RankInfo`, written once;
- ``beat/<rank>``: its latest :class:`Beat`, rewritten once a second;
- ``abort``: the first :class:`Verdict`, set with ``compare_set`` so the first one wins;
- ``settled/<rank>``: written once the rank no longer needs the store to learn why its run ends
  (it holds a verdict, saw rank 0 finish, or finished itself): rank 0, whose process holds the
  store, leaves once the others settled, so that none of them finds only a lost store.

All of it runs on the watchdog thread (and once on the main thread at set-up); the
training step never touches the store. ``Idleness`` turns this rank's progress counter (to which
``loop_progress`` adds Lightning's loop counters) into the idle seconds and the waiting flag that its
beats carry.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_mgpu.strategies.process_group.watchdog import processes
from lightning_mgpu.strategies.process_group.watchdog.verdicts import Beat, Judge, RankInfo, Verdict

__all__ = ["Heartbeats", "Idleness", "loop_progress"]


@dataclass
class Idleness:
    """Since when this rank's progress counter has not moved, and whether its main thread waits meanwhile."""

    wait_after: float
    """Idle seconds after which the main thread's stack is read to see whether it waits in a collective."""
    last: int | None = None
    changed: float = 0.0

    def reset(self, now: float) -> None:
        self.last, self.changed = None, now

    def look(self, progress: int | None, now: float) -> Beat:
        """This rank's state as an unsent beat; ``progress=None``: the counter cannot be read."""
        if progress is not None and progress != self.last:
            self.last, self.changed = progress, now
        idle = now - self.changed
        waiting = idle >= self.wait_after and processes.main_thread_waits()
        return Beat(0, self.last or 0, idle, waiting, done=False)


@dataclass
class Heartbeats:
    """The store side of one run, seen from ``rank``: rank 0 watches all and judges stalls, the others
    watch rank 0."""

    store: Any
    rank: int
    world_size: int
    progress: Callable[[], int]
    stall_timeout: float | None
    dead_after: float
    judge: Judge = field(init=False)
    infos: dict[int, RankInfo] = field(default_factory=dict)
    beating: list[int] = field(default_factory=list)
    """Ranks whose heartbeat key exists (keys are never deleted, so each is checked once)."""
    seq: int = 0
    settled: bool = False
    """Whether this rank wrote its ``settled/<rank>`` key."""

    def __post_init__(self) -> None:
        lead = self.rank == 0
        watch = list(range(1, self.world_size)) if lead else [0]
        self.judge = Judge(watch, time.monotonic(), self.dead_after, self.stall_timeout if lead else None)

    def introduce(self, info: RankInfo) -> None:
        self.store.set(f"info/{self.rank}", info.to_json())

    def beat(self, progress: int, idle: float, waiting: bool, done: bool = False) -> None:
        self.seq += 1
        self.store.set(f"beat/{self.rank}", Beat(self.seq, progress, idle, waiting, done).encode())

    def read_infos(self) -> None:
        """Fetch the :class:`RankInfo` of ranks not seen yet."""
        for rank in range(self.world_size):
            if rank not in self.infos and self.store.check([f"info/{rank}"]):
                self.infos[rank] = RankInfo.from_json(self.store.get(f"info/{rank}"))

    def wait_for_infos(self, timeout: float) -> dict[int, RankInfo]:
        """Every rank's :class:`RankInfo`, waiting up to ``timeout`` seconds for late ones."""
        deadline = time.monotonic() + timeout
        while len(self.infos) < self.world_size and time.monotonic() < deadline:
            self.read_infos()
            if len(self.infos) < self.world_size:
                time.sleep(0.05)
        return dict(self.infos)

    def read_beats(self, ranks: Sequence[int]) -> dict[int, Beat]:
        """The latest heartbeat of each of ``ranks`` that has sent one, in one round trip."""
        for rank in ranks:
            if rank not in self.beating and self.store.check([f"beat/{rank}"]):
                self.beating.append(rank)
        present = [rank for rank in ranks if rank in self.beating]
        if not present:
            return {}
        values = self.store.multi_get([f"beat/{rank}" for rank in present])
        return {rank: Beat.decode(value) for rank, value in zip(present, values, strict=True)}

    def finished(self, rank: int) -> bool:
        """Whether ``rank`` said it finished the run."""
        beat = self.read_beats([rank]).get(rank)
        return beat is not None and beat.done

    def publish(self, verdict: Verdict) -> Verdict:
        """Offer ``verdict``; returns the one every rank will see (an earlier one wins)."""
        winner = self.store.compare_set("abort", "", verdict.to_json())
        return Verdict.from_json(winner) if winner else verdict

    def abort(self) -> Verdict | None:
        """The verdict some rank published, if any."""
        return Verdict.from_json(self.store.get("abort")) if self.store.check(["abort"]) else None

    def settle(self) -> None:
        """Say that this rank learnt why its run ends (once; the store may be gone already)."""
        if not self.settled:
            self.settled = True
            with contextlib.suppress(Exception):
                self.store.set(f"settled/{self.rank}", "1")

    def unsettled(self, verdict: Verdict | None, children: Mapping[int, subprocess.Popen]) -> list[int]:
        """The other ranks that may still need rank 0 to learn why the run ends: joined the run, not settled,
        not gone by the ``verdict`` (dead, or failed by itself and ending through its own exception), and not
        a child process that has ended; none once the store is gone."""
        gone = {self.rank, *verdict.dead, verdict.origin} if verdict is not None else {self.rank}
        gone.update(r for r, proc in children.items() if proc.poll() is not None)
        try:
            self.read_infos()
            return [r for r in sorted(self.infos) if r not in gone and not self.store.check([f"settled/{r}"])]
        except Exception:
            return []


def loop_progress(trainer: Any) -> int:
    """Sum of Lightning's epoch and batch counters over its loops: they move between our hooks."""
    total = 0
    try:
        fit = trainer.fit_loop
        loops = (fit, fit.epoch_loop, fit.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop)
        for loop in (*loops, trainer.predict_loop):
            for name in ("epoch_progress", "batch_progress"):
                counts = getattr(getattr(loop, name, None), "total", None)
                for field in ("ready", "started", "processed", "completed"):
                    total += getattr(counts, field, 0)
    except Exception:  # read from another thread while the trainer changes: best effort
        pass
    return total
