"""``lightning-mgpu run`` and ``recipes``: the run folder, the summary, errors without tracebacks."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from lightning_mgpu import MGPUDDPStrategy, runner
from lightning_mgpu.cli.main import main
from lightning_mgpu.devices import format_bytes
from lightning_mgpu.recipes import RECIPES
from lightning_mgpu.recipes.digits import ConvClassifier
from tests.helpers import run_command, script_env

SHORT = [
    "trainer.max_epochs=2",
    "trainer.limit_train_batches=3",
    "trainer.log_every_n_steps=2",
    "trainer.limit_val_batches=2",
    "trainer.devices=1",
    "trainer.accelerator=cpu",
    "trainer.enable_progress_bar=false",
    "callbacks.memory.every_n_steps=2",
]


def kept_trainers(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The real Trainers the run builds, kept to look at their settings."""
    built: list[Any] = []
    real = runner.build_trainer

    def keep(*args: Any, **kwargs: Any) -> Any:
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(runner, "build_trainer", keep)
    return built


def test_run_folder_and_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "my_run"
    assert main(["run", "digits", *SHORT, f"run_dir={run_dir}"]) == 0
    out = capsys.readouterr().out

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["recipe"] == "digits"
    assert config["trainer"]["limit_train_batches"] == 3
    assert config["run_dir"] == str(run_dir)
    with (run_dir / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows if r.get("train/loss")] == ["1", "3", "5"]
    assert any(r.get("val/acc") for r in rows)
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("*.ckpt"))
    weights = sorted(p.name for p in (run_dir / "checkpoints").glob("*.safetensors"))
    assert weights == sorted([c.replace(".ckpt", ".safetensors") for c in ckpts] + ["final.safetensors"])
    assert "last.ckpt" in ckpts
    assert len(ckpts) == 2
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    plain = load_file(run_dir / "checkpoints" / "last.safetensors")
    ConvClassifier().net.load_state_dict(plain, strict=True)  # loads into the bare network
    torch.testing.assert_close(plain, {k.removeprefix("net."): v for k, v in state.items()}, rtol=0, atol=0)

    memory = json.loads((run_dir / "memory_summary.json").read_text())
    assert [d["device"] for d in memory["devices"]] == ["cpu:rank0"]
    assert memory["devices"][0]["peak_rss_bytes"] > 0
    assert "micro_batch_size" not in memory["devices"][0]  # the strategy runs whole batches
    assert (run_dir / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    summary = out[out.index("digits: fit done in") :]
    assert "with single_device on 1 cpu device" in summary.splitlines()[0]
    assert "optimizer steps" in summary.splitlines()[0]
    assert "  val/acc " in summary
    assert "  train/loss " in summary
    assert f"written to {run_dir}/:" in summary
    for name in ("config.yaml", "metrics.csv", "checkpoints/last.ckpt", "memory.png", "memory_summary.json"):
        assert f"  {name}  " in summary

    # the time monitor's totals count every training batch of both epochs; its table comes before the memory
    times = json.loads((run_dir / "time_summary.json").read_text())
    assert [(r["device"], r["steps"], r["samples"] > 0) for r in times["ranks"]] == [("cpu:rank0", 6, True)]
    assert "  time_summary.json  each rank's data loading, work and waiting time" in summary
    assert f"  {times['verdict']['line']}\npeak memory:" in summary
    assert "time per rank:\n  Rank  Device" in summary
    assert (run_dir / "time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "  time.png  each rank's time as one bar" in summary
    assert "  checkpoints/last.safetensors  plain weights of last.ckpt" in summary
    assert "  checkpoints/final.safetensors  plain weights at the end of fit" in summary
    peak = memory["devices"][0]["peak_rss_bytes"]
    peak_table = summary.partition("peak memory:\n")[2].splitlines()  # the memory monitor's table
    (row,) = [line for line in peak_table if "cpu:rank0" in line]
    assert "Peak RSS" in "".join(peak_table)
    assert format_bytes(peak) in row


def test_micro_batch_size_from_the_config_reaches_the_strategy_and_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "micro"
    dp = ["trainer.strategy=mgpu_dp", "trainer.devices=2", "data.batch_size=16", "trainer.max_epochs=1"]
    assert main(["run", "digits", *SHORT, *dp, "trainer.micro_batch_size=4", f"run_dir={run_dir}"]) == 0
    out = capsys.readouterr().out

    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["micro_batch_size"] == 4
    memory = json.loads((run_dir / "memory_summary.json").read_text())
    process, *replicas = memory["devices"]
    assert (process["device"], process["micro_batch_size"]) == ("cpu:rank0", 4)  # the strategy's own size
    assert [d["device"] for d in replicas] == ["cpu:replica0", "cpu:replica1"]
    assert not any("micro_batch_size" in d for d in replicas)  # the rank's setting, once
    peak = format_bytes(process["peak_rss_bytes"])
    (row,) = [line for line in out.partition("peak memory:\n")[2].splitlines() if "cpu:rank0" in line]
    assert peak in row
    assert "4 rows" in row  # the micro-batch column, on the rank's own row
    assert "with mgpu_dp on 2 cpu devices, 1 epoch, 3 optimizer steps" in out


def test_a_run_dir_holding_files_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    used = tmp_path / "used"
    (used / "checkpoints").mkdir(parents=True)
    (used / "checkpoints" / "last.safetensors").write_bytes(b"not weights")
    (used / "metrics.csv").write_text("step\n")
    assert main(["run", "linear", *SHORT, f"run_dir={used}"]) == 1
    assert capsys.readouterr().err == (
        f"lightning-mgpu run: error: run_dir {used} already holds files (checkpoints, metrics.csv) that this"
        f" run's would mix with; set another run_dir, or leave it unset for a new folder under runs/,"
        f" or delete {used} first\n"
    )
    assert sorted(p.name for p in used.rglob("*")) == ["checkpoints", "last.safetensors", "metrics.csv"]
    assert (used / "metrics.csv").read_text() == "step\n"

    # weights read from inside the folder: refused before they are loaded, and no advice to delete them
    weights = used / "checkpoints" / "last.safetensors"
    predict = ["run", "resnet18_predict", f"weights={weights}", f"run_dir={used}", "trainer.accelerator=cpu"]
    assert main(predict) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith("set another run_dir, or leave it unset for a new folder under runs/")
    assert main(["run", "linear", *SHORT, f"run_dir={used / 'checkpoints' / 'last.safetensors'}"]) == 1
    assert "last.safetensors is a file; set run_dir to a new folder" in capsys.readouterr().err


def test_default_run_folder_is_under_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert (
        main(["run", "linear", "trainer.fast_dev_run=true", "trainer.devices=1", "trainer.accelerator=cpu"])
        == 0
    )
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("linear-")
    assert (run_dir / "config.yaml").is_file()


def test_print_config_shows_the_resolved_config_and_runs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["run", "linear", "model.in_features=3", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["recipe"] == "linear"
    assert printed["data"]["in_features"] == 3  # ${model.in_features} resolved
    assert printed["trainer"]["max_epochs"] == 10
    assert main(["run", "model.hidden=32", "--print-config"]) == 0  # without CONFIG: digits
    printed = yaml.safe_load(capsys.readouterr().out)
    assert (printed["recipe"], printed["model"]["hidden"]) == ("digits", 32)
    assert not (tmp_path / "runs").exists()


def test_global_batch_must_divide_over_processes(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["run", "digits", "trainer.strategy=mgpu_ddp", "trainer.devices=2", "trainer.accelerator=cpu"]
    assert main([*args, "data.batch_size=63"]) == 1
    assert (
        "lightning-mgpu run: error: data.batch_size=63 is the global batch and must divide evenly over the 2 "
        "training processes; use data.batch_size=62 or data.batch_size=64"
    ) in capsys.readouterr().err.splitlines()


def test_missing_data_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["run", "mnist", f"data.root={tmp_path}", "trainer.devices=1", "trainer.accelerator=cpu"]) == 1
    )
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
    assert line.startswith(f"lightning-mgpu run: error: MNIST files not found: looked in {tmp_path} and ")


def test_config_errors_print_every_problem_and_no_traceback(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "lightning_mgpu", "run", "digits", "trainer.max_epoch=3", "optimizer.lr=-1"]
    result = run_command(cmd, cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr == (
        "lightning-mgpu run: error: digits has 2 problems:\n"
        "  trainer.max_epoch: unknown key; did you mean trainer.max_epochs?\n"
        "  optimizer.lr: must be > 0, got -1\n"
    )
    assert result.stdout == ""
    assert not (tmp_path / "runs").exists()


def test_device_indices_without_a_gpu_are_one_line(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "lightning_mgpu", "run", "linear", "trainer.devices=[0]"]
    result = run_command(cmd, cwd=tmp_path, env=script_env(CUDA_VISIBLE_DEVICES=""))
    assert result.returncode == 1
    assert result.stderr == (
        "lightning-mgpu run: error: trainer.devices=[0]: device indices select GPUs, and no CUDA device is"
        " visible here; give a count such as trainer.devices=2 to run that many CPU processes\n"
    )
    assert not (tmp_path / "runs").exists()


def test_recipes_lists_one_line_per_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(RECIPES)
    assert "(default)" in lines[list(RECIPES).index("digits")]
    assert lines[-1].endswith("[configs: resnet18, resnet18_predict, resnet50]")


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["recipes"]], ids=" ".join)
def test_light_commands_do_not_import_torch(argv: list[str]) -> None:
    code = (
        "import sys\n"
        "from lightning_mgpu.cli.main import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('torch imported' if 'torch' in sys.modules else 'torch not imported')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "torch not imported"
    if argv == ["--help"]:
        assert "run" in out
        assert "recipes" in out
        assert "estimate" in out


def test_options_may_come_after_the_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "linear", "--print-config", "trainer.devices=2"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["trainer"]["devices"] == 2
    assert main(["run", "linear", "trainer.devices=2", "--print-confg"]) == 1
    assert "unknown option --print-confg; see lightning-mgpu run --help" in capsys.readouterr().err


def test_strategy_options_from_a_config_file_and_the_command_line_reach_the_strategy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "mine.yaml"
    config.write_text(
        "# lightning-mgpu run mine.yaml\n"
        "recipe: digits\n"
        "trainer:\n"
        "  strategy:\n"
        "    name: mgpu_ddp\n"
        "    stall_timeout: 60  # name a rank that makes no step for a minute\n"
    )
    options = ["trainer.strategy.micro_batch_size=2", "data.batch_size=8", "trainer.max_epochs=1"]
    assert main(["run", str(config), *options, "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]
    assert printed == {"name": "mgpu_ddp", "stall_timeout": 60, "micro_batch_size": 2}

    built = kept_trainers(monkeypatch)
    run_dir = tmp_path / "run"
    assert main(["run", str(config), *SHORT, *options, f"run_dir={run_dir}"]) == 0
    strategy = built[0].strategy
    assert isinstance(strategy, MGPUDDPStrategy)
    assert (strategy.stall_timeout, strategy.micro_batch_size) == (60, 2)
    memory = json.loads((run_dir / "memory_summary.json").read_text())
    assert memory["devices"][0]["micro_batch_size"] == 2  # the batches really ran in micro-batches of 2
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["strategy"]
    assert saved == printed


def test_a_trainer_argument_from_the_command_line_reaches_the_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    built = kept_trainers(monkeypatch)
    run_dir = tmp_path / "run"
    extra = ["trainer.val_check_interval=2", "trainer.detect_anomaly=true", f"run_dir={run_dir}"]
    with caplog.at_level("INFO"):
        assert main(["run", "linear", *SHORT, *extra]) == 0
    assert built[0].val_check_interval == 2
    assert "You have turned on `Trainer(detect_anomaly=True)`" in caplog.text  # the Trainer's own line
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]
    assert (saved["val_check_interval"], saved["detect_anomaly"]) == (2, True)
