"""``resume``: when a ``fit`` without ``ckpt_path`` resumes by itself, and what it says; one real process.

The restart is the one torchrun announces (``TORCHELASTIC_RESTART_COUNT``); the multi-process
restarts themselves run in ``test_torchrun.py``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MGPUDDPStrategy
from tests.models import Regression


def _fit(folder: Path, max_steps: int, resume: bool | None = None, ckpt_path: str | None = None) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=MGPUDDPStrategy(resume=resume),
        max_steps=max_steps,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=folder / "ckpts", every_n_train_steps=2, save_top_k=-1)],
        default_root_dir=folder,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    trainer.fit(Regression(), DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
    return trainer


def _resumed_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("mgpu_ddp: ")]
    return [line for line in lines if "resum" in line or "from scratch" in line]


@pytest.fixture
def restarted(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    caplog.set_level(logging.INFO)


def test_a_restart_resumes_from_the_newest_complete_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fit(tmp_path, max_steps=4)
    newest = tmp_path / "ckpts" / "epoch=0-step=4.ckpt"
    newest.write_bytes(newest.read_bytes()[:1000])  # cut while being written
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    caplog.set_level(logging.INFO)
    trainer = _fit(tmp_path, max_steps=6)
    assert trainer.global_step == 6
    assert _resumed_lines(caplog)[-2:] == [
        f"mgpu_ddp: not resuming from {newest}: its zip directory cannot be read (File is not a zip file):"
        f" it was cut while being written; moved aside to {newest}.incomplete",
        "mgpu_ddp: attempt 2 of this job (restarted by torchrun): resuming from"
        f" {tmp_path}/ckpts/epoch=0-step=2.ckpt, saved at global step 2 (epoch 0)",
    ]


@pytest.mark.usefixtures("restarted")
def test_a_restart_without_a_usable_checkpoint_starts_from_scratch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = _fit(tmp_path, max_steps=2)
    assert trainer.global_step == 2
    assert _resumed_lines(caplog)[-1] == (
        "mgpu_ddp: attempt 2 of this job (restarted by torchrun): no complete checkpoint in"
        f" {tmp_path}/ckpts, {tmp_path}; training starts from scratch"
    )


@pytest.mark.usefixtures("restarted")
def test_resume_false_and_an_explicit_ckpt_path_win(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _fit(tmp_path, max_steps=4)
    caplog.clear()
    assert _fit(tmp_path, max_steps=4, resume=False).global_step == 4  # from scratch: four steps again
    first = str(tmp_path / "ckpts" / "epoch=0-step=2.ckpt")
    assert _fit(tmp_path, max_steps=4, ckpt_path=first).global_step == 4
    assert f"Restoring states from the checkpoint path at {first}" in caplog.text
    assert not _resumed_lines(caplog)


def test_resume_true_resumes_a_first_attempt_too(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _fit(tmp_path, max_steps=2)
    caplog.set_level(logging.INFO)
    assert _fit(tmp_path, max_steps=4, resume=True).global_step == 4
    assert _resumed_lines(caplog)[-1] == (
        f"mgpu_ddp: resume=True: resuming from {tmp_path}/ckpts/epoch=0-step=2.ckpt, saved at global step 2"
        " (epoch 0)"
    )


def test_resume_must_be_a_bool_or_none() -> None:
    with pytest.raises(ValueError, match=r"resume must be True .* got 'yes'"):
        MGPUDDPStrategy(resume="yes")  # type: ignore[arg-type]


def test_a_torchrun_restart_leaves_out_the_checkpoints_of_an_earlier_job(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An earlier job finished in the folder; this job's first attempt saved nothing before it failed."""
    _fit(tmp_path, max_steps=4)
    _fit(tmp_path, max_steps=1)  # this job's first attempt: records its start, saves no checkpoint
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    caplog.set_level(logging.INFO)
    assert _fit(tmp_path, max_steps=4).global_step == 4
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("mgpu_ddp: ")]
    assert (
        "mgpu_ddp: not resuming from 2 checkpoint(s) written before this run's first attempt started, an"
        f" earlier run's (the newest: {tmp_path}/ckpts/epoch=0-step=4.ckpt); to go on from one of them, pass"
        " it as fit(ckpt_path=...) or use resume=True" in lines
    )
    assert _resumed_lines(caplog)[-1] == (
        "mgpu_ddp: attempt 2 of this job (restarted by torchrun): no complete checkpoint in"
        f" {tmp_path}/ckpts, {tmp_path}; training starts from scratch"
    )
