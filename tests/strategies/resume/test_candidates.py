"""Which checkpoint a restart resumes from: the newest one a kill did not cut short; real files only."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from lightning_mgpu.strategies.resume.candidates import find_checkpoints, interruption, newest_complete
from lightning_mgpu.strategies.resume.restart import Restart, restart_of


def _save(path: Path, when: float, step: int = 1) -> Path:
    torch.save({"global_step": step, "state_dict": {"w": torch.ones(3)}}, path)
    os.utime(path, (when, when))
    return path


def _sharded(folder: Path, when: float, *, index: bool = True, meta: bool = True) -> Path:
    folder.mkdir()
    shard = folder / "__0_0.distcp"
    shard.write_bytes(b"shard")
    os.utime(shard, (when - 2, when - 2))
    if index:
        (folder / ".metadata").write_bytes(b"index")
        os.utime(folder / ".metadata", (when - 1, when - 1))
    if meta:
        _save(folder / "meta.pt", when)
    return folder


def test_a_half_written_file_is_skipped_with_the_reason(tmp_path: Path) -> None:
    good = _save(tmp_path / "epoch=0-step=3.ckpt", 1000)
    cut = _save(tmp_path / "epoch=1-step=6.ckpt", 2000)
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    assert interruption(good) is None
    assert "cut while being written" in (interruption(cut) or "")
    choice = newest_complete(find_checkpoints([tmp_path], None))
    assert choice.path == str(good)
    assert [s.path for s in choice.skipped] == [str(cut)]


def test_newest_means_last_written_and_hpc_checkpoints_count_too(tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    _save(ckpts / "epoch=0-step=3.ckpt", 1000)
    hpc = _save(tmp_path / "hpc_ckpt_1.ckpt", 3000)
    _save(tmp_path / "other.ckpt", 4000)  # not in a checkpoint folder, not an hpc_ckpt: not the run's
    assert find_checkpoints([ckpts], tmp_path)[0] == hpc


def test_a_sharded_folder_is_complete_only_with_its_index_and_lightnings_meta(tmp_path: Path) -> None:
    assert interruption(_sharded(tmp_path / "a.ckpt", 1000)) is None
    assert "no .metadata" in (interruption(_sharded(tmp_path / "b.ckpt", 1000, index=False)) or "")
    assert "no meta.pt" in (interruption(_sharded(tmp_path / "c.ckpt", 1000, meta=False)) or "")
    rewritten = _sharded(tmp_path / "d.ckpt", 1000)
    os.utime(rewritten / "__0_0.distcp", (5000, 5000))  # a later save got as far as this shard
    assert "a save over it did not finish" in (interruption(rewritten) or "")


def test_a_link_to_a_removed_checkpoint_and_nothing_at_all(tmp_path: Path) -> None:
    (tmp_path / "last.ckpt").symlink_to(tmp_path / "gone.ckpt")
    choice = newest_complete(find_checkpoints([tmp_path], None), [str(tmp_path)])
    assert choice.path is None
    assert "does not exist" in choice.skipped[0].reason
    assert newest_complete(find_checkpoints([tmp_path / "missing"], None)).path is None


def test_restart_counts_of_torchrun_and_slurm() -> None:
    assert restart_of({}) == Restart(0, "")
    assert restart_of({"TORCHELASTIC_RESTART_COUNT": "0", "SLURM_RESTART_COUNT": "0"}).is_restart is False
    assert restart_of({"TORCHELASTIC_RESTART_COUNT": "2"}).describe() == (
        "attempt 3 of this job (restarted by torchrun)"
    )
    assert restart_of({"SLURM_RESTART_COUNT": "1", "TORCHELASTIC_RESTART_COUNT": "1"}) == Restart(
        2, "SLURM and torchrun"
    )
    assert restart_of({"SLURM_RESTART_COUNT": "x"}) == Restart(0, "")
