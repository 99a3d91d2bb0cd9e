"""Sharded folders at the edges: values nested past the stack, many chunks, several state_dicts, links."""

from __future__ import annotations

import dataclasses
import io
import itertools
import pickle
import random
import zipfile
from collections import Counter
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from lightning_mgpu import export_state_dict, inspect_checkpoint
from lightning_mgpu.checkpoint._dcp_plan import Chunk, Record, _cover_fault
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


def chunked(folder: Path, tensor: torch.Tensor, boxes: list[tuple[tuple[int, int], tuple[int, int]]]) -> Path:
    """A folder holding ``tensor`` as entry ``w`` in the chunks ``boxes`` (``(offsets, sizes)``), each
    saved from the tensor's values there, as ranks of a 2-D mesh would save it."""
    dcp.save({"w": torch.zeros_like(tensor)}, checkpoint_id=folder)
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # the test's own file
    (template,) = metadata.storage_data.values()
    shard, chunks, storage = bytearray(), [], {}
    for (row, col), (rows, cols) in boxes:
        buffer = io.BytesIO()
        torch.save(tensor[row : row + rows, col : col + cols].clone(), buffer)
        offsets = torch.Size([row, col])
        chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([rows, cols])))
        storage[MetadataIndex("w", offsets)] = dataclasses.replace(
            template, offset=len(shard), length=len(buffer.getvalue())
        )
        shard += buffer.getvalue()
    (folder / template.relative_path).write_bytes(bytes(shard))
    metadata.state_dict_metadata["w"].chunks = chunks
    metadata.storage_data = storage
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    return folder


def grid(n: int, size: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    return [((i * size, j * size), (size, size)) for i in range(n) for j in range(n)]


def test_a_grid_of_chunks_is_read_exactly(tmp_path: Path) -> None:
    values = torch.arange(40 * 40, dtype=torch.float32).reshape(40, 40)
    folder = chunked(tmp_path / "ckpt", values, grid(20, 2))  # 400 chunks of 2 x 2
    export_state_dict(folder, tmp_path / "w.safetensors")
    torch.testing.assert_close(
        safetensors.torch.load_file(tmp_path / "w.safetensors")["w"], values, rtol=0, atol=0
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # over the next chunk's values and leaving its own column 8 unwritten: either is named
        ("shifted", r"has chunks (at \[6, 9\] and \[6, 10\] that overlap|.* \(the value at \[[67], 8\]\))"),
        (
            "missing",
            r"has chunks that leave part of its shape \[40, 40\] unwritten \(the value at \[38, 38\]\)",
        ),
        ("doubled", r"has chunks at \[0, 0\] and \[0, 0\] that overlap"),  # twice the values, no hole
    ],
)
def test_chunks_that_overlap_or_leave_a_hole_are_refused(tmp_path: Path, change: str, message: str) -> None:
    boxes = grid(20, 2)
    if change == "shifted":
        boxes[3 * 20 + 4] = ((6, 9), (2, 2))
    elif change == "missing":
        boxes.pop()
    else:
        boxes[1] = boxes[0]
    folder = chunked(tmp_path / "ckpt", torch.ones(40, 40), boxes)
    with pytest.raises(ValueError, match=r"\.metadata is corrupt: entry 'w' " + message):
        export_state_dict(folder, tmp_path / "w.safetensors")
    assert not (tmp_path / "w.safetensors").exists()


def test_a_folder_holding_several_state_dicts_asks_for_key(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    torch.manual_seed(0)
    model, ema = (
        nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)),
        nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)),
    )
    folder = tmp_path / "ckpt"
    dcp.save({"model": {"enc": model.state_dict()}, "step": 7, "ema": ema.state_dict()}, checkpoint_id=folder)

    with pytest.raises(ValueError, match=r"several state_dicts \('model', 'ema'\); pass key='model'"):
        export_state_dict(folder, tmp_path / "w.safetensors")
    assert main(["export", str(folder), str(tmp_path / "w.safetensors")]) == 1
    assert "--key model" in capsys.readouterr().err
    assert not (tmp_path / "w.safetensors").exists()

    export_state_dict(folder, tmp_path / "model.safetensors", key="model")  # nested names joined with dots
    expected = {f"enc.{k}": v for k, v in model.state_dict().items()}
    torch.testing.assert_close(
        safetensors.torch.load_file(tmp_path / "model.safetensors"), expected, rtol=0, atol=0
    )
    export_state_dict(folder, tmp_path / "ema.safetensors", key="ema")
    torch.testing.assert_close(
        safetensors.torch.load_file(tmp_path / "ema.safetensors"), ema.state_dict(), rtol=0, atol=0
    )


def test_the_coverage_check_agrees_with_counting_every_value() -> None:
    """On 2,000 random layouts of up to 6 chunks in 1 to 3 dimensions, exact cover or not as counting
    every value says, and what it names is true: two chunks sharing a value, or a value in none."""
    rng = random.Random(0)
    record = Record("__0_0.distcp", 0, 0)
    for _ in range(2000):
        shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        chunks = []
        for _ in range(rng.randint(0, 6)):
            offsets = tuple(rng.randint(0, d - 1) for d in shape)
            sizes = tuple(rng.randint(0, d - o) for o, d in zip(offsets, shape, strict=True))
            chunks.append(Chunk(offsets, sizes, record))
        counts = Counter(
            point
            for c in chunks
            for point in itertools.product(
                *(range(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))
            )
        )
        exact = all(counts[point] == 1 for point in itertools.product(*map(range, shape)))
        fault = _cover_fault(chunks, shape)
        assert (fault is None) == exact, (shape, chunks)
        if isinstance(fault, tuple):
            a, b = fault
            assert all(
                x < y + t and y < x + s
                for x, s, y, t in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
            )
        elif fault is not None:
            assert counts[tuple(fault)] == 0
