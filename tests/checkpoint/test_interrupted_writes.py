"""A write ended by a signal leaves nothing behind, or the next write into the folder cleans up."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch

from lightning_mgpu import export_state_dict
from tests.checkpoint._models import assert_same, net
from tests.helpers import SCRIPTS, script_env


def _writer_killed_by(tmp_path: Path, signum: int) -> tuple[int, list[str]]:
    """Run a writer, stop it mid-write with ``signum``; its pid and the temporary files it had."""
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "atomic_writer.py")],
        cwd=tmp_path,
        env=script_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "writing\n", proc.communicate(timeout=30)
        temporary = sorted(p.name for p in tmp_path.glob(".w.safetensors.*.tmp"))
        proc.send_signal(signum)
        assert proc.wait(timeout=30) == -signum
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.pid, temporary


def test_sigterm_removes_the_temporary_file(tmp_path: Path) -> None:
    pid, temporary = _writer_killed_by(tmp_path, signal.SIGTERM)
    assert len(temporary) == 1
    assert f".{pid}." in temporary[0]
    assert list(tmp_path.iterdir()) == []


def test_the_next_write_removes_what_a_killed_writer_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pid, temporary = _writer_killed_by(tmp_path, signal.SIGKILL)
    assert [p.name for p in tmp_path.glob(".w.safetensors.*.tmp")] == temporary  # SIGKILL: no clean-up
    host = temporary[0].split(".")[3]
    # a live process's temporary file is never touched, whatever its name, nor another host's
    live = tmp_path / f".x.safetensors.{host}.{os.getpid()}.abc.tmp"
    live.write_bytes(b"")
    elsewhere = tmp_path / f".w.safetensors.another-host.{pid}.abc.tmp"
    assert host != "another-host"
    elsewhere.write_bytes(b"")
    model = net(seed=1)
    # checkpoint names change every epoch: a write under another name cleans up as well
    with caplog.at_level(logging.WARNING, logger="lightning_mgpu._atomic"):
        export_state_dict(model, tmp_path / "epoch=1.safetensors")
    assert f"removed {tmp_path / temporary[0]}, left by an earlier write of w.safetensors" in caplog.text
    assert f"({pid}) was killed" in caplog.text
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["epoch=1.safetensors", live.name, elsewhere.name])
    assert_same(model.state_dict(), safetensors.torch.load_file(tmp_path / "epoch=1.safetensors"))
