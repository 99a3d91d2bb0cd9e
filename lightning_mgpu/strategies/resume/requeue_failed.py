"""A SLURM job whose task failed requeued, a bounded number of times: ``requeue_on_failure``.

SLURM requeues a job by itself only when its node fails; a task that dies (SIGKILL, a GPU fault,
an error) ends the job. With ``requeue_on_failure=N`` the strategy asks SLURM to requeue it
(``scontrol requeue``), and the requeued attempt resumes from the newest complete checkpoint by
itself (``resume/``). Never in a loop:

- at most ``N`` times in the job's life (``SLURM_RESTART_COUNT`` counts every requeue, a time
  limit's included);
- only after an attempt that trained at least one step: one that fails before its first step
  would fail the same way again.

One rank asks: the lowest one not known to be dead, the same on every rank since they all read
the watchdog's one verdict. :func:`requeue_decision` decides, plain data in and out.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Mapping

from lightning_mgpu.strategies.resume.restart import env_count

__all__ = ["check_requeue_on_failure", "requeue_decision", "scontrol"]

log = logging.getLogger(__name__)


def check_requeue_on_failure(limit: object) -> int:
    """``limit`` as given, or ``ValueError`` naming what is accepted."""
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise ValueError(
            f"requeue_on_failure must be how many times a SLURM job may be requeued after a failed task"
            f" (0: never), got {limit!r}"
        )
    return limit


def requeue_decision(limit: int, environ: Mapping[str, str], steps_this_attempt: int) -> tuple[bool, str]:
    """Whether to requeue this SLURM job after a failed task, and the reason in words."""
    job = environ.get("SLURM_JOB_ID", "")
    if limit <= 0 or not job:
        return False, "requeue_on_failure is off" if job else "not a SLURM job"
    restarts = env_count(environ, "SLURM_RESTART_COUNT")
    if restarts >= limit:
        return False, f"not requeued: requeued {restarts} time(s) already, requeue_on_failure={limit}"
    if steps_this_attempt <= 0:
        return False, "not requeued: this attempt failed before its first step, and another would too"
    return True, f"requeue {restarts + 1} of at most {limit}"


def scontrol(*args: str) -> tuple[bool, str]:
    """Run ``scontrol *args``: whether it succeeded, and its output, else what went wrong."""
    try:
        done = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        return False, str(err)
    if done.returncode == 0:
        return True, done.stdout
    return False, (done.stderr or done.stdout).strip() or f"exit {done.returncode}"
