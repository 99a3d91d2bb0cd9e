"""mgpu_auto: every rule from the facts it reads, and the Trainer getting the chosen strategy."""

from __future__ import annotations

import json
import logging
import re
import sys
from datetime import timedelta

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

import lightning_mgpu
from lightning_mgpu.strategies.auto import MGPUAutoStrategy, StrategyChoice, choose_strategy
from lightning_mgpu.strategies.auto.decide import EnvironmentFacts, decide, left_out, with_options
from lightning_mgpu.strategies.ddp.strategy import MGPUDDPStrategy
from lightning_mgpu.strategies.dp.strategy import MGPUDataParallelStrategy
from tests.helpers import run_file
from tests.strategies.dp._dp_models import QUIET, Regressor, fit, loader, max_difference, regression_data

# every launcher variable the rules read, removed so each test starts from a plain script
_LAUNCH_VARS = ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_JOB_NAME", "LOCAL_RANK")


@pytest.fixture(autouse=True)
def _plain_script(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delattr(sys, "ps1", raising=False)


def _choose(devices: int = 2, **facts: object) -> StrategyChoice:
    return choose_strategy(devices=devices, accelerator="cpu", facts=EnvironmentFacts.detect(**facts))


def test_several_nodes_or_a_launcher_use_ddp(monkeypatch: pytest.MonkeyPatch) -> None:
    choice = choose_strategy(devices=1, num_nodes=2, accelerator="cpu")
    assert (choice.strategy, choice.num_nodes) == ("mgpu_ddp", 2)
    assert "2 nodes" in choice.reason
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    assert str(_choose(devices=1)) == "mgpu_ddp: started by torchrun: one process per device"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    assert _choose(interactive=True).reason.startswith("started by SLURM")
    monkeypatch.setenv("SLURM_JOB_NAME", "interactive")  # `srun --pty bash`: not a launched rank
    assert _choose(devices=1).strategy == "single_device"


def test_one_device_is_single_device() -> None:
    choice = choose_strategy(devices=1, accelerator="cpu")
    assert choice.strategy == "single_device"
    assert choice.devices == 1
    assert choose_strategy(devices="auto", accelerator="cpu").strategy == "single_device"


def test_several_devices_in_a_script_use_ddp() -> None:
    assert EnvironmentFacts.detect().interactive is False
    choice = choose_strategy(devices=3, accelerator="cpu")
    assert (choice.strategy, choice.devices) == ("mgpu_ddp", 3)
    assert "script" in choice.reason


def test_interactive_session_before_cuda_forks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)  # what an interactive interpreter sets
    assert EnvironmentFacts.detect().interactive
    choice = _choose(cuda_initialized=False)
    assert choice.strategy == "ddp_notebook"
    assert "before CUDA is initialised" in choice.reason


def test_interactive_session_after_cuda_uses_dp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    choice = _choose(cuda_initialized=True)
    assert choice.strategy == "mgpu_dp"
    assert "already initialised" in choice.reason


def test_platforms_without_fork_nccl_or_distributed() -> None:
    assert _choose(interactive=True, fork_available=False).strategy == "mgpu_dp"
    assert _choose(fork_available=False).strategy == "mgpu_ddp"  # scripts start processes, no fork needed
    facts = EnvironmentFacts.detect(nccl_available=False)
    for interactive, expected in ((False, "mgpu_ddp"), (True, "ddp_notebook")):
        choice = decide(2, 1, "cuda", EnvironmentFacts.detect(nccl_available=False, interactive=interactive))
        assert choice.strategy == expected
        assert choice.options == {"process_group_backend": "gloo"}
    assert decide(2, 1, "cpu", facts).options == {}  # gloo is already the CPU backend
    assert _choose(distributed_available=False).strategy == "mgpu_dp"
    with pytest.raises(ValueError, match="torch.distributed"):
        choose_strategy(
            devices=1,
            num_nodes=2,
            accelerator="cpu",
            facts=EnvironmentFacts.detect(distributed_available=False),
        )


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="num_nodes"):
        choose_strategy(num_nodes=0)
    with pytest.raises(ValueError, match="unknown accelerator 'tpuu'"):
        choose_strategy(accelerator="tpuu")
    with pytest.raises(TypeError, match="unknown environment facts \\['jupyter'\\]"):
        EnvironmentFacts.detect(jupyter=True)
    for devices in ([0], -1, "0,1", 0, [], None, "abc"):
        with pytest.raises(ValueError, match=f"^devices={re.escape(repr(devices))}: "):
            choose_strategy(devices=devices, accelerator="cpu")  # type: ignore[arg-type]


