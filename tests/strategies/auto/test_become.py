"""mgpu_auto once the model is known, and with micro-batching: the decisions in this process.

The whole run under real processes (a fit that ends under ``mgpu_fsdp``, one that stays on
``mgpu_ddp``) is in ``test_strategy.py``'s two-process script; here ``connect`` is called as the
Trainer calls it in each process, without starting any.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry

from lightning_mgpu.strategies.auto import MGPUAutoStrategy
from lightning_mgpu.strategies.auto.become import PendingDDPStrategy, become
from lightning_mgpu.strategies.auto.decide import EnvironmentFacts, StrategyChoice
from lightning_mgpu.strategies.ddp.strategy import MGPUDDPStrategy
from lightning_mgpu.strategies.dp.strategy import MGPUDataParallelStrategy
from lightning_mgpu.strategies.fsdp.strategy import MGPUFSDPStrategy
from lightning_mgpu.strategies.mixin import StrategyMixin
from tests.strategies.auto._gpt import TinyGPT2
from tests.strategies.dp._dp_models import QUIET, Regressor, fit, loader, regression_data

# Regressor: 97 float32 parameters (388 B) trained by SGD with momentum (388 B of state): under mgpu_ddp
# parameters, gradients, DDP's buckets and momentum take 1552 B whole; over 2 processes their shards take
# 684 B on the fullest (a weight of one row is not split: it pads) plus its largest unit (net.0: 320 B)
# gathered = 1004 B
FITS_SHARDED = "1KiB"
FITS_WHOLE = "2KiB"


@pytest.fixture(autouse=True)
def _plain_script(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_JOB_NAME", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delattr(sys, "ps1", raising=False)


@pytest.fixture
def messages() -> Iterator[list[str]]:
    """What mgpu_auto logged, through Lightning's rank-zero logging."""
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("mgpu_auto"):
                seen.append(record.getMessage())

    handler = Collect()
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(handler)
    yield seen
    logger.removeHandler(handler)


def _trainer(devices: int = 2, **auto: Any) -> L.Trainer:
    precision = auto.pop("precision", "32-true")
    return L.Trainer(
        accelerator="cpu", devices=devices, strategy=MGPUAutoStrategy(**auto), precision=precision, **QUIET
    )


def test_with_a_device_memory_mgpu_ddp_waits_for_the_model(messages: list[str]) -> None:
    trainer = _trainer(device_memory=FITS_SHARDED)
    strategy = trainer.strategy
    assert type(strategy) is PendingDDPStrategy
    assert strategy.strategy_name == "mgpu_ddp"
    assert messages == [
        "mgpu_auto chose mgpu_ddp: 2 devices in a script: one process per device; unless the model needs"
        " sharding (a whole copy of its parameters, gradients and optimizer state does not fit the 1.00 KiB"
        " of a device, their shards do), then mgpu_fsdp: decided when the model is known"
    ]
    # without a device memory on CPU nothing waits: the plain mgpu_ddp as before
    assert type(_trainer().strategy) is MGPUDDPStrategy


def test_a_model_that_fits_only_sharded_turns_mgpu_ddp_into_mgpu_fsdp(messages: list[str]) -> None:
    trainer = _trainer(device_memory=FITS_SHARDED)
    strategy = trainer.strategy
    kept = (strategy.launcher, strategy.accelerator, strategy.precision_plugin, strategy.cluster_environment)
    model = Regressor()
    strategy.connect(model)  # as trainer.fit does in every process, after the launch
    assert type(trainer.strategy) is MGPUFSDPStrategy
    assert trainer.strategy is strategy  # the Trainer's object, now the chosen class
    assert (
        strategy.launcher,
        strategy.accelerator,
        strategy.precision_plugin,
        strategy.cluster_environment,
    ) == kept
    assert strategy.parallel_devices is not None
    assert (len(strategy.parallel_devices), strategy.num_nodes, strategy.world_size) == (2, 1, 2)
    assert strategy.lightning_module is model
    assert strategy.choice.strategy == "mgpu_fsdp"  # type: ignore[attr-defined]
    assert messages[-1] == (
        "mgpu_auto chose mgpu_fsdp: 2 devices in a script: one process per device; a whole copy of the"
        " parameters, gradients and optimizer state (SGD) takes 1.52 KiB per device with DDP's gradient"
        " buckets, more than the 1.00 KiB of a device, but sharded they need 1004 B per device with the"
        " largest unit gathered (activations come on top)"
    )


def test_a_model_that_fits_whole_stays_on_mgpu_ddp(messages: list[str]) -> None:
    trainer = _trainer(device_memory=FITS_WHOLE)
    trainer.strategy.connect(Regressor())
    assert type(trainer.strategy) is MGPUDDPStrategy
    assert len(messages) == 1  # the decision at Trainer(...) only


