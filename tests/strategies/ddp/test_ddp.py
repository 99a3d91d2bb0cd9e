"""``mgpu_ddp`` on real gloo processes: same weights as one device, and no silent death or hang.

Every distributed run is a script of tests/scripts/ in its own process group (Lightning's launcher
re-runs ``sys.argv``). The runs with a failing rank are in ``test_faults.py``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from lightning_mgpu.devices import cpu_name
from tests.helpers import SCRIPTS, free_port, run_file, script_env


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
    result = run_file("ddp_fit.py", tmp_path, args=["2", "1", "unused"], timeout=240)
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


def test_spawned_ranks_are_watched_under_their_own_rank(tmp_path: Path) -> None:
    result = run_file("ddp_spawn.py", tmp_path, timeout=240)
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
    port = free_port()
    env = script_env()
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}"]
        cmd += ["--master-addr=127.0.0.1", f"--master-port={port}", "--nproc-per-node=1"]
        cmd += [str(SCRIPTS / "ddp_fit.py"), "1", "2"]
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
