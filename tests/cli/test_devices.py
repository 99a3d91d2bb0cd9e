"""``lightning-mgpu devices`` run as a real command."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import psutil
import pytest

from lightning_mgpu.config.instantiate import resolve_devices
from lightning_mgpu.config.schema import CPU_DEVICE_CAP
from lightning_mgpu.devices import format_bytes
from tests.helpers import run_command, script_env


def _devices(tmp_path: Path, *args: str, **env: str) -> tuple[int, str, str]:
    result = run_command(
        [sys.executable, "-m", "lightning_mgpu", "devices", *args],
        cwd=tmp_path,
        env=script_env(**env),
        timeout=120,
    )
    return result.returncode, result.stdout, result.stderr


def test_cpu_only_machine_says_so_and_what_auto_picks(tmp_path: Path) -> None:
    for name in ("SLURM_NTASKS", "TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
        os.environ.pop(name, None)
    code, out, err = _devices(tmp_path, CUDA_VISIBLE_DEVICES="")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "CUDA_VISIBLE_DEVICES=(empty)"
    assert lines[1] == "No CUDA device is visible: this machine trains on CPU only."
    total = format_bytes(psutil.virtual_memory().total)
    assert lines[2].startswith(f"CPU: {os.cpu_count()} logical cores, RAM ")
    assert lines[2].endswith(f" used of {total}")
    assert lines[3] == (
        'Trainer(strategy="mgpu_auto", devices="auto") would pick'
        " single_device: one cpu device: nothing to split"
    )
    _, cores = resolve_devices("cpu", "auto")  # what `run` starts: one process per core, capped
    run = f"{cores} devices in a script: one process per device" if cores > 1 else "one cpu device: nothing"
    assert lines[4].startswith(
        f"lightning-mgpu run with trainer.devices=auto (one CPU process per core, at most {CPU_DEVICE_CAP})"
        f" would pick {'mgpu_ddp' if cores > 1 else 'single_device'}: {run}"
    )


def test_reports_a_launched_job_and_rejects_bad_nodes(tmp_path: Path) -> None:
    code, out, _ = _devices(
        tmp_path, "--num-nodes", "2", CUDA_VISIBLE_DEVICES="", SLURM_NTASKS="8", SLURM_JOB_NAME="train"
    )
    assert code == 0
    assert out.splitlines()[-2:] == [
        'Trainer(strategy="mgpu_auto", devices="auto") would pick mgpu_ddp: 2 nodes: one process per device',
        f"lightning-mgpu run with trainer.devices=auto (one CPU process per core, at most {CPU_DEVICE_CAP})"
        " would pick mgpu_ddp: 2 nodes: one process per device",
    ]
    code, out, err = _devices(tmp_path, "--num-nodes", "0")
    assert code == 1
    assert out == ""
    assert err.strip() == "lightning-mgpu devices: error: --num-nodes must be at least 1, got 0"


@pytest.mark.gpu
def test_lists_every_visible_gpu(tmp_path: Path) -> None:
    import torch

    code, out, err = _devices(tmp_path)
    assert code == 0, err
    for index in range(torch.cuda.device_count()):
        name = torch.cuda.get_device_name(index)
        assert any(
            line.startswith(f"cuda:{index}") and name in line and "GiB" in line for line in out.splitlines()
        )
    assert 'Trainer(strategy="mgpu_auto", devices="auto") would pick ' in out
    assert "lightning-mgpu run with trainer.devices=auto (every visible GPU) would pick " in out
