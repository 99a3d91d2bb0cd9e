"""``mgpu_ddp`` on real gloo processes: same weights as one device, and no silent death or hang.

Every distributed run is a script in its own process group (Lightning's launcher re-runs
``sys.argv``). The fault tests read the script's output from a file and poll the group,
so they see when the last process is gone, not only the launching one.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MGPUDDPStrategy
from lightning_mgpu.devices import cpu_name
from lightning_mgpu.strategies.process_group.checks import check_devices
from tests.helpers import free_port, group_alive, kill_group, run_command, run_script, script_env

# A tiny regression fit. Rank 0 saves the data, the initial and the final weights, so the
# test can train the single-process reference on the same global batches.
FIT_SCRIPT = """
import sys, threading, torch, lightning as L
import lightning_mgpu
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

devices, num_nodes = int(sys.argv[1]), int(sys.argv[2])

class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen = getattr(self, "seen", []) + [x[:, 0].tolist()]
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

torch.manual_seed(0)
x, y = torch.randn(64, 4), torch.randn(64, 1)
model = Regression()
initial = {k: v.clone() for k, v in model.state_dict().items()}
trainer = L.Trainer(
    accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy="mgpu_ddp", max_epochs=2,
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False))
if trainer.is_global_zero:
    torch.save({"x": x, "y": y, "initial": initial, "final": model.state_dict()}, "result.pt")

# the user's shuffle=True still shuffles
x[:, 0] = torch.arange(64.0)
model = Regression()
trainer = L.Trainer(
    accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy="mgpu_ddp", max_steps=2,
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True))
# one file per rank: two processes printing to one pipe can interleave their lines
with open(f"shuffled_rank{trainer.global_rank}.txt", "w") as f:
    f.write(str(model.seen))
# nothing started for the runs outlives them
with open(f"threads_rank{trainer.global_rank}.txt", "w") as f:
    f.write("\\n".join(t.name for t in threading.enumerate()))

if sys.argv[3:] == ["unused"]:  # a last fit in which every rank fails the same way
    class Unused(Regression):
        def __init__(self):
            super().__init__()
            self.extra = nn.Linear(4, 1)

    trainer = L.Trainer(
        accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy="mgpu_ddp", max_steps=3,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Unused(), DataLoader(TensorDataset(x, y), batch_size=4))
"""


def reference_weights(result: dict) -> dict[str, torch.Tensor]:
    """One process, plain torch, batches of 8 = the two ranks' batches of 4 side by side."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model.load_state_dict({k.removeprefix("net."): v for k, v in result["initial"].items()})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        for start in range(0, 64, 8):
            x, y = result["x"][start : start + 8], result["y"][start : start + 8]
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return {f"net.{k}": v for k, v in model.state_dict().items()}


def assert_same_weights(result_file: Path) -> None:
    result = torch.load(result_file)
    expected = reference_weights(result)
    assert result["final"].keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(result["final"][name], value, atol=1e-6, rtol=0)
    # the comparison can fail: training moved the weights
    assert not torch.equal(result["final"]["net.0.weight"], result["initial"]["net.0.weight"])


def test_two_processes_match_one_and_keep_shuffle(tmp_path: Path) -> None:
    result = run_script(FIT_SCRIPT, tmp_path, args=["2", "1", "unused"], timeout=240)
    assert_same_weights(tmp_path / "result.pt")

    # the summary, once per fit (three), by rank 0 only
    assert result.output.count("mgpu_ddp: 1 node(s) x 2 process(es) per node = 2 process(es)") == 3
    assert "backend gloo, started by Lightning's launcher" in result.output
    assert f"rank 0 cpu {cpu_name()}, rank 1 cpu {cpu_name()}" in result.output
    assert "batch size: 4 per device, 8 global" in result.output

    # shuffle=True: neither rank sees its sequential share (0, 2, 4, 6 / 1, 3, 5, 7) first
    seen = [(tmp_path / f"shuffled_rank{rank}.txt").read_text() for rank in (0, 1)]
    assert all(s.startswith("[[") for s in seen), seen
    assert not seen[0].startswith("[[0.0, 2.0, 4.0, 6.0]")
    assert not seen[1].startswith("[[1.0, 3.0, 5.0, 7.0]")

    # the launching rank and the launched one: no watchdog thread once fit returned
    threads = [(tmp_path / f"threads_rank{rank}.txt").read_text().splitlines() for rank in (0, 1)]
    assert all("MainThread" in names for names in threads), threads
    assert not any("lightning-mgpu-watchdog" in names for names in threads), threads

    # the last fit fails on both ranks: one line each, and one traceback for the run, not one per rank
    assert result.returncode == 1, result.output
    output = result.output.split("mgpu_ddp: 1 node(s)")[-1]
    failed = "failed with RuntimeError: These parameters received no gradient in the previous training step:"
    first = re.search(rf"\[rank (\d)\] rank \1 \(pid \d+ on .+\) {failed} extra.weight, extra.bias.;", output)
    assert first is not None, output
    other = 1 - int(first.group(1))
    line = f"[rank {other}] failed the same way as rank {first.group(1)} (pid "
    assert line in output, output
    assert output.count("Traceback (most recent call last)") == 1, output


