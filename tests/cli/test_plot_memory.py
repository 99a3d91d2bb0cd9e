"""``lightning-mgpu plot-memory RUN_DIR`` as a user runs it."""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger

from tests.helpers import run_command


def logged_run(root: Path) -> Path:
    """A CSVLogger run folder holding what DeviceMemoryMonitor logs for two ranks."""
    logger = CSVLogger(root)
    for step in range(4):
        logger.log_metrics(
            {
                "memory/cpu:rank0/rss_MiB": 400.0 + step,
                "memory/cpu:rank1/rss_MiB": 380.0,
                "memory/imbalance": 1.02,
            },
            step=step,
        )
    logger.save()
    return Path(logger.log_dir)


def test_writes_png_next_to_the_metrics_without_importing_torch(tmp_path: Path) -> None:
    run_dir = logged_run(tmp_path / "logs")
    code = (
        "import sys\nfrom lightning_mgpu.cli.main import main\n"
        f"code = main(['plot-memory', {str(tmp_path / 'logs')!r}])\n"
        "assert 'torch' not in sys.modules, 'plot-memory imported torch'\nsys.exit(code)\n"
    )
    result = run_command([sys.executable, "-c", code], cwd=tmp_path)
    assert result.returncode == 0, result.output
    assert result.stdout.strip() == f"wrote {run_dir / 'memory.png'} (2 device(s))"
    assert (run_dir / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_output_and_field_options(tmp_path: Path) -> None:
    run_dir = logged_run(tmp_path / "logs")
    out = tmp_path / "plots" / "rss.png"
    cmd = [
        sys.executable,
        "-m",
        "lightning_mgpu",
        "plot-memory",
        str(run_dir / "metrics.csv"),
        "-o",
        str(out),
    ]
    result = run_command([*cmd, "--field", "rss"], cwd=tmp_path)
    assert result.returncode == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_user_errors_are_one_line(tmp_path: Path) -> None:
    result = run_command(
        [sys.executable, "-m", "lightning_mgpu", "plot-memory", str(tmp_path / "nope")], cwd=tmp_path
    )
    assert result.returncode == 1
    assert (
        result.stderr.strip()
        == f"lightning-mgpu plot-memory: error: no such run folder or metrics file: {tmp_path / 'nope'}"
    )
    run_dir = logged_run(tmp_path / "logs")
    result = run_command(
        [sys.executable, "-m", "lightning_mgpu", "plot-memory", str(run_dir), "--field", "saved"],
        cwd=tmp_path,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "no device logged memory/<device>/saved_MiB; fields present: rss" in result.stderr


def test_output_folder_gets_memory_png_and_a_failed_write_leaves_nothing(tmp_path: Path) -> None:
    run_dir = logged_run(tmp_path / "logs")
    plot = [sys.executable, "-m", "lightning_mgpu", "plot-memory", str(run_dir), "-o"]
    (tmp_path / "plots").mkdir()
    result = run_command([*plot, str(tmp_path / "plots")], cwd=tmp_path)
    assert result.returncode == 0, result.output
    assert result.stdout.strip() == f"wrote {tmp_path / 'plots' / 'memory.png'} (2 device(s))"
    assert (tmp_path / "plots" / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    (tmp_path / "blocked" / "memory.png").mkdir(parents=True)  # a folder where the PNG would go
    result = run_command([*plot, str(tmp_path / "blocked")], cwd=tmp_path)
    assert result.returncode == 1
    blocked = tmp_path / "blocked" / "memory.png"
    error = f"lightning-mgpu plot-memory: error: cannot write {blocked}: it is a folder"
    assert result.stderr.startswith(error)
    assert len(result.stderr.splitlines()) == 1
    assert [p.name for p in (tmp_path / "blocked").iterdir()] == ["memory.png"]  # no temporary file left
