"""Whether this run is a restart of an earlier attempt of the same job, read from the launcher's environment.

- torchrun sets ``TORCHELASTIC_RESTART_COUNT``: how many times this node's agent restarted its
  workers after a failure (``--max-restarts``). A node restarted only because another node failed
  does not count it, so the ranks take the largest count among them (see ``auto_resume.py``);
- SLURM sets ``SLURM_RESTART_COUNT`` once it requeued a job (a time limit's signal, a failed task,
  ``scontrol requeue``); the job keeps its id.

Pure: the environment in, a :class:`Restart` out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Restart", "env_count", "restart_of"]


@dataclass(frozen=True)
class Restart:
    """How many earlier attempts of this job ran before this one, and who started this one again."""

    count: int
    """0 on a job's first attempt."""
    by: str
    """``"torchrun"``, ``"SLURM"`` or ``""`` (a first attempt, or one started again by hand)."""
    found_in: str = ""
    """The checkpoint folder whose record shows an unfinished earlier attempt (``attempt_record.py``), if that
    is what made this run a restart."""

    @property
    def is_restart(self) -> bool:
        return self.count > 0

    def describe(self) -> str:
        """``"attempt 2 of this job (restarted by torchrun)"``."""
        if not self.is_restart:
            return "the first attempt of this job"
        if self.found_in:
            return (
                f"attempt {self.count + 1} of this run (the one before, in {self.found_in}, did not finish)"
            )
        return f"attempt {self.count + 1} of this job (restarted by {self.by})"


def env_count(environ: Mapping[str, str], name: str) -> int:
    """The count in variable ``name`` of ``environ``; 0 where it is unset, empty or not a number."""
    try:
        return max(0, int(environ.get(name, "0")))
    except ValueError:
        return 0


def restart_of(environ: Mapping[str, str]) -> Restart:
    """This process's :class:`Restart`, from torchrun's and SLURM's variables in ``environ``."""
    counts = {
        "SLURM": env_count(environ, "SLURM_RESTART_COUNT"),
        "torchrun": env_count(environ, "TORCHELASTIC_RESTART_COUNT"),
    }
    # a requeued SLURM job that runs torchrun: both count, each since its own start
    return Restart(sum(counts.values()), " and ".join(name for name, count in counts.items() if count))
