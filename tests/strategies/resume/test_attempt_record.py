"""A run started again by hand resumes by itself when its checkpoint folder holds its unfinished attempt.

tests/scripts/attempt_fit.py trains one process under ``mgpu_ddp`` with no option set, a
``ModelCheckpoint`` every 2 steps in a fixed folder; its first run SIGKILLs itself at step 5. Run again
with the same command, nothing counts a restart (no torchrun, no SLURM) but the record in the folder: it
resumes from step 4 and ends with the weights of a run never cut. A finished run, or another command,
starts afresh.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu  # noqa: F401  # registers mgpu_ddp
from lightning_mgpu.strategies.resume.attempt_record import RECORD_NAME
from tests.helpers import Result, run_file, script_env
from tests.models import Regression


def _run(folder: Path, kill_at: int = 5, lr: float = 0.1) -> Result:
    """attempt_fit.py in ``folder``; the learning rate comes from the environment, not the command line."""
    folder.mkdir(exist_ok=True)
    env = {**script_env(), "FIT_LR": str(lr)}
    return run_file("attempt_fit.py", folder, args=[str(kill_at)], env=env, timeout=120)


def _assert_as_uncut(folder: Path, uncut: dict[str, Any]) -> None:
    out = torch.load(folder / "out.pt", weights_only=True)
    assert out["step"] == uncut["step"] == 16
    torch.testing.assert_close(out["weight"], uncut["weight"], rtol=0, atol=1e-6)


def test_a_run_killed_and_started_again_by_hand_resumes_from_its_folder(tmp_path: Path) -> None:
    """About 15 s: the uncut run, the killed one and the one started again."""
    assert _run(tmp_path / "uncut").returncode == 0
    uncut = torch.load(tmp_path / "uncut" / "out.pt", weights_only=True)
    folder = tmp_path / "cut"
    folder.mkdir()
    (folder / "kill-once").touch()
    killed = _run(folder)
    assert killed.returncode == -9, killed.output[-3000:]
    record = json.loads((folder / "ckpts" / RECORD_NAME).read_text())
    assert (record["attempt"], record["finished"]) == (0, False)

    again = _run(folder)
    assert again.returncode == 0, again.output[-3000:]
    assert (
        f"mgpu_ddp: attempt 2 of this run (the one before, in {folder}/ckpts, did not finish): resuming from"
        f" {folder}/ckpts/epoch=0-step=4.ckpt, saved at global step 4 (epoch 0)" in again.output
    )
    _assert_as_uncut(folder, uncut)
    record = json.loads((folder / "ckpts" / RECORD_NAME).read_text())
    assert (record["attempt"], record["finished"]) == (1, True)

    # finished: the same command once more is a new run, from scratch
    third = _run(folder)
    assert third.returncode == 0, third.output[-3000:]
    assert "resuming from" not in third.output
    assert json.loads((folder / "ckpts" / RECORD_NAME).read_text())["attempt"] == 0


def test_another_command_after_an_unfinished_attempt_starts_afresh(tmp_path: Path) -> None:
    """About 10 s: the arguments changed since the killed attempt, so it is another run."""
    (tmp_path / "kill-once").touch()
    assert _run(tmp_path, kill_at=5).returncode == -9
    other = _run(tmp_path, kill_at=6)  # another argument: another run, which nothing kills
    assert other.returncode == 0, other.output[-3000:]
    assert "resuming from" not in other.output
    assert torch.load(tmp_path / "out.pt", weights_only=True)["step"] == 16


def test_a_restart_never_resumes_from_an_earlier_runs_checkpoints(tmp_path: Path) -> None:
    """About 20 s: a finished run leaves its checkpoint; the next run in the folder (another learning rate,
    the same command line) is killed before its first save, and started again it starts from scratch."""
    assert _run(tmp_path / "uncut", kill_at=1, lr=0.05).returncode == 0
    uncut = torch.load(tmp_path / "uncut" / "out.pt", weights_only=True)
    folder = tmp_path / "shared"
    assert _run(folder, kill_at=1).returncode == 0  # the earlier run, at lr 0.1
    earlier = folder / "ckpts" / "epoch=1-step=16.ckpt"
    assert earlier.is_file()
    (folder / "kill-once").touch()
    assert _run(folder, kill_at=1, lr=0.05).returncode == -9  # killed at step 1, before any save

    again = _run(folder, kill_at=1, lr=0.05)
    assert again.returncode == 0, again.output[-3000:]
    assert (
        "mgpu_ddp: not resuming from 1 checkpoint(s) written before this run's first attempt started, an"
        f" earlier run's (the newest: {earlier}); to go on from one of them, pass it as fit(ckpt_path=...) or"
        " use resume=True" in again.output
    )
    assert (
        f"mgpu_ddp: attempt 2 of this run (the one before, in {folder}/ckpts, did not finish): no complete"
        f" checkpoint in {folder}/ckpts, {folder}; training starts from scratch" in again.output
    )
    _assert_as_uncut(folder, uncut)


class _FailsOnce(Regression):
    """Raises at step 5 while ``fail`` is set: a bug fixed before the next fit."""

    fail = True

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.fail and self.global_step == 5:
            raise RuntimeError("a bug in training_step")
        return super().training_step(batch, batch_idx)


def _fit_in_process(folder: Path, fail: bool) -> tuple[L.Trainer, torch.Tensor]:
    torch.manual_seed(0)
    module = _FailsOnce()
    module.fail = fail
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy="mgpu_ddp", max_epochs=1, logger=False,
        callbacks=[ModelCheckpoint(dirpath=folder / "ckpts", every_n_train_steps=2)],
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=generator), torch.randn(32, 1, generator=generator))
    trainer.fit(module, DataLoader(data, batch_size=4))
    return trainer, module.net.weight.detach().clone()


def test_a_second_fit_in_the_process_whose_fit_failed_starts_afresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A notebook cell run again after a fix: a fresh model and Trainer, the same folder, no ckpt_path.
    Nothing outside the process restarted it, so it trains all 8 steps from the fresh model."""
    _, uncut = _fit_in_process(tmp_path / "uncut", fail=False)
    with pytest.raises(RuntimeError, match="a bug in training_step"):
        _fit_in_process(tmp_path / "cell", fail=True)
    assert json.loads((tmp_path / "cell" / "ckpts" / RECORD_NAME).read_text())["finished"] is False
    caplog.set_level(logging.INFO)
    trainer, weight = _fit_in_process(tmp_path / "cell", fail=False)
    assert "resuming from" not in caplog.text
    assert "mgpu_ddp: an earlier fit in this process did not finish" in caplog.text
    assert trainer.global_step == 8
    torch.testing.assert_close(weight, uncut, rtol=0, atol=1e-6)


def test_fast_dev_run_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's promise for ``fast_dev_run``: no checkpoint, no log, so no attempt record either."""
    trainer = L.Trainer(
        default_root_dir=tmp_path, accelerator="cpu", devices=1, strategy="mgpu_ddp", fast_dev_run=True,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    monkeypatch.chdir(tmp_path)
    trainer.fit(Regression(), DataLoader(data, batch_size=4))
    assert list(tmp_path.iterdir()) == []
