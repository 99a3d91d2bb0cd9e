"""What the watchdog learns without the store: the processes of this run that run on this machine.

``LocalChecks`` holds them and looks at them once a tick:

- ``children``: the ranks this process launched; ``Popen`` gives their exact exit code or
  signal (``check_children``, ``child_finished``);
- ``parent``: for a rank that Lightning's launcher started, the launching rank, named by the
  launcher in ``PARENT_PID_ENV`` (``find_parent``) and looked up in ``/proc`` (``parent_ended``);
  a pid reused by a new process is not mistaken for it;
- the other ranks on this machine that no rank launched, such as torchrun's workers, read
  from the heartbeat exchange's rank infos (``check_same_host``).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field

from lightning_mgpu.strategies.process_group.watchdog import processes
from lightning_mgpu.strategies.process_group.watchdog.heartbeats import Heartbeats
from lightning_mgpu.strategies.process_group.watchdog.verdicts import Verdict

__all__ = ["PARENT_PID_ENV", "LocalChecks", "Parent", "ParentEnded"]

PARENT_PID_ENV = "LIGHTNING_MGPU_LAUNCHER_PID"
"""Set by the launcher for the ranks it starts: the pid of the launching process."""


@dataclass(frozen=True)
class Parent:
    """The rank that launched this one."""

    rank: int
    pid: int
    started: str | None
    """Its start time from ``/proc``, so a reused pid is not taken for it."""


@dataclass(frozen=True)
class ParentEnded:
    """How the launching rank ended."""

    rank: int
    message: str
    """"rank 0 (pid 123, which launched this rank) exited with code 0"."""
    returncode: int | None
    """Its exit code if this machine still knew it (a negative code is a signal), else ``None``."""


@dataclass
class LocalChecks:
    """The processes of this run on this machine, and what became of them."""

    children: dict[int, subprocess.Popen] = field(default_factory=dict)
    parent: Parent | None = None
    _peer_started: dict[int, str | None] = field(default_factory=dict)

    def check_children(self) -> Verdict | None:
        """A verdict naming the first launched rank that ended with an error."""
        for rank, proc in self.children.items():
            code = proc.poll()
            if code:
                return Verdict(f"rank {rank} (pid {proc.pid}) {processes.describe_exit(code)}", dead=(rank,))
        return None

    def child_finished(self, rank: int) -> bool:
        """Whether ``rank`` is a launched rank whose process ended cleanly."""
        proc = self.children.get(rank)
        return proc is not None and proc.poll() == 0

    def find_parent(self, rank: int, local_rank: int) -> Verdict | None:
        """Note the rank that launched this one, if one did; a verdict if it has ended already."""
        launcher_pid = os.environ.get(PARENT_PID_ENV, "")
        if local_rank == 0 or not launcher_pid.isdigit() or int(launcher_pid) == os.getpid():
            return None
        pid, parent = int(launcher_pid), rank - local_rank
        self.parent = Parent(parent, pid, processes.start_time(pid))
        if os.getppid() != pid:
            return Verdict(f"rank {parent} (pid {pid}, which launched this rank) has ended")
        return None

    def parent_ended(self) -> ParentEnded | None:
        """How the launching rank ended, reported once; ``None`` while it runs (or there is none)."""
        parent = self.parent
        if parent is None:
            return None
        status = processes.pid_status(parent.pid, parent.started)
        if status.alive:
            return None
        self.parent = None
        what = processes.describe_exit(status.returncode)
        message = f"rank {parent.rank} (pid {parent.pid}, which launched this rank) {what}"
        return ParentEnded(parent.rank, message, status.returncode)

    def check_same_host(self, run: Heartbeats) -> Verdict | None:
        """A verdict naming a rank on this machine, watched by nobody else, whose process is gone."""
        me = run.infos.get(run.rank)
        if me is None:
            return None
        for rank, info in run.infos.items():
            if rank == run.rank or info.host != me.host or rank in self.children:
                continue
            if self.parent is not None and rank == self.parent.rank:
                continue
            if any(other.pid == info.parent_pid for other in run.infos.values()):
                continue  # launched by another rank, which reports its exact exit code
            started = self._peer_started.setdefault(rank, processes.start_time(info.pid))
            status = processes.pid_status(info.pid, started)
            if not status.alive and not run.finished(rank):
                what = processes.describe_exit(status.returncode)
                return Verdict(f"rank {rank} (pid {info.pid} on {info.host}) {what}", dead=(rank,))
        return None
