"""A one-node SLURM cluster on this machine: munged, slurmctld and slurmd, started and stopped here.

Everything lives in one temporary folder (munge key and socket, ``slurm.conf``, state, spool,
logs), the daemons use ports chosen at start-up, and the client commands find the cluster
through ``SLURM_CONF`` in the environment that :meth:`SlurmCluster.env` returns, never in
``os.environ``. Debian's ``slurm-wlm`` and ``munge`` are installed with apt when missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import free_port, script_env

DAEMONS = ("munged", "slurmctld", "slurmd")
PACKAGES = ("slurm-wlm", "munge")


class SlurmUnavailable(RuntimeError):
    """SLURM cannot be installed or started here; the message says why."""


def install_packages() -> None:
    """Install Debian's slurm-wlm and munge when one of their daemons is missing."""
    if all(shutil.which(d) for d in DAEMONS):
        return
    missing = ", ".join(d for d in DAEMONS if not shutil.which(d))
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"{', '.join(PACKAGES)} are not installed and installing them needs root")
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"{', '.join(PACKAGES)} are not installed and there is no apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    for attempt in (install, ["apt-get", "update", "-q"], install):
        done = subprocess.run(attempt, env=env, capture_output=True, text=True, timeout=400)
        if done.returncode == 0 and attempt is install:
            if all(shutil.which(d) for d in DAEMONS):
                return
            raise SlurmUnavailable(f"{missing} not found on PATH after apt-get install {' '.join(PACKAGES)}")
    output = done.stdout[-2000:] + done.stderr
    raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed:\n{output}")


