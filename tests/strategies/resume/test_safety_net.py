"""``checkpoint_every``: a resumable checkpoint every N steps or minutes, by itself where runs restart."""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MGPUDDPStrategy
from lightning_mgpu.strategies.resume.attempt_record import RECORD_NAME
from lightning_mgpu.strategies.resume.safety_net import ResumeCheckpoint, plan_check, restartable
from tests.models import Regression


def _fit(folder: Path, every: object = "auto", checkpointing: bool = True, **strategy: object) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=MGPUDDPStrategy(checkpoint_every=every, **strategy),  # type: ignore[arg-type]
        max_steps=7,
        logger=False,
        enable_checkpointing=checkpointing,
        default_root_dir=folder,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    trainer.fit(Regression(), DataLoader(data, batch_size=4))
    return trainer


def test_every_n_steps_keeps_the_newest_and_a_restart_resumes_from_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO)
    _fit(tmp_path, every=3, checkpointing=False)  # the safety net's checkpoints only
    assert "mgpu_ddp: checkpoint_every: a resumable checkpoint every 3 steps in" in caplog.text
    saved = sorted(p.name for p in (tmp_path / "resume").iterdir())
    assert saved == [RECORD_NAME, "resume-epoch=0-step=6.ckpt"]  # the attempt's record beside it
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    trainer = _fit(tmp_path, every=3, checkpointing=False)
    assert trainer.global_step == 7
    assert (
        f"resuming from {tmp_path}/resume/resume-epoch=0-step=6.ckpt, saved at global step 6" in caplog.text
    )


def test_auto_is_on_only_where_the_run_can_restart_and_checkpoints(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO)
    trainer = _fit(tmp_path / "plain")
    assert not [cb for cb in trainer.callbacks if isinstance(cb, ResumeCheckpoint)]  # type: ignore[attr-defined]
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    assert not [
        cb
        for cb in _fit(tmp_path / "off", checkpointing=False).callbacks  # type: ignore[attr-defined]
        if isinstance(cb, ResumeCheckpoint)
    ]
    (net,) = [
        cb
        for cb in _fit(tmp_path / "restartable").callbacks  # type: ignore[attr-defined]
        if isinstance(cb, ResumeCheckpoint)
    ]
    assert net.period == 30 * 60
    assert (
        "mgpu_ddp: the run can be restarted (torchrun --max-restarts=2): a resumable checkpoint every 30"
        f" minutes in {tmp_path}/restartable/resume" in caplog.text
    )


def test_what_can_restart_a_run() -> None:
    assert restartable({"TORCHELASTIC_MAX_RESTARTS": "0"}, LightningEnvironment()) is None
    assert restartable({"TORCHELASTIC_MAX_RESTARTS": "3"}, None) == "torchrun --max-restarts=3"


@pytest.mark.parametrize("every", [0, -2, True, 1.5, "30min", timedelta(0)])
def test_checkpoint_every_says_what_it_accepts(every: object) -> None:
    with pytest.raises(ValueError, match=r"checkpoint_every must be 'auto' .* got "):
        MGPUDDPStrategy(checkpoint_every=every)  # type: ignore[arg-type]


def test_rank_0_plans_the_next_check_halfway_to_the_deadline() -> None:
    assert plan_check(10, now=100.0, last_save=99.0, last_check=None, period=10.0) == (False, 11)
    # 0.1 s a step, 8 s left: check again after 40 steps
    assert plan_check(11, now=102.0, last_save=100.0, last_check=(10, 101.9), period=10.0) == (False, 51)
    # a second left: 5 steps; past the deadline: save, and the next period's first check after 50 steps
    assert plan_check(51, now=109.0, last_save=100.0, last_check=(50, 108.9), period=10.0) == (False, 56)
    assert plan_check(56, now=110.1, last_save=100.0, last_check=(51, 109.6), period=10.0) == (True, 106)


class _Slow(Regression):
    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        time.sleep(0.01)
        return super().training_step(batch, batch_idx)


def test_by_time_it_checks_far_fewer_times_than_it_steps(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="lightning_mgpu.strategies.resume.safety_net")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=MGPUDDPStrategy(checkpoint_every=timedelta(seconds=0.5)),
        max_steps=160,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = TensorDataset(torch.randn(640, 4), torch.randn(640, 1))
    trainer.fit(_Slow(), DataLoader(data, batch_size=4))
    checks = [r.getMessage() for r in caplog.records if "next check at step" in r.getMessage()]
    saves = [line for line in checks if "save True" in line]
    assert len(saves) >= 2  # 160 steps of at least 10 ms, a save every 0.5 s
    assert len(checks) < 160 / 4
    assert len(list((tmp_path / "resume").glob("*.ckpt"))) == 1  # the newest only