SPAWN_SCRIPT = """
import time, torch, lightning as L
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from lightning_mgpu import MGPUDDPStrategy
from lightning_mgpu.strategies.process_group.watchdog.watchdog import DEAD_AFTER, watchdog

class Slow(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        if batch_idx == 0:
            with open(f"rank{self.global_rank}.txt", "w") as f:
                f.write(str(watchdog().rank))
        time.sleep(0.1)
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

class Unused(Slow):
    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(4, 1)  # never reaches the loss

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

if __name__ == "__main__":
    steps = int((DEAD_AFTER + 4) / 0.1)  # longer than a missing heartbeat takes to be noticed
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=2)
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    strategy = MGPUDDPStrategy(start_method="spawn")
    L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, **quiet).fit(Slow(), loader)

    # the launching process holds an unwrapped model: the ranks must name the unused parameters
    strategy = MGPUDDPStrategy(start_method="spawn")
    try:
        L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, **quiet).fit(Unused(), loader)
    except Exception as error:
        with open("unused.txt", "w") as f:
            f.write(f"{type(error).__name__}: {error}")
"""


def test_spawned_ranks_are_watched_under_their_own_rank(tmp_path: Path) -> None:
    result = run_script(SPAWN_SCRIPT, tmp_path, timeout=240)
    assert result.returncode == 0, result.output[-3000:]
    assert "never sent a heartbeat" not in result.output
    assert "`max_steps=140` reached" in result.output
    assert [(tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)] == ["0", "1"]

    # the rank's error, explained in the rank, reaches the launching process with its traceback
    unused = (tmp_path / "unused.txt").read_text()
    assert "received no gradient in the previous training step: extra.weight, extra.bias.\n" in unused, unused
    assert "Traceback (most recent call last)" in unused
    assert "in training_step" in unused
    assert "Expected to have finished reduction" not in unused


def test_torchrun_two_nodes_match_one_process(tmp_path: Path) -> None:
    """Two torchrun "nodes" on loopback, one process each, started concurrently."""
    (tmp_path / "fit.py").write_text(textwrap.dedent(FIT_SCRIPT))
    port = free_port()
    env = script_env()
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}"]
        cmd += ["--master-addr=127.0.0.1", f"--master-port={port}", "--nproc-per-node=1", "fit.py", "1", "2"]
        out = open(tmp_path / f"node{node}.txt", "w")  # noqa: SIM115  closed below
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
        procs.append((proc, out))
    try:
        codes = [proc.wait(timeout=240) for proc, _ in procs]
    finally:
        for proc, out in procs:
            proc.kill()
            out.close()
    logs = [(tmp_path / f"node{n}.txt").read_text() for n in range(2)]
    assert codes == [0, 0], logs
    assert_same_weights(tmp_path / "result.pt")
    assert "mgpu_ddp: 2 node(s) x 1 process(es) per node = 2 process(es)" in logs[0]
    assert "started by torchrun" in logs[0]


