"""The helpers that submit the SLURM tests' training script (tests/scripts/slurm_train.py) as real jobs."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.helpers import REPO, Result, run_command
from tests.slurm.cluster import SlurmCluster

TRAIN_SCRIPT = REPO / "tests" / "scripts" / "slurm_train.py"


def srun_train(
    cluster: SlurmCluster,
    folder: Path,
    strategy: str,
    layout: tuple[str, ...] = ("--nodes=1", "--ntasks-per-node=2"),
    timeout: float = 240,
) -> Result:
    """``srun`` ``TRAIN_SCRIPT`` as ``layout`` asks (two tasks on the one node) and wait for it."""
    cmd = ["srun", *layout, f"--job-name=fit-{strategy}"]
    cmd += [sys.executable, str(TRAIN_SCRIPT), strategy, "fit"]
    return run_command(cmd, cwd=folder, timeout=timeout, env=cluster.env())


def batch_script(folder: Path, *srun_args: str) -> Path:
    """An sbatch script that runs ``TRAIN_SCRIPT`` under ``srun`` on two tasks of the one node."""
    lines = ["#!/bin/bash", "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=2", "#SBATCH --output=job.out"]
    lines.append(f"srun {sys.executable} {TRAIN_SCRIPT} {' '.join(srun_args)}")
    path = folder / "job.sbatch"
    path.write_text("\n".join(lines) + "\n")
    return path


def processes_of(folder: Path) -> list[str]:
    """Command lines of live processes (zombies aside) working in ``folder``: what a job left behind."""
    left = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z" and (proc / "cwd").resolve(strict=True) == folder.resolve():
                args = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                left.append(f"{proc.name} {args}")
        except (OSError, IndexError):
            continue
    return left