def _records(caplog_target: list[str]) -> logging.Handler:
    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            caplog_target.append(record.getMessage())

    return Collect()


def test_the_debug_log_gives_the_facts_and_the_reason(caplog: pytest.LogCaptureFixture) -> None:
    # the user-facing line stays one INFO line; the reasoning is there for whoever turns on DEBUG
    caplog.set_level(logging.DEBUG, logger="lightning_mgpu")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="mgpu_auto", **QUIET)
    assert type(trainer.strategy) is MGPUDDPStrategy
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    facts = "2 cpu devices x 1 node, EnvironmentFacts(interactive=False,"
    assert any(m.startswith(facts) for m in debug), debug
    assert "-> mgpu_ddp: 2 devices in a script: one process per device" in debug, debug
    # and the strategy it became says how it will launch and which backend it takes
    assert "mgpu_ddp: start_method='popen': the watched subprocess launcher" in debug
    trainer.strategy._get_process_group_backend()
    assert "backend gloo for cpu: torch's default for cpu devices" in [r.getMessage() for r in caplog.records]


def test_trainer_gets_the_chosen_strategy() -> None:
    messages: list[str] = []
    handler = _records(messages)
    logging.getLogger("lightning.pytorch").addHandler(handler)
    try:
        one = L.Trainer(accelerator="cpu", devices=1, strategy="mgpu_auto", **QUIET)
        script = L.Trainer(accelerator="cpu", devices=2, strategy="mgpu_auto", **QUIET)
        notebook = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=MGPUAutoStrategy(
                facts=EnvironmentFacts.detect(interactive=True, cuda_initialized=False)
            ),
            **QUIET,
        )
        facts = EnvironmentFacts.detect(interactive=True, cuda_initialized=True)
        model = Regressor()
        dp = fit(model, MGPUAutoStrategy(facts=facts), 2, loader(regression_data(rows=12), 6), max_steps=2)
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(handler)
    assert type(one.strategy) is SingleDeviceStrategy
    assert type(script.strategy) is MGPUDDPStrategy
    assert script.strategy.num_processes == 2
    assert type(notebook.strategy) is DDPStrategy
    assert notebook.strategy._start_method == "fork"
    assert notebook.strategy.launcher is not None
    assert notebook.strategy.launcher.is_interactive_compatible
    assert type(dp.strategy) is MGPUDataParallelStrategy
    assert dp.strategy.last_chunk_sizes == [3, 3]
    assert dp.strategy.choice.strategy == "mgpu_dp"  # type: ignore[attr-defined]
    single = Regressor()
    fit(single, "auto", 1, loader(regression_data(rows=12), 6), max_steps=2)
    assert max_difference(model, single) < 1e-6
    decisions = [m for m in messages if m.startswith("mgpu_auto chose")]
    assert decisions == [
        "mgpu_auto chose single_device: one cpu device: nothing to split",
        "mgpu_auto chose mgpu_ddp: 2 devices in a script: one process per device",
        "mgpu_auto chose ddp_notebook: 2 devices in an interactive session before CUDA is initialised:"
        " forked processes",
        "mgpu_auto chose mgpu_dp: 2 devices in an interactive session where CUDA is already initialised:"
        " processes cannot be forked any more, so one process drives all devices",
    ]


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory: pytest.TempPathFactory):
    from lightning.pytorch.callbacks import ModelCheckpoint

    tmp_path = tmp_path_factory.mktemp("auto")
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpt")
    fit(
        Regressor(),
        "mgpu_dp",
        2,
        loader(regression_data(rows=20), 10),
        max_epochs=1,
        callbacks=[callback],
        enable_checkpointing=True,
    )
    checkpoint = callback.best_model_path
    # one launch of two processes (tests/scripts/auto_fits.py): the checkpoint resumed under the mgpu_ddp
    # mgpu_auto picks, then two fits that see the model: sharded (1KiB), then whole (2KiB)
    result = run_file("auto_fits.py", tmp_path, args=[checkpoint, str(tmp_path / "ddp.pt")], timeout=240)
    assert result.returncode == 0, result.output[-3000:]
    return tmp_path, checkpoint, result