def test_a_model_that_fits_no_device_even_sharded_is_refused_with_the_numbers() -> None:
    trainer = _trainer(device_memory=900)
    with pytest.raises(
        ValueError, match="mgpu_auto: the model does not fit a device of 900 B even sharded"
    ) as err:
        trainer.strategy.connect(Regressor())
    assert "1.52 KiB whole with DDP's gradient buckets and 1004 B per device sharded over 2" in str(err.value)
    # 3 devices: 6 of the 16 rows of net.0, the one-row weight whole, 3 x 193 B of state, 320 B gathered
    assert "use at least 3 devices (devices=, num_nodes=) or a lower precision" in str(err.value)


def test_a_precision_mgpu_fsdp_refuses_keeps_mgpu_ddp_and_says_why() -> None:
    # under 64-true the parameters and their state are doubles: 3104 B whole, 2008 B sharded
    trainer = _trainer(device_memory="2.5KiB", precision="64-true")
    with pytest.warns(
        UserWarning, match="mgpu_auto keeps mgpu_ddp although a whole copy of the parameters, gradients and"
    ):
        trainer.strategy.connect(Regressor())
    assert type(trainer.strategy) is MGPUDDPStrategy
    # bf16-true halves them: a whole copy fits, no reason to shard
    trainer = _trainer(device_memory=FITS_SHARDED, precision="bf16-true")
    trainer.strategy.connect(Regressor())
    assert type(trainer.strategy) is MGPUDDPStrategy


def test_micro_batch_size_reaches_the_chosen_strategy(messages: list[str]) -> None:
    assert trainer_micro(_trainer(micro_batch_size=2)) == (MGPUDDPStrategy, 2)
    pending = _trainer(device_memory=FITS_SHARDED, micro_batch_size="auto").strategy
    pending.connect(Regressor())
    assert (type(pending), pending.micro_batch_size) == (MGPUFSDPStrategy, "auto")  # type: ignore[attr-defined]
    notebook = EnvironmentFacts.detect(interactive=True, cuda_initialized=False)
    assert trainer_micro(_trainer(facts=notebook, micro_batch_size=3)) == (MGPUDataParallelStrategy, 3)
    assert messages[-1] == (
        "mgpu_auto chose mgpu_dp: 2 devices in an interactive session before CUDA is initialised: forked"
        " processes; micro_batch_size=3, which Lightning's ddp_notebook cannot run, so mgpu_dp"
    )


def trainer_micro(trainer: L.Trainer) -> tuple[type, Any]:
    return type(trainer.strategy), getattr(trainer.strategy, "micro_batch_size", None)


