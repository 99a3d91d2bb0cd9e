"""``lightning-mgpu estimate``: the config's model and data measured, reported for its global batch."""

from __future__ import annotations

import pytest

from lightning_mgpu.cli.main import main
from lightning_mgpu.config import load_config
from lightning_mgpu.config.instantiate import build_data, build_module, resolve_devices
from lightning_mgpu.devices import format_bytes
from lightning_mgpu.estimate import estimate_memory
from lightning_mgpu.estimate.memory_estimate import STRATEGIES


def rows(out: str) -> dict[str, list[str]]:
    """The strategy table: strategy -> the other columns."""
    table: dict[str, list[str]] = {}
    for cols in (line.split() for line in out.splitlines()):
        if cols and cols[0] in STRATEGIES:
            table.setdefault(cols[0], cols[1:])  # the table comes first; notes below may start alike
    return table


def test_estimate_reports_each_strategy_for_the_global_batch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "linear", "data.batch_size=64", "--devices", "2", "--gpu-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("linear: LinearRegression, data.batch_size=64 (global), 2 device(s), 1.00 GiB per")
    assert "  parameters                   44 B\n" in out  # nn.Linear(10, 1): 11 float32 values
    assert "  gradients                    44 B\n" in out

    cfg = load_config("linear", ["data.batch_size=64"])
    module = build_module(cfg)
    sample = build_data(cfg).example_batch(8)  # type: ignore[attr-defined]
    est = estimate_memory(
        module, sample, devices=2, device_memory="1GiB", batch_size=64, optimizer=module.make_optimizer()
    )
    # columns: batch/device, global batch, peak (number, unit), fits, largest batch/device and global
    table = rows(out)
    assert table["single"][:2] == ["64", "64"]
    assert " ".join(table["single"][2:4]) == format_bytes(est.peak("single", per_device_batch=64))
    assert table["mgpu_ddp"][:2] == ["32", "64"]  # each of 2 processes loads half the global batch
    assert " ".join(table["mgpu_ddp"][2:4]) == format_bytes(est.peak("mgpu_ddp", per_device_batch=32))
    assert table["mgpu_dp"][:2] == ["32", "64"]
    assert table["mgpu_ddp"][4] == "yes"
    assert int(table["mgpu_ddp"][5]) == est.largest_per_device_batch("mgpu_ddp")
    assert int(table["mgpu_ddp"][6]) == est.largest_per_device_batch("mgpu_ddp") * 2
    # mgpu_fsdp: 32 per process as under mgpu_ddp, with the model state halved and one unit gathered
    assert table["mgpu_fsdp"][:2] == ["32", "64"]
    assert " ".join(table["mgpu_fsdp"][2:4]) == format_bytes(est.peak("mgpu_fsdp", per_device_batch=32))
    assert "mgpu_fsdp fits 32 sample(s) per device in 1.00 GiB from 1 device(s)" in out


def test_options_may_follow_the_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "digits", "--devices", "4", "data.batch_size=30"]) == 0
    out = capsys.readouterr().out
    assert "data.batch_size=30 (global), 4 device(s)" in out
    assert "mgpu_ddp needs the global batch divisible by 4; 30 is not" in out
    assert rows(out)["mgpu_dp"][0] == "8"  # ceil(30 / 4) on card 0


def test_estimate_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["estimate"])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "lightning-mgpu estimate: error: the following arguments are required: config"
    )
    assert main(["estimate", "digits", "--devices", "0"]) == 1
    assert "lightning-mgpu estimate: error: --devices must be at least 1, got 0" in capsys.readouterr().err
    assert main(["estimate", "digits", "--gpu-memory", "lots"]) == 1
    assert "lightning-mgpu estimate: error:" in capsys.readouterr().err
    assert main(["estimate", "digits", "--gpus", "2"]) == 1
    assert "unknown option --gpus; see lightning-mgpu estimate --help" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:`precision=.*historical reasons")
def test_precision_as_the_config_allows_it(capsys: pytest.CaptureFixture[str]) -> None:
    for short, name in [("16", "16-mixed"), ("bf16", "bf16-mixed"), ("64", "64-true")]:
        assert main(["estimate", "linear", f"trainer.precision={short}"]) == 0
        assert f", {name}, optimizer SGD," in capsys.readouterr().out.splitlines()[0]


def test_devices_are_counted_as_run_counts_them(capsys: pytest.CaptureFixture[str]) -> None:
    _, auto = resolve_devices("auto", "auto")
    assert main(["estimate", "linear", "trainer.devices=-1"]) == 0
    assert f"(global), {auto} device(s)" in capsys.readouterr().out.splitlines()[0]
    assert main(["estimate", "linear", "trainer.devices=[0,3]"]) == 0  # GPUs elsewhere: no GPU needed here
    assert "(global), 2 device(s)" in capsys.readouterr().out.splitlines()[0]


def test_validate_and_predict_configs_get_an_inference_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    overrides = ["task=validate", "callbacks.memory.enabled=false"]
    assert main(["estimate", "linear", *overrides, "--devices", "2"]) == 0
    out = capsys.readouterr().out
    first, *held = out.splitlines()[:4]
    assert first.endswith(", task validate: inference, no gradients or optimizer state, measured on meta")
    assert held[:2] == ["  parameters                   44 B", "  buffers                       0 B"]
    assert held[2].startswith("  per sample:")  # no gradients or optimizer state

    cfg = load_config("linear", overrides)
    sample = build_data(cfg).example_batch(8)  # type: ignore[attr-defined]
    est = estimate_memory(
        build_module(cfg), sample, devices=2, batch_size=64, inference=True, step_fn=lambda m, b: m(b[0])
    )
    assert " ".join(rows(out)["single"][2:4]) == format_bytes(est.peak("single", per_device_batch=64))
    assert " ".join(rows(out)["mgpu_ddp"][2:4]) == format_bytes(est.peak("mgpu_ddp", per_device_batch=32))


def test_nothing_fits_says_so_and_what_would(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "digits", "--devices", "2", "--gpu-memory", "64KiB"]) == 0
    out = capsys.readouterr().out
    table = rows(out)
    assert all(table[s][4:] == ["NO", "none", "none"] for s in ("single", "mgpu_dp", "mgpu_ddp"))
    assert "largest batch 0" not in out
    assert "  Nothing fits: one sample per device needs " in out
    assert "  - a smaller model: its parameters, gradients and optimizer state alone take " in out
    assert "more devices do not help" in out
    assert "'bf16-true' also halves the weights, gradients and optimizer state" in out
    assert "  - an optimizer with less state: AdamW keeps " in out
