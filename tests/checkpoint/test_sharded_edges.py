"""Sharded folders at the edges: values nested past the stack, many chunks, several state_dicts, links."""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_mgpu import export_state_dict, inspect_checkpoint
from lightning_mgpu.cli.main import main

_MARK = "NESTED_HERE"
_PICKLED_MARK = b"X" + len(_MARK).to_bytes(4, "little") + _MARK.encode()  # BINUNICODE, protocol 2


def nested(pickled: bytes, depth: int) -> bytes:
    """``pickled`` (protocol 2) with the string ``_MARK`` replaced by a list nested ``depth`` deep:
    EMPTY_LIST ``depth`` times, then APPEND ``depth - 1`` times, which no Python object could pickle."""
    assert pickled.count(_PICKLED_MARK) == 1
    return pickled.replace(_PICKLED_MARK, b"]" * depth + b"a" * (depth - 1))


def test_a_planner_data_nested_300000_deep_is_refused_in_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=folder)
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # the test's own file
    metadata.planner_data = {"w": _MARK}
    (folder / ".metadata").write_bytes(nested(pickle.dumps(metadata, protocol=2), 300_000))

    with pytest.raises(
        ValueError, match=r"\.metadata is corrupt: entry 'w' is placed at \[\[.*not a list of names"
    ):
        export_state_dict(folder, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_a_meta_pt_epoch_nested_200000_deep_is_shown_cut_short(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    folder = tmp_path / "ckpt"
    dcp.save({"state_dict": {"w": torch.ones(2)}}, checkpoint_id=folder)
    meta = folder / "meta.pt"
    torch.save({"epoch": _MARK, "global_step": 3}, meta)
    with zipfile.ZipFile(meta) as archive:
        records = [(name, archive.read(name)) for name in archive.namelist()]
    with zipfile.ZipFile(meta, "w") as archive:
        for name, data in records:
            archive.writestr(name, nested(data, 200_000) if name.endswith("data.pkl") else data)

    info = inspect_checkpoint(folder)
    assert any(detail.startswith("epoch [[[") and len(detail) < 100 for detail in info.details)
    assert main(["inspect", str(folder)]) == 0
    assert "global step 3" in capsys.readouterr().out
    export_state_dict(folder, tmp_path / "out.safetensors")
