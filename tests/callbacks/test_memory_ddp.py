"""DeviceMemoryMonitor over DDP ranks, in real gloo processes: every rank's readings reach rank 0's logger,
an imbalance is warned and summarised, and an out-of-memory on one rank is explained while both end.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.callbacks.test_memory import memory_rows, read_csv
from tests.helpers import run_file


def test_ddp_ranks_reach_rank0_logger_imbalance_warned_and_summarized(tmp_path: Path) -> None:
    result = run_file("memory_ddp.py", tmp_path, args=[str(tmp_path / "logs"), "hoard"], timeout=180)
    assert result.returncode == 0, result.output[-3000:]
    rows = memory_rows(tmp_path / "logs")
    assert len(rows) == 4  # 8 batches per rank, logged every 2
    for row in rows:
        for rank in (0, 1):
            assert float(row[f"memory/cpu:rank{rank}/rss_MiB"]) > 100
            assert float(row[f"memory/cpu:rank{rank}/peak_rss_MiB"]) > 100
        rank0, rank1 = (
            float(row["memory/cpu:rank0/peak_rss_MiB"]),
            float(row["memory/cpu:rank1/peak_rss_MiB"]),
        )
        assert rank0 > rank1 + 300
        assert float(row["memory/imbalance"]) == pytest.approx(rank0 / ((rank0 + rank1) / 2), rel=1e-6)

    # one warning, from rank 0 only, naming the device and that no usual cause applies
    assert result.output.count("Memory is unbalanced: cpu:rank0 holds") == 1
    assert "tensors kept on cpu:rank0 only" in result.output
    # one table, printed by rank 0, holding both ranks
    assert result.output.count("Device memory over the fit (peaks):") == 1
    table = result.stderr.split("Device memory over the fit (peaks):")[1]  # logged, on stderr
    assert "| cpu:rank0 | CPU process |" in table
    assert "| cpu:rank1 | CPU process |" in table
    log_dir = Path(result.stdout.split("LOG_DIR ")[1].split()[0])
    summary = json.loads((log_dir / "memory_summary.json").read_text())
    assert [d["device"] for d in summary["devices"]] == ["cpu:rank0", "cpu:rank1"]
    assert summary["max_imbalance"] > 1.25
    assert summary["devices"][0]["peak_rss_bytes"] > summary["devices"][1]["peak_rss_bytes"] + 300 * 2**20
    # each DDP rank holds the whole model state: 5 float32 parameters and their gradients (plain SGD)
    assert [d["model_state_bytes"] for d in summary["devices"]] == [40, 40]
    assert "Model state (rank)" in table


def test_ddp_readings_gathered_in_windows_keep_their_steps(tmp_path: Path) -> None:
    result = run_file("memory_ddp.py", tmp_path, args=[str(tmp_path / "logs"), "windows"], timeout=180)
    assert result.returncode == 0, result.output[-3000:]
    rows = read_csv(next((tmp_path / "logs").rglob("metrics.csv")))
    lightning_steps = [int(r["step"]) for r in rows if r.get("rank_batch")]
    memory = memory_rows(tmp_path / "logs")
    # every batch's reading of both ranks, under the step Lightning logged that batch at
    assert sorted(int(r["step"]) for r in memory) == lightning_steps == list(range(8))
    for row in memory:
        assert float(row["memory/cpu:rank0/rss_MiB"]) > 100
        assert float(row["memory/cpu:rank1/rss_MiB"]) > 100
    # the monitor opens nothing per fit that outlives it: after the second fit the process holds no more
    # files (sockets included) than after the first; fewer is no leak (something of the first fit let go)
    counts = re.findall(r"OPEN_FILES (\d) (\d+)", result.stdout)
    for rank in "01":
        first, second = [int(n) for r, n in counts if r == rank]
        assert second <= first, counts


def test_ddp_out_of_memory_on_one_rank_explains_and_both_ranks_end(tmp_path: Path) -> None:
    # returning at all means every process that shared the output pipes has exited: no hang
    result = run_file("memory_ddp.py", tmp_path, args=[str(tmp_path / "logs"), "oom"], timeout=120)
    out = result.output
    assert result.returncode != 0
    assert "rank 0 ended" in out
    assert "rank 1 ended" in out
    assert (
        out.count("Out of memory on cpu:rank1 (rank 1) at step 3: MemoryError: could not allocate 3 GiB") == 1
    )
    guidance = out.split("Out of memory on cpu:rank1")[1]
    assert "| cpu:rank0 | CPU process |" in guidance  # what every device held, from the last gather
    assert "| cpu:rank1 | CPU process |" in guidance
    assert "4 rows per device now; the largest that finished a step so far is 4" in guidance
    assert "accumulate_grad_batches=2" in guidance
    assert "[rank1]: MemoryError: could not allocate 3 GiB" in out  # the original error, re-raised