@dataclass
class SlurmCluster:
    """The daemons of a one-node cluster with ``cpus`` CPUs, and the commands that use it."""

    root: Path
    cpus: int = 2
    node: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    daemons: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def env(self, **extra: str) -> dict[str, str]:
        """The test environment (see ``script_env``) pointed at this cluster, without any job's SLURM_*."""
        job_variables = ("SLURM_", "SBATCH_", "SRUN_")
        env = {k: v for k, v in script_env(**extra).items() if not k.startswith(job_variables)}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def start(self, timeout: float = 60) -> None:
        """Write the key and config, start the three daemons, wait until the node is idle.

        Raises:
            SlurmUnavailable: a daemon could not start or exited, or the node did not become idle.
        """
        self._write_config()
        munge = ["munged", "-F", "-f", f"--key-file={self.root / 'munge.key'}", f"--socket={self._socket}"]
        munge += [f"--pid-file={self.root / 'munged.pid'}", f"--log-file={self.root / 'munged.log'}"]
        munge += [f"--seed-file={self.root / 'munged.seed'}"]
        self._daemon("munged", munge)
        self._wait(lambda: self._socket.exists(), timeout, "munged made no socket")
        self._daemon("slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", str(self.conf)])
        self._daemon("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.node])
        self._wait(lambda: self.node_state() == "idle", timeout, "the node never became idle")

    def stop(self) -> None:
        """Cancel every job, then stop the daemons and every process slurmd started, whatever their state."""
        if "slurmctld" in self.daemons:
            cancel = ["scancel", "--full", "--user=root"]
            subprocess.run(cancel, env=self.env(), capture_output=True, timeout=30)
            with contextlib.suppress(SlurmUnavailable):
                self._wait(lambda: not self.squeue(), 30, "jobs left")
        steps = descendants(self.daemons["slurmd"].pid) if "slurmd" in self.daemons else []
        for name in reversed(DAEMONS):
            proc = self.daemons.pop(name, None)
            if proc is None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in steps:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def node_state(self) -> str:
        cmd = ["sinfo", "-h", "-N", "-o", "%t"]
        done = subprocess.run(cmd, env=self.env(), capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    def squeue(self, job_id: str | None = None) -> list[str]:
        """``JOBID STATE`` lines of the jobs still known to the controller."""
        cmd = ["squeue", "-h", "-o", "%i %T", *([f"--jobs={job_id}"] if job_id else [])]
        done = subprocess.run(cmd, env=self.env(), capture_output=True, text=True)
        return done.stdout.split("\n")[:-1] if done.returncode == 0 else []

    def sbatch(
        self, script: Path, *options: str, args: tuple[str, ...] = (), env: dict[str, str] | None = None
    ) -> str:
        """Submit ``script`` (with ``args``) from its folder; returns the job id."""
        cmd = ["sbatch", "--parsable", f"--chdir={script.parent}", *options, str(script), *args]
        done = subprocess.run(cmd, env=env or self.env(), capture_output=True, text=True, cwd=script.parent)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """What ``scontrol show job`` says (``JobState``, ``Restarts``, ...); empty once it is forgotten."""
        cmd = ["scontrol", "show", "job", job_id, "--oneliner"]
        done = subprocess.run(cmd, env=self.env(), capture_output=True, text=True)
        return dict(kv.split("=", 1) for kv in done.stdout.split() if "=" in kv)

    def job_state(self, job_id: str) -> str:
        return self.job(job_id).get("JobState", "GONE")

    def wait_job(self, job_id: str, timeout: float) -> str:
        """Wait until the job has ended (not pending, running, requeued...); return its last state."""
        ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "GONE")
        self._wait(lambda: self.job_state(job_id) in ended, timeout, f"job {job_id} did not end")
        return self.job_state(job_id)

    @property
    def _socket(self) -> Path:
        return self.root / "munge.socket"

    def _daemon(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / f"{name}.out", "wb")  # noqa: SIM115  the daemon holds it
        try:
            self.daemons[name] = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True
            )
        except OSError as error:
            raise SlurmUnavailable(f"{name} could not start: {error}") from error
        finally:
            log.close()

    def _wait(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, proc in self.daemons.items():
                if proc.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited with {proc.returncode}:\n{self.logs(name)}")
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"{what} within {timeout} s:\n{self.logs()}")
            time.sleep(0.2)

    def logs(self, *names: str) -> str:
        """The last lines each daemon wrote."""
        parts = []
        for name in names or DAEMONS:
            for path in (self.root / f"{name}.out", self.root / f"{name}.log"):
                if path.exists():
                    parts.append(f"--- {path.name}\n" + "\n".join(path.read_text().splitlines()[-20:]))
        return "\n".join(parts)

    def _write_config(self) -> None:
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for folder in ("state", "spool"):
            (self.root / folder).mkdir()
        memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 // 2
        settings = {
            "ClusterName": "mgpu",
            "SlurmctldHost": f"{self.node}(127.0.0.1)",
            "SlurmctldPort": free_port(),
            "SlurmdPort": free_port(),
            "SlurmUser": "root",
            "SlurmdUser": "root",
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            "AuthInfo": f"socket={self._socket},cred_expire=10",  # a requeued job waits this long
            "StateSaveLocation": self.root / "state",
            "SlurmdSpoolDir": self.root / "spool",
            "SlurmctldPidFile": self.root / "slurmctld.pid",
            "SlurmdPidFile": self.root / "slurmd.pid",
            "SlurmctldLogFile": self.root / "slurmctld.log",
            "SlurmdLogFile": self.root / "slurmd.log",
            "ProctrackType": "proctrack/pgid",  # no cgroup in containers
            "TaskPlugin": "task/none",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_CPU",
            "SchedulerType": "sched/builtin",
            "MpiDefault": "none",
            "ReturnToService": 2,
            "JobRequeue": 1,
            "MinJobAge": 30,  # seconds a finished job stays visible to scontrol
            "KillWait": 5,
            "MessageTimeout": 30,
            "AccountingStorageType": "accounting_storage/none",
            "JobAcctGatherType": "jobacct_gather/none",
            "JobCompType": "jobcomp/none",
            "SlurmdParameters": "config_overrides",
        }
        lines = [f"{k}={v}" for k, v in settings.items()]
        node = (
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={memory_mb} State=UNKNOWN"
        )
        lines.append(node)
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@contextlib.contextmanager
def slurm_cluster(cpus: int = 2) -> Iterator[SlurmCluster]:
    """Install, start, yield a :class:`SlurmCluster`; stop it whatever happened."""
    install_packages()
    root = Path(tempfile.mkdtemp(prefix="mgpu-slurm-"))
    root.chmod(0o755)
    cluster = SlurmCluster(root, cpus=cpus)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
