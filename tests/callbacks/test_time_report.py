"""DeviceTimeMonitor's verdict, table, JSON and plot: plain per-rank totals in, what rank 0 shows out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_mgpu import plot_time
from lightning_mgpu.callbacks.time_report import RankTime, summary_json, table, verdict


def rank(r: int, data: float, work: float, wait: float | None = 0.0, steps: int = 100) -> RankTime:
    return RankTime(r, f"cuda:{r}", steps, steps * 32, data, work, wait)


def test_balanced_ranks_name_no_one() -> None:
    found = verdict([rank(0, 1.0, 9.0, 0.3), rank(1, 1.05, 9.3, 0.1), rank(2, 0.9, 9.1, 0.2)])
    assert found.rank is None
    assert found.line() == "Time: balanced, no rank holds the others back."


def test_slow_loader_names_its_rank_the_phase_and_the_fix() -> None:
    ranks = [rank(0, 1.0, 9.0, 4.0), rank(1, 5.0, 9.0, 0.1), rank(2, 1.0, 9.0, 4.0), rank(3, 1.0, 9.1, 3.9)]
    found = verdict(ranks, accelerator="cuda")
    assert (found.rank, found.phase) == (1, "data loading")
    assert found.slower_by == pytest.approx(14.0 / 10.0 - 1)
    assert "rank 1 (cuda:1) is 40 % slower than the others and loses the time in data loading" in found.line()
    assert "num_workers" in found.line()
    assert "pin_memory=True" in found.line()


def test_slow_card_names_the_card_and_micro_batch_size() -> None:
    found = verdict([rank(0, 1.0, 9.0, 3.0), rank(1, 1.0, 12.0, 0.1)], accelerator="cuda")
    assert (found.rank, found.phase) == (1, "work")
    assert "rank 1 (cuda:1) is 30 % slower than the others and loses the time in work" in found.line()
    assert "look at cuda:1 (nvidia-smi" in found.line()
    assert "micro_batch_size=" in found.line()


def test_slow_cpu_rank_points_at_its_cores() -> None:
    slow = RankTime(1, "cpu:rank1", 100, 3200, 1.0, 39.0, 0.1)
    found = verdict([rank(0, 1.0, 9.0, 30.0), slow], accelerator="cpu")
    assert (found.rank, found.phase) == (1, "work")
    assert "rank 1 (cpu:rank1) is 4.0x as slow as the others and loses the time in work" in found.line()
    assert "rank 1's CPU cores" in found.line()


def test_collective_bound_run_is_balanced_and_says_so() -> None:
    found = verdict([rank(0, 0.1, 1.0, 2.0), rank(1, 0.1, 1.0, 2.0)])
    assert found.rank is None
    assert "65 % of a step is spent in the collectives themselves" in found.line()


def test_one_process_waiting_for_batches_names_its_loader() -> None:
    assert verdict([rank(0, 1.0, 9.0, None)]).rank is None
    found = verdict([rank(0, 4.0, 6.0, None)])
    assert (found.rank, found.phase) == (0, "data loading")


def test_waiting_not_measured_uses_data_time_alone_and_says_so() -> None:
    # under FSDP work includes waiting: the fast rank's work holds the slow rank's loader time
    found = verdict([rank(0, 0.5, 9.5, None), rank(1, 4.0, 6.0, None)])
    assert (found.rank, found.phase) == (1, "data loading")
    assert "not measured under this strategy" in found.line()
    assert verdict([rank(0, 0.5, 9.5, None), rank(1, 0.6, 9.4, None)]).rank is None


def test_table_and_json_show_every_rank_and_the_run() -> None:
    ranks = [rank(0, 1.0, 6.0, 3.0), rank(1, 4.0, 6.0, None)]
    text = table(ranks)
    lines = text.splitlines()
    assert lines[1].split() == ["Rank", "Device", "Steps/s", "Data", "Work", "Waiting", "Samples/s"]
    assert lines[2].split() == ["0", "cuda:0", "10.00", "10.0%", "60.0%", "30.0%", "320.0"]
    assert lines[3].split() == ["1", "cuda:1", "10.00", "40.0%", "60.0%", "-", "320.0"]
    assert lines[-1] == "Run: 640.0 samples/s"
    data = json.loads(json.dumps(summary_json(ranks, verdict(ranks))))
    assert data["samples_per_s"] == pytest.approx(640.0)
    assert [r["wait_share"] for r in data["ranks"]] == [pytest.approx(0.3), None]
    assert data["verdict"]["line"].startswith("Time: ")


def test_no_step_no_verdict() -> None:
    assert verdict([]).rank is None
    assert table([]).splitlines()[-1] == "Run: 0.0 samples/s"


def test_plot_one_bar_per_rank_split_by_phase(tmp_path: Path) -> None:
    ranks = [rank(0, 1.0, 6.0, 3.0), rank(1, 4.0, 6.0, 0.1)]
    fig = plot_time(summary_json(ranks, verdict(ranks)), tmp_path)
    assert (tmp_path / "time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["data loading", "work", "waiting"]
    # three segments per rank, each as long as that rank's seconds in the phase
    assert [round(p.get_width(), 6) for p in ax.patches] == [1.0, 4.0, 6.0, 6.0, 3.0, 0.1]
    assert fig._suptitle.get_text().startswith("Time: rank 1 (cuda:1) is")


def test_plot_says_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no time summary at .*train with DeviceTimeMonitor"):
        plot_time(tmp_path, tmp_path / "time.png")
    with pytest.raises(ValueError, match="holds no rank"):
        plot_time({"ranks": []}, tmp_path / "time.png")
