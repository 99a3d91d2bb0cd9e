"""Run real scripts in real processes: how the distributed tests start DDP.

Lightning's launcher re-runs ``sys.argv`` for every extra rank, so a DDP fit cannot
start inside the pytest process; each test writes a script and runs it here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"  # the multi-process scripts, real files that ruff and mypy check


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def script_env(**extra: str) -> dict[str, str]:
    """The test's environment with a fresh MASTER_PORT and no inherited rank variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    # on a machine with SLURM installed (a cluster's login node), Lightning warns in every process not
    # started by srun; the tests that compare a command's exact output run outside SLURM on purpose
    srun_hint = "ignore:The `srun` command is available on your system but is not used"
    env["PYTHONWARNINGS"] = ",".join(filter(None, [env.get("PYTHONWARNINGS", ""), srun_hint]))
    env.update(extra)
    return env


def run_script(
    code: str,
    tmp_path: Path,
    *,
    args: list[str] | None = None,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    name: str = "script.py",
) -> Result:
    """Write ``code`` to ``tmp_path/name`` and run it with this interpreter in its own process group.

    The whole group is killed afterwards, so a test never leaves a process behind;
    ``timeout`` raises ``subprocess.TimeoutExpired`` after the kill.
    """
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return run_command([sys.executable, str(path), *(args or [])], cwd=tmp_path, timeout=timeout, env=env)


def run_file(
    name: str,
    tmp_path: Path,
    *,
    args: list[str] | None = None,
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> Result:
    """Run tests/scripts/``name`` with this interpreter in ``tmp_path``, in its own process group."""
    return run_command(
        [sys.executable, str(SCRIPTS / name), *(args or [])], cwd=tmp_path, timeout=timeout, env=env
    )


def run_command(
    cmd: list[str], *, cwd: Path, timeout: float = 120, env: dict[str, str] | None = None
) -> Result:
    """Run ``cmd`` in its own process group; kill the group when it ends or times out."""
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env if env is not None else script_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        proc.communicate()
        raise
    finally:
        kill_group(proc.pid)
    return Result(proc.returncode, out, err, time.monotonic() - start)


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def group_alive(pgid: int) -> bool:
    """Whether any process of the group is still running (zombies excluded)."""
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            stat = (pid_dir / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
