"""The run summary's file list (``lightning_mgpu.runner``) on a folder laid out as a sharded run leaves it."""

from __future__ import annotations

from pathlib import Path

import lightning as L

from lightning_mgpu.runner import _describe_files


def test_a_sharded_checkpoint_is_one_entry_with_its_shard_count(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints" / "last.ckpt"
    folder.mkdir(parents=True)
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"):
        (folder / name).write_bytes(b"x")
    (tmp_path / "checkpoints" / "last.safetensors").write_bytes(b"x")
    (tmp_path / "config.yaml").write_text("x")
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert _describe_files(trainer, tmp_path) == [
        "checkpoints/last.ckpt/  checkpoint, sharded: a folder of 2 shard file(s)",
        "checkpoints/last.safetensors  plain weights of last.ckpt",
        "config.yaml  the resolved config",
    ]
