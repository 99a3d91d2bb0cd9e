"""Every key the watchdog reads or writes in the run's store, for one fit/validate/test call.

Keys, under a prefix unique to the run:

- ``info/<rank>``: the rank's :class:`RankInfo`, written once;
- ``beat/<rank>``: its latest :class:`Beat`, rewritten once a second;
- ``abort``: the first :class:`Verdict`, set with ``compare_set`` so the first one wins;
- ``stopped``: how many ranks have read the verdict and are stopping.

All of it runs on the watchdog thread (and once on the main thread at set-up); the
training step never touches the store.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_mgpu.strategies.ddp.watchdog.verdicts import Beat, Judge, RankInfo, Verdict

__all__ = ["Heartbeats"]


@dataclass
class Heartbeats:
    """The store side of one run, seen from one rank."""

    store: Any
    rank: int
    world_size: int
    progress: Callable[[], int]
    stall_timeout: float | None
    judge: Judge
    infos: dict[int, RankInfo] = field(default_factory=dict)
    beating: list[int] = field(default_factory=list)
    """Ranks whose heartbeat key exists (keys are never deleted, so each is checked once)."""
    seq: int = 0

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

    def read_beats(self, ranks: Sequence[int]) -> dict[int, Beat]:
        """The latest heartbeat of each of ``ranks`` that has sent one, in one round trip."""
        for rank in ranks:
            if rank not in self.beating and self.store.check([f"beat/{rank}"]):
                self.beating.append(rank)
        present = [rank for rank in ranks if rank in self.beating]
        if not present:
            return {}
        keys = [f"beat/{rank}" for rank in present]
        multi_get = getattr(self.store, "multi_get", None)
        values = multi_get(keys) if multi_get is not None else [self.store.get(key) for key in keys]
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

    def stopping(self) -> None:
        """Count this rank among those that read the verdict."""
        self.store.add("stopped", 1)

    def stopped(self) -> int:
        """How many ranks have counted themselves with :meth:`stopping` (0 if the store is gone)."""
        try:
            return int(self.store.add("stopped", 0))
        except Exception:
            return 0