class Counting(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.rows.append(len(batch[0]))
        return super().training_step(batch, batch_idx)


def test_one_device_micro_batches_under_mgpu_dp(messages: list[str]) -> None:
    model = Counting()
    trainer = fit(
        model, MGPUAutoStrategy(micro_batch_size=2), 1, loader(regression_data(rows=12), 6), max_steps=2
    )
    assert type(trainer.strategy) is MGPUDataParallelStrategy
    assert len(trainer.strategy.parallel_devices or []) == 1
    assert model.rows == [2, 2, 2, 2, 2, 2]  # two batches of 6, three micro-batches each
    assert messages[0] == (
        "mgpu_auto chose mgpu_dp: one cpu device: nothing to split; micro_batch_size=2, which a single device"
        " cannot run, so mgpu_dp"
    )


def test_bad_arguments_are_refused_at_once() -> None:
    with pytest.raises(ValueError, match="cannot read the memory size '24 gigs'"):
        MGPUAutoStrategy(device_memory="24 gigs")
    with pytest.raises(ValueError, match="micro_batch_size must be a positive number of rows.*got 0"):
        MGPUAutoStrategy(micro_batch_size=0)


def _placeholder() -> MGPUAutoStrategy:
    """``mgpu_auto`` as the Trainer leaves it before it decides: accelerator and devices set."""
    strategy = MGPUAutoStrategy()
    strategy.accelerator = CPUAccelerator()
    strategy.parallel_devices = [torch.device("cpu")] * 2
    strategy.cluster_environment = LightningEnvironment()
    return strategy


MGPU_NAMES = sorted(
    name
    for name in StrategyRegistry
    if name.startswith("mgpu_") and StrategyRegistry[name]["strategy"] is not MGPUAutoStrategy
)


@pytest.mark.parametrize("name", MGPU_NAMES)
def test_mgpu_auto_can_become_every_registered_strategy(name: str) -> None:
    strategy = _placeholder()
    accelerator = strategy.accelerator
    become(strategy, StrategyChoice(name, "chosen by the test", 2), [torch.device("cpu")] * 2)
    entry = StrategyRegistry[name]
    assert type(strategy) is entry["strategy"]
    assert strategy.accelerator is accelerator
    assert strategy.parallel_devices == [torch.device("cpu")] * 2
    assert strategy.strategy_name == name.removesuffix("_find_unused_parameters_true")
    for key, value in entry["init_params"].items():  # mgpu_ddp_find_unused_parameters_true
        assert strategy._ddp_kwargs[key] == value  # type: ignore[attr-defined]


def test_a_mixin_must_derive_from_strategy_mixin_for_the_swap() -> None:
    class OnObject:
        pass

    class OnMixinBase(StrategyMixin):
        pass

    bad = type("BadDDP", (OnObject, MGPUDDPStrategy), {})
    good = type("GoodDDP", (OnMixinBase, MGPUDDPStrategy), {})
    choice = StrategyChoice("mgpu_ddp", "chosen by the test", 2)
    with pytest.raises(TypeError, match="layout differs"):
        become(_placeholder(), choice, [torch.device("cpu")] * 2, strategy_class=bad)
    strategy = _placeholder()
    become(strategy, choice, [torch.device("cpu")] * 2, strategy_class=good)
    assert type(strategy) is good


def test_a_small_gpt2_whose_adamw_state_fits_only_sharded_becomes_mgpu_fsdp_before_training(
    messages: list[str],
) -> None:
    # parameters and gradients (1.66 MiB) fit 2.5 MiB; with AdamW's moments and DDP's buckets they do not
    trainer = _trainer(device_memory="2.5MiB")
    trainer.strategy.connect(TinyGPT2())
    assert type(trainer.strategy) is MGPUFSDPStrategy
    assert messages[-1].endswith(
        "a whole copy of the parameters, gradients and optimizer state (AdamW) takes 4.98 MiB per device with"
        " DDP's gradient buckets and its optimizer step's temporaries, more than the 2.50 MiB of a device,"
        " but sharded they need 2.07 MiB per device with the largest unit gathered or its optimizer step's"
        " temporaries (activations come on top)"
    )


def test_the_resume_options_reach_mgpu_ddp_and_mgpu_fsdp_and_a_one_process_choice_warns() -> None:
    options = {"resume": True, "checkpoint_every": 5, "requeue_on_failure": 2}
    pending = _trainer(device_memory=FITS_SHARDED, **options).strategy
    pending.connect(Regressor())
    assert type(pending) is MGPUFSDPStrategy
    resumption = pending._resumption  # type: ignore[attr-defined]
    got = (resumption.auto.resume, resumption.checkpoint_every, resumption.requeue_on_failure)
    assert got == (True, 5, 2)
    with pytest.warns(UserWarning, match=r"mgpu_auto chose single_device, .* does not take resume=True"):
        assert type(_trainer(devices=1, resume=True).strategy) is not MGPUDDPStrategy
    with pytest.raises(ValueError, match="checkpoint_every must be 'auto'.*got 0"):
        MGPUAutoStrategy(checkpoint_every=0)


def test_a_fit_under_mgpu_auto_with_resume_goes_on_from_the_run_s_newest_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One process started 'by torchrun' decides mgpu_ddp, and resumes as mgpu_ddp itself does."""
    torchrun = EnvironmentFacts.detect(launcher="torchrun")

    def run(max_steps: int, resume: bool | None) -> L.Trainer:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=MGPUAutoStrategy(facts=torchrun, resume=resume),
            max_epochs=1,
            max_steps=max_steps,
            logger=False,
            callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2)],
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Regressor(), loader(regression_data(rows=12), 2))
        return trainer

    assert run(max_steps=3, resume=None).global_step == 3  # the newest checkpoint: step 2
    caplog.set_level(logging.INFO)
    trainer = run(max_steps=-1, resume=True)
    assert type(trainer.strategy) is MGPUDDPStrategy
    assert f"mgpu_ddp: resume=True: resuming from {tmp_path}/epoch=0-step=2.ckpt, saved at global step 2" in (
        caplog.text
    )
    assert trainer.global_step == 6


def test_the_process_group_options_reach_the_chosen_strategy_and_a_choice_without_one_warns() -> None:
    options = {"process_group_backend": "gloo", "timeout": timedelta(minutes=3), "stall_timeout": 60}
    ddp = _trainer(**options).strategy
    assert type(ddp) is MGPUDDPStrategy
    assert (ddp.process_group_backend, ddp._timeout, ddp.stall_timeout) == (
        "gloo",
        timedelta(minutes=3),
        60.0,
    )
    # decided again once the model is known: mgpu_fsdp gets them too
    pending = _trainer(device_memory=FITS_SHARDED, **options).strategy
    pending.connect(Regressor())
    assert type(pending) is MGPUFSDPStrategy
    assert (pending.process_group_backend, pending._timeout, pending.stall_timeout) == (
        "gloo",
        timedelta(minutes=3),
        60.0,
    )
    # one device has no process group: it runs, and says which options it goes on without
    with pytest.warns(UserWarning, match=r"mgpu_auto chose single_device, which does not take") as warned:
        assert type(_trainer(devices=1, stall_timeout=60).strategy) is not MGPUDDPStrategy
    (ours,) = [str(w.message) for w in warned if "mgpu_auto chose" in str(w.message)]
    assert "stall_timeout=60: mgpu_ddp and mgpu_fsdp take it, and this run goes on without it." in ours
    assert "ckpt_path" not in ours