# A run in which one rank fails at batch 5 of 64: it dies (SIGKILL, os._exit) or stalls; or it gets
# two batches more than the others ("more"), or fails after the last collective ("end").
FAULT_SCRIPT = """
import os, sys, signal, time, torch, lightning as L
from lightning_mgpu import MGPUDDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

victim, fault = int(sys.argv[1]), sys.argv[2]
stall_timeout = None if sys.argv[3] == "none" else float(sys.argv[3])

def stall_forever():
    while True:
        time.sleep(0.1)

class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        if fault not in ("more", "end") and batch_idx == 5 and self.global_rank == victim:
            open("fault_at", "w").write(f"{time.time()} {os.getpid()}")
            if fault == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "exit":
                os._exit(7)
            if fault == "raise":
                raise RuntimeError("the database connection timed out")
            stall_forever()
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if fault == "more" and batch_idx == 5 and self.global_rank == victim:  # the others' last batch
            open("fault_at", "w").write(f"{time.time()} {os.getpid()}")

    def on_train_end(self):
        if fault == "end" and self.global_rank == victim:
            open("fault_at", "w").write(f"{time.time()} {os.getpid()}")
            raise RuntimeError("saving the report failed")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

class Shard(torch.utils.data.IterableDataset):
    def __iter__(self):
        batches = 8 if int(os.environ.get("LOCAL_RANK", 0)) == victim else 6
        return iter(TensorDataset(torch.randn(4 * batches, 4), torch.randn(4 * batches, 1)))

trainer = L.Trainer(
    accelerator="cpu", devices=2, strategy=MGPUDDPStrategy(stall_timeout=stall_timeout), max_epochs=1,
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
data = Shard() if fault == "more" else TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
trainer.fit(Regression(), DataLoader(data, batch_size=4))
"""


def survivor_says(rank: int, reason: str, output: str) -> bool:
    """Whether ``rank`` stopped naming ``reason``: in its exception, or from its watchdog."""
    return any(f"[rank {rank}] {says} {reason}" in output for says in ("stopped because", "lightning_mgpu:"))


