"""DeviceTimeMonitor in real processes: a rank slowed in its Dataset or its training_step is named with
that phase, a balanced run names none, each phase holds the sleeps made in it, and the table's seconds
match what clocks outside the monitor measured over the same stretches.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO, run_script

SCRIPT = (REPO / "tests" / "callbacks" / "time_fits.py").read_text()
pytestmark = pytest.mark.slow


def fits(tmp_path: Path, strategy: str, devices: int, *modes: str) -> tuple[dict[str, Any], str]:
    """Run the fits in one launch; mode -> {"summary": rank 0's time_summary.json, "outside": per rank}."""
    result = run_script(
        SCRIPT, tmp_path, args=[str(tmp_path / "logs"), strategy, str(devices), *modes], timeout=600
    )
    assert result.returncode == 0, result.output[-3000:]
    found: dict[str, Any] = {}
    for match in re.finditer(r"OUTSIDE (\{[^{}]*\})", result.stdout):
        outside = json.loads(match.group(1))
        entry = found.setdefault(outside["mode"], {"outside": {}})
        entry["outside"][outside["rank"]] = outside
        if outside["rank"] == 0:
            entry["summary"] = json.loads((Path(outside["log_dir"]) / "time_summary.json").read_text())
            entry["log_dir"] = outside["log_dir"]
    assert sorted(found) == sorted(modes), result.stdout[-3000:]
    assert all(len(entry["outside"]) == devices_of(strategy, devices) for entry in found.values())
    return found, result.output


def devices_of(strategy: str, devices: int) -> int:
    """How many processes print: mgpu_dp's replicas are threads of one."""
    return 1 if strategy == "mgpu_dp" else devices


def within_10_percent(measured: float, outside: float) -> None:
    """The same stretch of time, measured by the monitor and by a clock outside it."""
    assert measured == pytest.approx(outside, rel=0.10)


def holds_the_sleep(measured: float, slept: float) -> None:
    """A phase holds the sleep made in it, and the computation beside it, which a loaded machine slows."""
    assert measured >= 0.99 * slept, (measured, slept)


def check_totals(run: dict[str, Any], steps: int, samples: int) -> None:
    """Every rank's steps, samples and seconds as counted outside the monitor."""
    for row in run["summary"]["ranks"]:
        assert (row["steps"], row["samples"]) == (steps, samples)
        seconds = row["data_s"] + row["work_s"] + (row["wait_s"] or 0.0)
        within_10_percent(seconds, run["outside"][row["rank"]]["seconds"])


def check_straggler(run: dict[str, Any], slept: str, phase: str) -> None:
    """Rank 1 slept in ``slept`` ("data" or "work"): named with ``phase``; rank 0 waited as long."""
    rank0, rank1 = run["summary"]["ranks"]
    seconds = run["outside"][1][slept]
    assert run["summary"]["verdict"]["rank"] == 1
    assert run["summary"]["verdict"]["phase"] == phase
    holds_the_sleep(rank1[f"{slept}_s"], seconds)
    # in the collectives, for rank 1: at least its sleep. At most everything rank 1 did meanwhile: its sleep,
    # its work (which slows with the machine's load) and its own time in the collectives, where the two
    # ranks wait together while the transfer itself runs
    most = seconds + rank1["work_s"] + rank1["wait_s"]
    assert 0.9 * seconds <= rank0["wait_s"] <= most, (rank0["wait_s"], seconds, dict(rank1))
    check_totals(run, steps=32, samples=128)


def test_ddp_data_and_work_stragglers_named_balanced_run_not(tmp_path: Path) -> None:
    runs, output = fits(tmp_path, "mgpu_ddp", 2, "data", "work", "even")

    check_straggler(runs["data"], "data", "data loading")
    check_straggler(runs["work"], "work", "work")

    even = runs["even"]
    assert even["summary"]["verdict"]["rank"] is None
    for row in even["summary"]["ranks"]:
        outside = even["outside"][row["rank"]]
        holds_the_sleep(row["work_s"], outside["work"])
        within_10_percent(row["work_s"] + row["wait_s"], outside["steps_s"])
        assert row["wait_share"] < 0.2
    check_totals(even, steps=32, samples=128)

    # rank 0 prints the table and the verdict once per fit
    assert output.count("Time per rank over the fit:") == 3
    assert "Time: rank 1 (cpu:rank1) is" in output
    assert "loses the time in data loading. Try: give the DataLoader more workers" in output
    assert "Time: balanced, no rank holds the others back" in output

    # the monitor opens nothing per fit that outlives it: after each later fit the process holds no more
    # files (sockets included) than after the first
    for rank in (0, 1):
        first, *later = [runs[mode]["outside"][rank]["open_files"] for mode in ("data", "work", "even")]
        assert all(n <= first for n in later), (first, later)

    # every rank's window means reach rank 0's logger, each flush at its own step
    with open(Path(even["log_dir"]) / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("time/samples_per_s")]
    assert len(rows) == 11  # 32 batches, flushed every 3 and at the end
    for rank in (0, 1):
        for key in ("data_ms", "work_ms", "wait_ms", "samples_per_s"):
            assert all(float(row[f"time/rank{rank}/{key}"]) >= 0 for row in rows)
    assert all(float(row["time/rank1/work_ms"]) > 75 for row in rows)  # 100 ms slept per batch


def test_fsdp_data_and_work_stragglers_named_waiting_measured(tmp_path: Path) -> None:
    """Under mgpu_fsdp the other rank waits inside FSDP's gathers: measured there, as DDP's all-reduce."""
    runs, output = fits(tmp_path, "mgpu_fsdp", 2, "data", "work")
    check_straggler(runs["data"], "data", "data loading")
    check_straggler(runs["work"], "work", "work")
    assert "not measured" not in output
    assert "loses the time in work. Try: look at what else runs on rank 1's CPU cores" in output


def test_one_device_and_mgpu_dp_one_row_per_process(tmp_path: Path) -> None:
    runs, _ = fits(tmp_path, "auto", 1, "data0")
    (row,) = runs["data0"]["summary"]["ranks"]
    verdict = runs["data0"]["summary"]["verdict"]
    assert (verdict["rank"], verdict["phase"]) == (0, "data loading")  # most of its time waits for batches
    holds_the_sleep(row["data_s"], runs["data0"]["outside"][0]["data"])
    assert row["wait_s"] is None
    check_totals(runs["data0"], steps=64, samples=256)

    runs, output = fits(tmp_path, "mgpu_dp", 2, "even")
    (row,) = runs["even"]["summary"]["ranks"]  # the replicas are threads of this one process
    assert row["device"] == "cpu:replica0,cpu:replica1"
    assert "Rank 0 runs 2 mgpu_dp replicas in one process: they run each batch together" in output
    assert runs["even"]["summary"]["verdict"]["rank"] is None
    # each batch's two halves sleep at the same time, in the replicas' two threads: the row holds each
    # batch's sleep once (half the replicas' sum) with the step's own computation, as the clock outside
    # measured the steps, and those took less than the whole sum, which one replica after the other would
    outside = runs["even"]["outside"][0]
    holds_the_sleep(row["work_s"], outside["work"] / 2)
    within_10_percent(row["work_s"], outside["steps_s"])
    assert outside["steps_s"] < outside["work"], outside
    check_totals(runs["even"], steps=64, samples=256)


def test_a_failing_rank_ends_the_run_as_without_the_monitor(tmp_path: Path) -> None:
    args = [str(tmp_path / "logs"), "mgpu_ddp", "2", "fail"]
    result = run_script(SCRIPT, tmp_path, args=args, timeout=600)
    assert result.returncode != 0
    # rank 1's error, and mgpu_ddp naming it on rank 0; nothing from the monitor in the way
    assert "RuntimeError: rank 1 fails at batch 4" in result.output
    assert "rank 1 (pid" in result.output
    assert "callbacks/time" not in result.output
    assert "OUTSIDE" not in result.output
    assert not list(tmp_path.rglob("time_summary.json"))  # no summary of a fit that did not end
