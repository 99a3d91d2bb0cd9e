"""The README's sbatch script for ``lightning-mgpu run digits``, submitted as written, on 1 node x 2 CPUs."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO
from tests.slurm.cluster import SlurmCluster

pytestmark = pytest.mark.slurm

# sbatch's own options win over the script's #SBATCH lines: the README's 2 nodes x 4 GPUs becomes this machine
SCALED = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"]
TINY = (
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=3",
    "trainer.limit_val_batches=2",
    "trainer.accelerator=cpu",
    "trainer.enable_progress_bar=false",
)


def readme_script() -> str:
    """The sbatch script of the clusters guide (the README points there)."""
    page = REPO / "docs" / "guides" / "clusters.md"
    blocks = re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S)
    (script,) = [block for block in blocks if "#SBATCH" in block]
    return script


def test_readme_sbatch_script_runs_digits_on_two_tasks(slurm: SlurmCluster, tmp_path: Path) -> None:
    script = readme_script()
    for option in ("--nodes=2", "--ntasks-per-node=4", "--cpus-per-task=8", "--gpus-per-node=4"):
        assert f"#SBATCH {option}\n" in script
    (tmp_path / "digits.sbatch").write_text(script.replace("#SBATCH --gpus-per-node=4\n", ""))  # no GPU here
    venv = Path(sys.executable).parent  # its `lightning-mgpu` command
    env = slurm.env(PATH=f"{venv}:{slurm.env()['PATH']}")
    job = slurm.sbatch(tmp_path / "digits.sbatch", *SCALED, args=TINY, env=env)
    state = slurm.wait_job(job, timeout=180)
    output = (tmp_path / f"digits-{job}.out").read_text()
    assert state == "COMPLETED", output

    assert "mgpu_ddp: 1 node(s) x 2 process(es) per node = 2 process(es), backend gloo, started by SLURM" in (
        output
    )
    assert output.count("digits: fit done in") == 1, output  # rank 0's summary only
    assert "with mgpu_ddp on 2 cpu devices" in output, output
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [f"digits-{job}"]
    run_dir = tmp_path / "runs" / f"digits-{job}"
    assert f"written to runs/digits-{job}/:" in output, output
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "metrics.csv").is_file()
    memory = json.loads((run_dir / "memory_summary.json").read_text())
    assert [d["device"] for d in memory["devices"]] == ["cpu:rank0", "cpu:rank1"]
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 3
    assert (run_dir / "checkpoints" / "final.safetensors").is_file()


def test_the_readme_script_requeued_mid_run_goes_on_in_its_run_folder(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """SLURM's warning signal in the middle of training (as ``--signal`` sends it before a time limit)."""
    (tmp_path / "digits.sbatch").write_text(readme_script().replace("#SBATCH --gpus-per-node=4\n", ""))
    venv = Path(sys.executable).parent
    env = slurm.env(PATH=f"{venv}:{slurm.env()['PATH']}")
    epochs, batches = 10, 10
    args = (f"trainer.max_epochs={epochs}", f"trainer.limit_train_batches={batches}", *TINY[2:])
    job = slurm.sbatch(
        tmp_path / "digits.sbatch", *SCALED, "--requeue", "--open-mode=append", args=args, env=env
    )
    run_dir = tmp_path / "runs" / f"digits-{job}"
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoints" / "last.ckpt").exists():  # the first epoch is done
        assert time.monotonic() < deadline, (tmp_path / f"digits-{job}.out").read_text()
        time.sleep(0.1)
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm.env(), check=True)
    state = slurm.wait_job(job, timeout=240)
    output = (tmp_path / f"digits-{job}.out").read_text()
    assert state == "COMPLETED", output
    assert slurm.job(job)["Restarts"] == "1", output

    signalled = output.index("Handling auto-requeue signal: 10")
    assert f"SLURM job {job} requeued (1 time(s)): going on in runs/digits-{job}" in output[signalled:], (
        output
    )
    assert output.count("digits: fit done in") == 1, output  # the second attempt's summary only
    hpc = sorted(p.name for p in run_dir.glob("hpc_ckpt_*.ckpt"))
    assert hpc == ["hpc_ckpt_1.ckpt"]
    assert f"Restored all states from the checkpoint at runs/digits-{job}/{hpc[0]}" in output, output
    # every step ran, none lost and none twice: the resumed attempt ended at the step count of an uncut run
    assert f"{epochs} epochs, {epochs * batches} optimizer steps" in output, output
    validated = [row for row in csv.DictReader((run_dir / "metrics.csv").open()) if row["val/acc"]]
    assert (validated[-1]["epoch"], validated[-1]["step"]) == (str(epochs - 1), str(epochs * batches))
    assert (run_dir / "metrics-attempt1.csv").is_file()  # the first attempt's metrics, kept
    assert (run_dir / "metrics.csv").is_file()
