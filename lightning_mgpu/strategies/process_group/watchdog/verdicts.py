"""What the ranks tell each other through the store, and how rank 0 judges it.

- ``RankInfo``: written once per run by every rank (pid, machine, device); the start-up
  summary and the messages that name a rank read it.
- ``Beat``: written once a second by every rank's watchdog: a sequence number, the
  progress counter, seconds since it last moved, whether the main thread waits in a
  collective, and whether the rank finished the run.
- ``Suspect``: a reason to stop that waits a moment for a better one (a rank 0 that ended
  cleanly too early, a lost store) before it becomes the ``Verdict``.
- ``Judge`` turns beats into a ``Verdict``:

  * a watched rank whose sequence number has not moved for ``dead_after`` seconds is
    gone (its process was killed, or its machine or network is down);
  * when every rank has been idle for ``stall_timeout`` seconds and some are ahead of
    the others (or wait in a collective while others do not), the ranks behind are
    stuck. Ranks that are all busy at the same point (a long first step, compilation)
    are not a stall.

- ``left_behind`` spots ranks that wait in a collective of a run that another rank has
  already finished: nobody will ever join them (the ranks ran different numbers of steps).
  Rank 0 applies it to every rank; the other ranks apply it to themselves, since rank 0
  stops judging once its own run ended.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from typing_extensions import Self

__all__ = ["Beat", "Judge", "RankInfo", "Suspect", "Verdict", "finished_early", "left_behind"]


class _JsonRecord:
    """A frozen dataclass as the store carries it: a JSON object of its fields (lists read back as tuples)."""

    def to_json(self) -> str:
        return json.dumps(vars(self))

    @classmethod
    def from_json(cls, text: bytes | str) -> Self:
        fields = json.loads(text)
        return cls(**{name: tuple(v) if isinstance(v, list) else v for name, v in fields.items()})


@dataclass(frozen=True)
class Verdict(_JsonRecord):
    """Why the run must stop, as every rank reports it."""

    message: str
    stuck: tuple[int, ...] = ()
    """Ranks that print their Python stack and end at once."""
    dead: tuple[int, ...] = ()
    """Ranks known to be gone: nobody waits for them to acknowledge."""
    origin: int = -1
    """The rank whose own error this is; that rank is not forced to exit."""

    def stopped(self, rank: int) -> str:
        """The line ``rank`` prints when it stops for this verdict, not its own; a rank that failed by
        itself prints the one traceback."""
        traceback = f" Rank {self.origin} prints the traceback." if self.origin >= 0 else ""
        return f"[rank {rank}] stopped because {self.message}.{traceback}"

    def failed(self, rank: int, error: str) -> tuple[str, bool]:
        """What ``rank``, failed by itself with ``error``, prints under this verdict (the run's): one line,
        and whether its traceback follows; only the rank that failed first prints its traceback."""
        if self.origin == rank:
            return f"[rank {rank}] {self.message}; its traceback follows:", True
        if self.origin >= 0:  # another rank failed first by itself, and prints its traceback
            first, _, first_error = self.message.partition(" failed with ")
            how = "the same way as" if first_error == error else f"with {error} after"
            return f"[rank {rank}] failed {how} {first}; rank {self.origin} prints the traceback.", False
        # the run was failing already (a rank died): this traceback is the only one
        return f"[rank {rank}] failed with {error}, after {self.message}", True


@dataclass(frozen=True)
class Suspect:
    """A likely reason to stop, not yet certain: a failed rank may still publish a better one.

    It becomes the verdict after ``DEAD_AFTER`` seconds, or at once when a collective fails.
    """

    since: float
    """``time.monotonic()`` when it was noticed."""
    message: str
    dead: tuple[int, ...]
    """Ranks it takes to be gone."""

    def verdict(self) -> Verdict:
        return Verdict(self.message, dead=self.dead)


@dataclass(frozen=True)
class RankInfo(_JsonRecord):
    """Where one rank runs."""

    rank: int
    pid: int
    parent_pid: int
    host: str
    node_rank: int
    device: str
    device_name: str

    @property
    def where(self) -> str:
        return f"pid {self.pid} on {self.host}"


@dataclass(frozen=True)
class Beat:
    """One heartbeat."""

    seq: int
    progress: int
    idle: float
    waiting: bool
    done: bool

    def encode(self) -> str:
        return f"{self.seq} {self.progress} {self.idle:.1f} {int(self.waiting)} {int(self.done)}"

    @classmethod
    def decode(cls, text: bytes | str) -> Beat:
        seq, progress, idle, waiting, done = (text.decode() if isinstance(text, bytes) else text).split()
        return cls(int(seq), int(progress), float(idle), waiting == "1", done == "1")


def _names(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def finished_early(done: list[int]) -> str:
    """Why a collective fails or waits forever when ``done`` ranks already finished the run."""
    has = "has" if len(done) == 1 else "have"
    return (
        f"{_names(done)} {has} already finished the run. The ranks ran different numbers of steps, for"
        " example an IterableDataset (or a sampler) that gives the ranks different numbers of batches;"
        " give every rank the same number of batches (a DistributedSampler, or equal shards per rank)"
    )


def left_behind(beats: Mapping[int, Beat], after: float) -> Verdict | None:
    """The ranks that have waited ``after`` seconds in a collective which a finished rank will never join."""
    done = sorted(r for r, b in beats.items() if b.done)
    running = {r: b for r, b in beats.items() if not b.done}
    if not done or not running or not all(b.waiting and b.idle >= after for b in running.values()):
        return None
    waiting = sorted(running)
    return Verdict(
        f"{_names(waiting)} waited {min(b.idle for b in running.values()):.0f} s in a collective that will"
        f" never complete: {finished_early(done)}",
        stuck=tuple(waiting),
    )


class Judge:
    """Decides from heartbeats whether a watched rank is gone or the run is stalled."""

    def __init__(self, watch: list[int], now: float, dead_after: float, stall_timeout: float | None) -> None:
        self.watch = watch
        self.dead_after = dead_after
        self.stall_timeout = stall_timeout
        self._seq: dict[int, int | None] = {r: None for r in watch}
        self._changed: dict[int, float] = {r: now for r in watch}

    def look(
        self,
        beats: Mapping[int, Beat],
        now: float,
        infos: Mapping[int, RankInfo],
        finished: Callable[[int], bool],
    ) -> Verdict | None:
        """A verdict, or ``None`` while all is well. ``finished(rank)``: that rank's process ended cleanly."""
        for rank in self.watch:
            beat = beats.get(rank)
            seq = beat.seq if beat is not None else None
            if seq != self._seq[rank]:
                self._seq[rank], self._changed[rank] = seq, now
            if beat is not None and beat.done:
                continue
            silent = now - self._changed[rank]
            if silent >= self.dead_after and not finished(rank):
                info = infos.get(rank)
                where = f" ({info.where})" if info is not None else ""
                never = "never sent a heartbeat" if beat is None else f"sent no heartbeat for {silent:.0f} s"
                return Verdict(
                    f"rank {rank}{where} {never}: its process was killed or hangs outside Python,"
                    " or its machine or network is down",
                    dead=(rank,),
                )
        return left_behind(beats, self.dead_after) or self._stall(beats, infos)

    def _stall(self, beats: Mapping[int, Beat], infos: Mapping[int, RankInfo]) -> Verdict | None:
        timeout = self.stall_timeout
        running = {r: b for r, b in beats.items() if not b.done}
        if timeout is None or not running or any(b.idle < timeout for b in running.values()):
            return None
        lowest = min(b.progress for b in running.values())
        behind = sorted(r for r, b in running.items() if b.progress == lowest)
        waiting = sorted(r for r, b in running.items() if b.waiting)
        if len(behind) < len(running):
            stuck = behind
        elif waiting and len(waiting) < len(running):
            stuck = sorted(set(running) - set(waiting))
        elif waiting:
            ranks = sorted(running)
            return Verdict(
                f"{_names(ranks)} have all waited in collectives for {timeout:.0f} s without progress"
                f" (stall_timeout={timeout:g}): they called different collectives, or the connection"
                " between them fails; each prints its Python stack",
                stuck=tuple(ranks),
            )
        else:
            return None  # every rank busy at the same point: a long step, not a stall
        others = sorted(set(running) - set(stuck))
        named = ", ".join(f"rank {r}" + (f" ({infos[r].where})" if r in infos else "") for r in stuck)
        return Verdict(
            f"{named} stalled: no progress for {max(running[r].idle for r in stuck):.0f} s"
            f" while {_names(others)} waited for it in a collective (stall_timeout={timeout:g});"
            " its Python stack is printed by the stuck rank",
            stuck=tuple(stuck),
        )
