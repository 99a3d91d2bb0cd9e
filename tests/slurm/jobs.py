"""The training script the SLURM tests run as real jobs, and the helpers that submit it.

``TRAIN_SCRIPT`` is ``tests/strategies/ddp/test_ddp.py``'s regression fit (same data, model,
optimizer, two epochs of 8 global batches), so its weights are checked against the same
single-process reference. It takes the strategy, the world it runs in and what happens to it:

- ``fit``: train, then each rank writes what SLURM told it and what Lightning made of it;
- ``kill``: rank 1 writes its pid and waits at batch 5 for the test to kill it;
- ``requeue``: in the first attempt the last step of epoch 0 lasts until SLURM's warning signal
  arrives; the ranks then save at the next batch start (the first of epoch 1) and the job is
  requeued; the requeued attempt resumes from that checkpoint.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from tests.helpers import Result, run_command
from tests.slurm.cluster import SlurmCluster

TRAIN_SCRIPT = """
import json, os, signal, sys, time, torch, lightning as L
import lightning_mgpu
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

strategy, mode = sys.argv[1], sys.argv[2]
attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0"))

class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        if mode == "kill" and batch_idx == 5 and self.global_rank == 1:
            with open("victim.pid", "w") as f:
                f.write(str(os.getpid()))
            while True:
                time.sleep(0.1)
        if mode == "requeue" and attempt == 0 and self.current_epoch == 0 and batch_idx == 7:
            open(f"waiting_rank{self.global_rank}", "w").close()
            signalled = []
            previous = signal.getsignal(signal.SIGUSR1)  # the strategy's, which defers Lightning's handling

            def note(signum, frame):
                signalled.append(signum)
                previous(signum, frame)

            signal.signal(signal.SIGUSR1, note)
            while not signalled:  # the last step of epoch 0 lasts until SLURM's warning of the time limit
                time.sleep(0.1)
            signal.signal(signal.SIGUSR1, previous)
        self.steps_run = getattr(self, "steps_run", 0) + 1
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

torch.manual_seed(0)
x, y = torch.randn(64, 4), torch.randn(64, 1)  # the data reference_weights trains on
model = Regression()
initial = {k: v.clone() for k, v in model.state_dict().items()}
quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
nodes = int(os.environ["SLURM_NNODES"])
tasks = int(os.environ.get("SLURM_NTASKS_PER_NODE", os.environ["SLURM_NTASKS"]))
trainer = L.Trainer(accelerator="cpu", devices=tasks, num_nodes=nodes, strategy=strategy, max_epochs=2,
                    **quiet)
trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False))
final = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
if trainer.is_global_zero:
    torch.save({"x": x, "y": y, "initial": initial, "final": final}, "result.pt")
environment = trainer.strategy.cluster_environment
with open(f"rank{trainer.global_rank}.json", "w") as f:
    json.dump({
        "slurm": {k: os.environ[k] for k in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_ID")},
        "global_rank": trainer.global_rank, "local_rank": trainer.local_rank,
        "world_size": trainer.world_size, "environment": type(environment).__name__,
        "strategy": type(trainer.strategy).__name__, "attempt": attempt,
        "resumed_from": trainer.ckpt_path, "steps_run": model.steps_run,
    }, f)
"""


def write_script(folder: Path) -> Path:
    path = folder / "train.py"
    path.write_text(textwrap.dedent(TRAIN_SCRIPT))
    return path


def srun_train(
    cluster: SlurmCluster,
    folder: Path,
    strategy: str,
    layout: tuple[str, ...] = ("--nodes=1", "--ntasks-per-node=2"),
    timeout: float = 240,
) -> Result:
    """``srun`` ``TRAIN_SCRIPT`` as ``layout`` asks (two tasks on the one node) and wait for it."""
    script = write_script(folder)
    cmd = ["srun", *layout, f"--job-name=fit-{strategy}"]
    cmd += [sys.executable, str(script), strategy, "fit"]
    return run_command(cmd, cwd=folder, timeout=timeout, env=cluster.env())


def batch_script(folder: Path, *srun_args: str, directives: tuple[str, ...] = ()) -> Path:
    """An sbatch script that runs ``TRAIN_SCRIPT`` under ``srun`` on two tasks of the one node."""
    write_script(folder)
    lines = ["#!/bin/bash", "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=2", "#SBATCH --output=job.out"]
    lines += [f"#SBATCH {d}" for d in directives]
    lines.append(f"srun {sys.executable} train.py {' '.join(srun_args)}")
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