class FaultRun:
    """FAULT_SCRIPT in its own process group, output to a file, watched until the group is gone."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.tmp_path = tmp_path
        (tmp_path / "fault.py").write_text(textwrap.dedent(FAULT_SCRIPT))
        self.out = open(tmp_path / "out.txt", "w")  # noqa: SIM115  closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "fault.py", *args],
            cwd=tmp_path,
            env=script_env(),
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_for_fault(self, timeout: float = 180) -> tuple[float, int]:
        """Time and pid the victim wrote down just before its fault."""
        marker = self.tmp_path / "fault_at"
        deadline = time.monotonic() + timeout
        while not (marker.exists() and marker.read_text()):
            assert time.monotonic() < deadline, f"no fault within {timeout} s:\n{self.output}"
            assert group_alive(self.proc.pid), f"the run ended before its fault:\n{self.output}"
            time.sleep(0.2)
        when, pid = marker.read_text().split()
        return float(when), int(pid)

    def seconds_until_gone(self, since: float, bound: float) -> float:
        """Seconds from ``since`` until no process of the run is left (the launcher stays a zombie)."""
        while group_alive(self.proc.pid):
            assert time.time() - since < bound, f"processes left {bound} s after the fault:\n{self.output}"
            time.sleep(0.2)
        return time.time() - since

    @property
    def output(self) -> str:
        self.out.flush()
        return (self.tmp_path / "out.txt").read_text()

    def close(self) -> None:
        kill_group(self.proc.pid)
        self.proc.wait()
        self.out.close()


@pytest.fixture
def fault_run(tmp_path: Path):
    runs: list[FaultRun] = []

    def start(*args: str) -> FaultRun:
        runs.append(FaultRun(tmp_path, *args))
        return runs[-1]

    yield start
    for run in runs:
        run.close()


@pytest.mark.parametrize(
    ("victim", "fault", "reported"),
    [
        # rank 0 launched rank 1: rank 1 reads its exit status while it is a zombie
        (0, "sigkill", "rank 0 (pid {pid}, which launched this rank) was killed by signal 9 (SIGKILL)"),
        # rank 1 is a child of rank 0, whose watchdog polls it
        (1, "sigkill", "rank 1 (pid {pid}) was killed by signal 9 (SIGKILL)"),
    ],
    ids=["rank0-killed", "rank1-killed"],
)
def test_a_dead_rank_stops_every_rank_and_is_named(fault_run, victim: int, fault: str, reported: str) -> None:
    run = fault_run(str(victim), fault, "300")
    fault_at, pid = run.wait_for_fault()
    run.seconds_until_gone(fault_at, bound=30)
    output = run.output
    # the surviving rank's error leads with the reason, before gloo's "Connection reset by peer"
    assert survivor_says(1 - victim, reported.format(pid=pid), output), output
    assert run.proc.wait() == (-signal.SIGKILL if victim == 0 else 1)


def test_an_error_of_the_users_code_is_named_at_once(fault_run) -> None:
    # its words ("connection", "timed out") are not a lost peer: no waiting for a verdict on one
    run = fault_run("1", "raise", "300")
    fault_at, _ = run.wait_for_fault()
    seconds = run.seconds_until_gone(fault_at, bound=60)
    output = run.output
    assert "RuntimeError: the database connection timed out" in output
    assert survivor_says(0, "rank 1", output), output
    assert seconds < 11, (seconds, output)  # a verdict is awaited for 12 s
    # one line per rank, then one traceback for the run: the failed rank's, not rank 0's echo of it
    failed = "failed with RuntimeError: the database connection timed out"
    assert re.search(rf"\[rank 1\] rank 1 \(pid \d+ on .+\) {failed}; its traceback follows:", output), output
    assert output.count("Traceback (most recent call last)") == 1, output
    assert "Rank 1 prints the traceback." in output, output


def test_a_stalled_rank_is_named_and_prints_its_stack(fault_run) -> None:
    run = fault_run("1", "stall", "10")
    stalled_at, pid = run.wait_for_fault()
    seconds = run.seconds_until_gone(stalled_at, bound=60)
    output = run.output
    assert seconds >= 10, output  # not before stall_timeout
    assert f"rank 1 (pid {pid} on " in output
    assert "stalled: no progress for" in output
    assert "while rank 0 waited for it in a collective (stall_timeout=10)" in output
    stack = output.split("[rank 1] this rank is stuck here")[1]
    assert "in stall_forever" in stack.split("[rank 1] stopping")[0]
    assert survivor_says(0, f"rank 1 (pid {pid} on ", output), output


@pytest.mark.parametrize("victim", [0, 1], ids=["rank0-more", "rank1-more"])
def test_a_rank_with_more_batches_fails_the_run_with_the_reason(fault_run, victim: int) -> None:
    # Lightning's launcher let rank 0 end with exit code 0 while rank 1 hung or failed after it
    run = fault_run(str(victim), "more", "300")
    fault_at, _ = run.wait_for_fault()
    run.seconds_until_gone(fault_at, bound=40)  # not stall_timeout (300 s), nor gloo's 30 min
    output = run.output
    finished = f"rank {1 - victim} has already finished the run. The ranks ran different numbers of steps"
    assert finished in output, output
    if victim == 1:
        # rank 0 destroys its process group as it exits, so rank 1's collective fails at once and its
        # error says why; a rank 1 that is not inside a collective then learns it from its watchdog
        assert (
            "[rank 1] stopped because rank 0 has already finished the run" in output
            or "[rank 1] lightning_mgpu: rank 1 waited 10 s in a collective that will never" in output
        ), output
        assert "[rank 0] lightning_mgpu: the run failed after this rank ended: rank 1 (pid " in output
    else:
        assert survivor_says(0, finished, output), output
    assert run.proc.wait() == 1


def test_a_rank_that_fails_after_the_last_collective_fails_the_command(fault_run) -> None:
    run = fault_run("1", "end", "300")
    _, pid = run.wait_for_fault()
    assert run.proc.wait(timeout=60) == 1, run.output
    assert "RuntimeError: saving the report failed" in run.output
    ended = f"the run failed after this rank ended: rank 1 (pid {pid}) exited with code 1"
    assert f"[rank 0] lightning_mgpu: {ended}" in run.output, run.output


def test_sigterm_ends_a_stalled_run_within_seconds(fault_run) -> None:
    run = fault_run("1", "stall", "none")
    run.wait_for_fault()
    time.sleep(2)  # rank 0 is now blocked in the gradient all-reduce
    sent = time.time()
    os.kill(run.proc.pid, signal.SIGTERM)
    seconds = run.seconds_until_gone(sent, bound=20)
    assert seconds < 20
    reason = f"rank 0 (pid {run.proc.pid}) received SIGTERM"
    assert f"[rank 0] lightning_mgpu: {reason}" in run.output
    assert f"[rank 1] lightning_mgpu: {reason}" in run.output  # the stuck rank heard it too


# ---------------------------------------------------------------- in-process checks


def test_registered_names_and_their_arguments() -> None:
    assert StrategyRegistry["mgpu_ddp"]["strategy"] is MGPUDDPStrategy
    entry = StrategyRegistry["mgpu_ddp_find_unused_parameters_true"]
    assert entry["strategy"] is MGPUDDPStrategy
    assert entry["init_params"] == {"find_unused_parameters": True}
    strategy = StrategyRegistry.get("mgpu_ddp_find_unused_parameters_true")
    assert strategy._ddp_kwargs == {"find_unused_parameters": True}


def test_every_ddp_argument_still_works() -> None:
    strategy = MGPUDDPStrategy(
        process_group_backend="gloo",
        timeout=timedelta(seconds=42),
        start_method="spawn",
        find_unused_parameters=True,
        static_graph=False,
        stall_timeout=30,
    )
    assert strategy.process_group_backend == "gloo"
    assert strategy._timeout == timedelta(seconds=42)
    assert strategy._start_method == "spawn"
    assert strategy._ddp_kwargs == {"find_unused_parameters": True, "static_graph": False}
    assert strategy.stall_timeout == 30.0
    assert MGPUDDPStrategy(stall_timeout=None).stall_timeout is None


@pytest.mark.parametrize("bad", [0, -5, "60", True])
def test_stall_timeout_must_be_positive_seconds(bad: object) -> None:
    with pytest.raises(ValueError, match=r"stall_timeout must be a positive number of seconds or None .*got"):
        MGPUDDPStrategy(stall_timeout=bad)  # type: ignore[arg-type]


def test_backend_follows_the_device_and_an_explicit_choice_wins() -> None:
    cpu = MGPUDDPStrategy(parallel_devices=[torch.device("cpu")] * 2)
    assert cpu._get_process_group_backend() == "gloo"
    cuda = MGPUDDPStrategy(parallel_devices=[torch.device("cuda", 0)])
    assert cuda._get_process_group_backend() == ("nccl" if torch.distributed.is_nccl_available() else "gloo")
    explicit = MGPUDDPStrategy(parallel_devices=[torch.device("cpu")], process_group_backend="mpi")
    assert explicit._get_process_group_backend() == "mpi"


def _trainer(**kwargs: object) -> L.Trainer:
    quiet = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    return L.Trainer(**quiet, **kwargs)  # type: ignore[arg-type]


def test_unknown_backend_fails_inside_trainer_with_the_available_ones() -> None:
    match = r"process_group_backend='glooo' is not available .* available here: gloo"
    with pytest.raises(ValueError, match=match):
        _trainer(accelerator="cpu", devices=2, strategy=MGPUDDPStrategy(process_group_backend="glooo"))


@pytest.mark.skipif(torch.distributed.is_nccl_available(), reason="this torch build has NCCL")
def test_nccl_without_nccl_fails_inside_trainer() -> None:
    match = r"process_group_backend='nccl' is not available in this torch build"
    with pytest.raises(ValueError, match=match):
        _trainer(accelerator="cpu", devices=2, strategy=MGPUDDPStrategy(process_group_backend="nccl"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_that_does_not_exist_lists_what_exists() -> None:
    # Trainer refuses CUDA devices here before the strategy sees them; the check itself
    # is the one a GPU machine runs inside Trainer(...) (see the gpu tests below)
    os.environ["CUDA_VISIBLE_DEVICES"] = "2,5"
    match = r"devices cuda:0, cuda:3 do not exist: no CUDA device is visible \(CUDA_VISIBLE_DEVICES=2,5"
    with pytest.raises(ValueError, match=match):
        check_devices([torch.device("cuda", 0), torch.device("cuda", 3)], None)


class TwoHeads(L.LightningModule):
    """A model whose ``unused`` head never reaches the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(2, 1)
        self.unused = nn.Linear(2, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.used(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TwoBackwards(TwoHeads):
    """Manual optimization: the first backward of each step leaves ``unused`` out."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        assert isinstance(optimizer, L.pytorch.core.optimizer.LightningOptimizer)
        self.manual_backward(nn.functional.mse_loss(self.used(batch[0]), batch[1]))
        self.manual_backward(nn.functional.mse_loss(self.unused(batch[0]), batch[1]))
        optimizer.step()
        optimizer.zero_grad()


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(16, 2), torch.randn(16, 1)), batch_size=4)


def _watchdog_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "lightning-mgpu-watchdog"]


def test_unused_parameters_are_named_with_both_fixes() -> None:
    # DDP's reducer raises this in a one-process group too; "auto" picks one CPU device
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    trainer = _trainer(accelerator="cpu", devices="auto", strategy="mgpu_ddp", max_steps=3)
    with pytest.raises(RuntimeError) as error:
        trainer.fit(TwoHeads(), _loader())
    message = str(error.value)
    assert "received no gradient in the previous training step: unused.weight, unused.bias." in message
    assert 'Trainer(strategy="mgpu_ddp_find_unused_parameters_true")' in message
    assert "MGPUDDPStrategy(find_unused_parameters=True)" in message
    assert "change the model" in message
    assert "Expected to have finished reduction" not in message

    # under manual optimization the previous backward can be one of the same step
    trainer = _trainer(accelerator="cpu", devices="auto", strategy="mgpu_ddp", max_steps=3)
    with pytest.raises(RuntimeError) as error:
        trainer.fit(TwoBackwards(), _loader())
    message = str(error.value)
    backward = "an earlier manual_backward of this training step, or the last one of the previous step"
    assert f"received no gradient in the previous backward pass ({backward}): unused.weight," in message
    assert "use these parameters in every loss you pass to manual_backward" in message

    # the first fix works, and nothing started for the run outlives it
    strategy = "mgpu_ddp_find_unused_parameters_true"
    trainer = _trainer(accelerator="cpu", devices="auto", strategy=strategy, max_steps=3)
    trainer.fit(TwoHeads(), _loader())
    assert trainer.world_size == 1
    assert trainer.global_step == 3
    assert _watchdog_threads() == []


class _StringDevices(CPUAccelerator):
    """An accelerator that lists its devices as strings, as some custom accelerators do."""

    @staticmethod
    def get_parallel_devices(devices: int | str | list[int]) -> list[str]:  # type: ignore[override]
        return ["cpu"] * int(devices) if not isinstance(devices, list) else ["cpu"] * len(devices)


def test_devices_that_are_not_torch_devices_are_left_to_their_accelerator() -> None:
    # Lightning's DDPStrategy takes them inside Trainer(...); so must mgpu_ddp and mgpu_auto
    for strategy in ("ddp", "mgpu_ddp", "mgpu_auto"):
        trainer = _trainer(accelerator=_StringDevices(), devices=2, strategy=strategy)
        assert trainer.strategy.parallel_devices == ["cpu", "cpu"]
    assert type(trainer.strategy) is MGPUDDPStrategy
    check_devices(["cpu", object(), torch.device("cpu")], "gloo")


def test_sync_batchnorm_on_cpu_fails_inside_trainer() -> None:
    # torch's SyncBatchNorm refuses CPU tensors; found in Trainer(...), not in every started rank
    match = r"sync_batchnorm=True needs GPUs: .* on cpu devices\. Train on GPUs"
    with pytest.raises(ValueError, match=match):
        _trainer(accelerator="cpu", devices=2, strategy="mgpu_ddp", sync_batchnorm=True)
    _trainer(accelerator="cpu", devices=2, strategy="mgpu_ddp")  # without it, the same Trainer is fine


# ----------------------------------------------------------------------- GPU only


@pytest.mark.gpu
def test_nccl_on_cuda_devices() -> None:
    strategy = MGPUDDPStrategy(parallel_devices=[torch.device("cuda", 0)])
    assert strategy._get_process_group_backend() == "nccl"


@pytest.mark.gpu
def test_a_missing_cuda_index_lists_the_visible_devices() -> None:
    count = torch.cuda.device_count()
    strategy = MGPUDDPStrategy(parallel_devices=[torch.device("cuda", 0), torch.device("cuda", count)])
    match = rf"cuda:{count} do not exist: {count} CUDA device\(s\) visible.*cuda:0 "
    with pytest.raises(ValueError, match=match):
        _trainer(accelerator="gpu", devices=1, strategy=strategy)


@pytest.mark.gpu
def test_a_device_chosen_twice_fails() -> None:
    match = r"each device may appear once, got \['cuda:0', 'cuda:0'\]: .*cuda:0 "
    with pytest.raises(ValueError, match=match):
        check_devices([torch.device("cuda", 0), torch.device("cuda", 0)], None)


@pytest.mark.gpu
def test_nccl_for_cpu_devices_fails_inside_trainer() -> None:
    match = r"process_group_backend='nccl' needs CUDA devices, but this run uses cpu"
    with pytest.raises(ValueError, match=match):
        _trainer(accelerator="cpu", devices=2, strategy=MGPUDDPStrategy(process_group_backend="nccl"))


@pytest.mark.gpu
def test_summary_names_the_physical_gpu(tmp_path: Path) -> None:
    code = """
    import torch, lightning as L
    import lightning_mgpu
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(2, 1)
        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(accelerator="gpu", devices=[0], strategy="mgpu_ddp", max_steps=1, logger=False)
    trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(8, 2), torch.randn(8, 1)), batch_size=4))
    """
    last = str(torch.cuda.device_count() - 1)
    env = script_env(CUDA_VISIBLE_DEVICES=last)
    result = run_command([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env, timeout=180)
    assert result.returncode == 0, result.output
    assert "backend nccl" in result.output
    assert f"rank 0 cuda:0 {torch.cuda.get_device_name(int(last))} (physical GPU {last})" in result.output
