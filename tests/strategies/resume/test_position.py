"""The training loader's place in its epoch goes into every checkpoint and comes back; one real process.

``mgpu_ddp`` on one process still deals the epoch with a ``DistributedSampler``, as on many: a fit
cut after a mid-epoch checkpoint and resumed from it sees every sample once per epoch and ends
with the uncut fit's weights. The cuts across processes run in ``test_torchrun.py``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from lightning_mgpu import MGPUDDPStrategy
from lightning_mgpu.strategies.resume.position import ResumableSampler

SAMPLES = 24


class _Indexed(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 4, generator=generator)
        self.y = torch.randn(SAMPLES, 1, generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


class _Streamed(IterableDataset):
    """``_Indexed``'s samples in order, as a stream: no length, no sampler."""

    def __iter__(self) -> Any:
        data = _Indexed()
        return (data[i] for i in range(SAMPLES))


class _Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(batch[1]), batch[2])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class _Visits(Callback):
    """How many times each sample went through a step the weights include, per epoch (saved with them)."""

    def __init__(self) -> None:
        self.visits: dict[int, list[int]] = {}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        batch = args[2]
        epoch = self.visits.setdefault(trainer.current_epoch, [0] * SAMPLES)
        for i in batch[0].tolist():
            epoch[i] += 1

    def state_dict(self) -> dict[str, Any]:
        return {"visits": self.visits}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.visits = state["visits"]


def _fit(
    folder: Path,
    batch_size: int,
    max_steps: int = -1,
    resume: bool = False,
    stream: bool = False,
    workers: dict[str, Any] | None = None,
) -> tuple[L.Trainer, Any]:
    visits = _Visits()
    module = _Regression()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=MGPUDDPStrategy(resume=resume),
        max_epochs=2,
        max_steps=max_steps,
        logger=False,
        callbacks=[visits, ModelCheckpoint(dirpath=folder / "ckpts", every_n_train_steps=3)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = (
        DataLoader(_Streamed(), batch_size=batch_size)
        if stream
        else DataLoader(_Indexed(), batch_size=batch_size, shuffle=True, **(workers or {}))
    )
    trainer.fit(module, data)
    return trainer, (visits.visits, module.net.weight.detach().clone())


def test_a_fit_cut_mid_epoch_resumes_at_the_next_batch_in_the_same_order(tmp_path: Path) -> None:
    _, (uncut_visits, uncut_weight) = _fit(tmp_path / "uncut", batch_size=4)
    _fit(tmp_path / "cut", batch_size=4, max_steps=3)  # the checkpoint: batch 3 of 6 in epoch 0
    trainer, (visits, weight) = _fit(tmp_path / "cut", batch_size=4, resume=True)
    assert trainer.global_step == 12
    assert visits == uncut_visits == {0: [1] * SAMPLES, 1: [1] * SAMPLES}
    torch.testing.assert_close(weight, uncut_weight, rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.processes  # the DataLoader's workers, which tests/processes.py cannot see
@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent-workers"])
@pytest.mark.parametrize("cut_at", [3, 6], ids=["mid-epoch", "epoch-end"])
def test_a_loader_with_workers_resumes_mid_epoch_and_at_an_epoch_end_exactly(
    tmp_path: Path, cut_at: int, persistent: bool
) -> None:
    """Workers draw their first indices when the loader's iterator is made, before Lightning sets the
    sampler's epoch: a checkpoint at the end of epoch 0 must not leave out epoch 1's first samples."""
    workers = {"num_workers": 2, "persistent_workers": persistent}
    _, (uncut_visits, uncut_weight) = _fit(tmp_path / "uncut", batch_size=4, workers=workers)
    _fit(tmp_path / "cut", batch_size=4, max_steps=cut_at, workers=workers)
    trainer, (visits, weight) = _fit(tmp_path / "cut", batch_size=4, resume=True, workers=workers)
    assert trainer.global_step == 12
    assert visits == uncut_visits == {0: [1] * SAMPLES, 1: [1] * SAMPLES}
    torch.testing.assert_close(weight, uncut_weight, rtol=0, atol=1e-6)


def test_another_global_batch_size_goes_on_after_the_samples_seen_and_says_how(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _fit(tmp_path, batch_size=4, max_steps=3)  # 12 of 24 samples seen
    caplog.set_level(logging.INFO)
    trainer, (visits, _) = _fit(tmp_path, batch_size=8, resume=True)
    assert (
        "mgpu_ddp: the global batch is 8 samples now (1 x 8), 4 in the checkpoint: epoch 0 goes on at"
        " sample 8 of 24, batch 1 of the new size; 4 samples see a second step this epoch" in caplog.text
    )
    assert sorted(visits[0]) == [1] * 20 + [2] * 4  # none left out
    assert visits[1] == [1] * SAMPLES
    assert trainer.global_step == 3 + 2 + 3


def test_another_strategy_resumes_the_checkpoint_without_the_position(tmp_path: Path) -> None:
    """The position is a callback's state: a strategy without it ignores it (Lightning warns)."""
    _fit(tmp_path, batch_size=4, max_steps=3)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    # Lightning lists every callback state the checkpoint holds, in the order they were saved
    with pytest.warns(UserWarning, match=r"Please add the following callbacks: \[.*'LoaderPosition'"):
        trainer.fit(
            _Regression(),
            DataLoader(_Indexed(), batch_size=4, shuffle=True),
            ckpt_path=str(tmp_path / "ckpts" / "epoch=0-step=3.ckpt"),
        )
    assert trainer.global_step == SAMPLES // 4


def test_a_stream_resumed_mid_epoch_is_replayed_from_its_start_and_says_so(tmp_path: Path) -> None:
    """An IterableDataset keeps no position: Lightning, which cannot count its batches, does not warn."""
    _fit(tmp_path, batch_size=4, max_steps=3, stream=True)
    with pytest.warns(UserWarning, match=r"mgpu_ddp: resumed 3 batches into epoch 0 with a training loader"):
        _, (visits, _) = _fit(tmp_path, batch_size=4, resume=True, stream=True)
    assert visits[0] == [2] * 12 + [1] * 12  # as the warning says: the first 3 batches twice
    assert visits[1] == [1] * SAMPLES


def test_the_sampler_leaves_out_the_consumed_samples_of_that_epoch_only() -> None:
    inner = DistributedSampler(range(10), num_replicas=2, rank=1, shuffle=True, seed=3)
    sampler = ResumableSampler(inner)
    inner.set_epoch(4)
    whole = list(inner)
    sampler.skip_next(epoch=4, samples=2)
    assert list(sampler) == whole[2:]
    assert list(sampler) == whole  # once
    sampler.skip_next(epoch=3, samples=2)
    assert list(sampler) == whole  # not the epoch the checkpoint counted in
    assert len(sampler) == len(inner) == 5


def test_the_global_batches_stay_the_same_with_other_processes_and_the_same_global_batch() -> None:
    """Two processes x batches of 2, cut after 3 batches, go on as four processes x batches of 1."""

    def global_batches(processes: int, batch_size: int, skip_batches: int) -> list[set[int]]:
        ranks = []
        for rank in range(processes):
            sampler = ResumableSampler(DistributedSampler(range(16), processes, rank, shuffle=True, seed=0))
            sampler.set_epoch(1)
            sampler.skip_next(1, skip_batches * batch_size)
            ranks.append(list(sampler))
        steps = len(ranks[0]) // batch_size
        return [{i for r in ranks for i in r[s * batch_size : (s + 1) * batch_size]} for s in range(steps)]

    assert global_batches(4, 1, skip_batches=3) == global_batches(2, 2, skip_batches=0)[3:]