@pytest.mark.slow
def test_dp_checkpoint_resumes_under_ddp_chosen_by_auto(auto_run) -> None:
    tmp_path, checkpoint, result = auto_run
    expected = Regressor()
    fit(expected, "auto", 1, loader(regression_data(rows=20), 10), max_epochs=2, ckpt_path=checkpoint)
    assert result.output.count("mgpu_auto chose mgpu_ddp: 2 devices in a script") == 1, result.output[-3000:]
    resumed = Regressor()
    resumed.load_state_dict(torch.load(tmp_path / "ddp.pt", weights_only=True))
    assert max_difference(resumed, expected) < 1e-6


@pytest.mark.slow
def test_a_model_that_fits_only_sharded_trains_under_mgpu_fsdp(auto_run) -> None:
    tmp_path, _, result = auto_run
    ranks = [json.loads((tmp_path / f"auto_rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank in ranks:
        # parameters, gradients, DDP's buckets and momentum: 1552 B whole, 1004 B sharded (test_become.py)
        assert rank["1KiB"] == {
            "strategy": "MGPUFSDPStrategy", "is_fsdp": True, "dtensors": ["DTensor"], "rows": [8, 16],
            "time_monitors": [25],
        }  # fmt: skip
        assert rank["2KiB"] == {
            "strategy": "MGPUDDPStrategy", "is_fsdp": False, "dtensors": ["Parameter"], "rows": [16, 16],
            "time_monitors": [25],
        }  # fmt: skip
    numbers = (
        "a whole copy of the parameters, gradients and optimizer state (SGD) takes 1.52 KiB per device with"
        " DDP's gradient buckets, more than the 1.00 KiB of a device, but sharded they need 1004 B per device"
        " with the largest unit gathered"
    )
    assert result.output.count("mgpu_auto chose mgpu_fsdp: ") == 1, result.output[-3000:]
    assert numbers in result.output
    assert result.output.count("then mgpu_fsdp: decided when the model is known") == 2
    # the time monitor mgpu_auto added: each of the two fits ends with its table on rank 0
    assert result.output.count("Samples/s") == 3, result.output[-3000:]  # and the user's own, first
    # sharded or not, the same steps from the same start: the same weights
    sharded = torch.load(tmp_path / "1KiB.pt", weights_only=True)
    whole = torch.load(tmp_path / "2KiB.pt", weights_only=True)
    for name, value in whole.items():
        torch.testing.assert_close(sharded[name], value, atol=1e-5, rtol=0)
    assert not torch.equal(whole["net.0.weight"], Regressor().net[0].weight.detach())


def test_public_names() -> None:
    assert lightning_mgpu.choose_strategy is choose_strategy
    assert lightning_mgpu.StrategyChoice is StrategyChoice
    assert lightning_mgpu.MGPUAutoStrategy is MGPUAutoStrategy
    assert torch.distributed.is_available()  # the rules above were read from a real torch.distributed


def test_the_options_mgpu_auto_passes_on_go_where_they_are_taken() -> None:
    given = {"process_group_backend": "nccl", "timeout": timedelta(minutes=3), "stall_timeout": 60.0}
    given["resume"] = True
    ddp = StrategyChoice("mgpu_ddp", "a script", 2, options={"process_group_backend": "gloo"})
    assert with_options(ddp, given).options == given  # given explicitly: it replaces the decision's gloo
    assert left_out(ddp, given) == []
    notebook = with_options(StrategyChoice("ddp_notebook", "a notebook", 2), given)
    assert notebook.options == {"process_group_backend": "nccl", "timeout": timedelta(minutes=3)}
    assert left_out(notebook, given) == ["stall_timeout", "resume"]
    one = StrategyChoice("mgpu_dp", "one process", 2)
    assert with_options(one, given) is one
    assert left_out(one, given) == list(given)
