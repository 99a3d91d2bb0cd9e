"""Every shipped config runs (``fast_dev_run`` on one CPU device) and opens with the command that runs it."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_mgpu.cli.main import main
from lightning_mgpu.recipes import CONFIG_DIR
from tests.recipes.idx_files import write_mnist

CONFIGS = sorted(CONFIG_DIR.rglob("*.yaml"))


def test_configs_found() -> None:
    names = {p.relative_to(CONFIG_DIR).with_suffix("").as_posix() for p in CONFIGS}
    assert {
        "digits",
        "linear",
        "seq_linear",
        "heatmap",
        "mnist",
        "resnet18",
        "resnet50",
        "resnet18_predict",
    } <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_opens_with_its_command(path: Path) -> None:
    name = path.relative_to(CONFIG_DIR).with_suffix("").as_posix()
    first = path.read_text().splitlines()[0]
    assert first.startswith(f"# lightning-mgpu run {name}"), first


# a ResNet's fast_dev_run takes 10-20 s on two CPU cores: `make test-fast` leaves those two out
SLOW = ("resnet18", "resnet50")
FAST_DEV_RUNS = [pytest.param(p, marks=pytest.mark.slow) if p.stem in SLOW else p for p in CONFIGS]


@pytest.mark.parametrize("path", FAST_DEV_RUNS, ids=lambda p: p.stem)
def test_config_runs_fast_dev_run_on_one_cpu(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # relative paths (data/mnist, runs/) land in tmp_path
    if "mnist" in path.read_text().split("recipe:")[1].splitlines()[0]:
        write_mnist(tmp_path / "data" / "mnist")
    args = [
        "run",
        str(path),
        "trainer.fast_dev_run=true",
        "trainer.accelerator=cpu",
        "trainer.devices=1",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert (run_dir / "config.yaml").is_file()
    assert f"written to {Path('runs') / run_dir.name}/" in out
    assert "with single_device on 1 cpu device" in out
