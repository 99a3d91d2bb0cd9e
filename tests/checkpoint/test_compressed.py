"""Compressed zip records: a ``.pt`` / ``.ckpt`` read as ``torch.load`` reads it, a folder's chunk refused."""

from __future__ import annotations

import dataclasses
import pickle
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp

from lightning_mgpu import export_state_dict, inspect_checkpoint, load_state_dict
from tests.checkpoint._models import net
from tests.helpers import run_script


def deflated(path: Path, out: Path, values: Callable[[bytes], bytes] | None = None) -> Path:
    """``path`` (a ``torch.save`` file) with every record rewritten ZIP_DEFLATED, as a zip tool would;
    ``values`` replaces the bytes of each tensor record."""
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            data = source.read(info.filename)
            if values is not None and "/data/" in info.filename and not info.filename.endswith("id"):
                data = values(data)
            target.writestr(info.filename, data, compress_type=zipfile.ZIP_DEFLATED)
    return out


def lightning_checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    state = net(seed=1).state_dict()
    path = tmp_path / "plain.ckpt"
    torch.save(
        {"pytorch-lightning_version": "2.6.0", "state_dict": {f"model.{k}": v for k, v in state.items()}},
        path,
    )
    return path, state


def test_a_deflated_checkpoint_exports_and_loads_the_values_torch_load_reads(tmp_path: Path) -> None:
    plain, state = lightning_checkpoint(tmp_path)
    path = deflated(plain, tmp_path / "zipped.ckpt")
    with zipfile.ZipFile(path) as archive:  # the test's premise: compressed, and torch reads it exactly
        assert {info.compress_type for info in archive.infolist()} == {zipfile.ZIP_DEFLATED}
    read = torch.load(path, weights_only=True)["state_dict"]
    torch.testing.assert_close(read, {f"model.{k}": v for k, v in state.items()}, rtol=0, atol=0)

    export_state_dict(path, tmp_path / "w.safetensors")
    torch.testing.assert_close(safetensors.torch.load_file(tmp_path / "w.safetensors"), state, rtol=0, atol=0)
    export_state_dict(path, tmp_path / "w.pt")
    torch.testing.assert_close(torch.load(tmp_path / "w.pt", weights_only=True), state, rtol=0, atol=0)
    model = net(seed=2)
    assert load_state_dict(model, path).ok
    torch.testing.assert_close(model.state_dict(), state, rtol=0, atol=0)
    assert [t.name for t in inspect_checkpoint(path).tensors] == [f"model.{k}" for k in state]


def test_a_damaged_compressed_record_is_named_and_nothing_is_written(tmp_path: Path) -> None:
    plain, _ = lightning_checkpoint(tmp_path)
    path = deflated(plain, tmp_path / "zipped.ckpt")
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    raw = bytearray(path.read_bytes())
    raw[info.header_offset + 30 + len(info.filename) + 2] ^= 0x10  # inside its compressed bytes
    path.write_bytes(bytes(raw))

    for out in ("w.safetensors", "w.pt"):
        with pytest.raises(ValueError, match=r"zipped.ckpt is corrupt: .*record .*/data/0") as err:
            export_state_dict(path, tmp_path / out)
        assert "\n" not in str(err.value)
    model = net(seed=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"zipped.ckpt is corrupt"):
        load_state_dict(model, path)
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.ckpt", "zipped.ckpt"]


def _claim(path: Path, name: str, size: int) -> None:
    """Make ``name``'s local header and directory entry claim ``size`` inflated bytes."""
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        struct.pack_into("<I", raw, archive.getinfo(name).header_offset + 22, size)
    at = raw.index(b"PK\x01\x02")
    while at >= 0:
        length = struct.unpack_from("<H", raw, at + 28)[0]
        if raw[at + 46 : at + 46 + length] == name.encode():
            struct.pack_into("<I", raw, at + 24, size)
        at = raw.find(b"PK\x01\x02", at + 4)
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["claims 4 GiB", "inflates to 64 MiB"])
def test_a_small_record_inflating_beyond_its_tensor_is_refused_unread(tmp_path: Path, how: str) -> None:
    plain, _ = lightning_checkpoint(tmp_path)
    if how == "claims 4 GiB":
        path = deflated(plain, tmp_path / "zipped.ckpt")
        _claim(path, next(n for n in zipfile.ZipFile(path).namelist() if n.endswith("/data/0")), 0xF000_0000)
    else:  # a real zip bomb: 64 MiB of zeros in a 64 KiB record, for a tensor of a few bytes
        path = deflated(plain, tmp_path / "zipped.ckpt", lambda data: bytes(64 << 20))
    assert path.stat().st_size < 1 << 20

    message = (
        r"zipped.ckpt is corrupt or crafted: record .*/data/\d+ claims to inflate [\d,]+ bytes to [\d,]+"
    )
    with pytest.raises(ValueError, match=message):
        export_state_dict(path, tmp_path / "w.safetensors")
    with pytest.raises(ValueError, match=message):
        load_state_dict(net(), path)
    assert not (tmp_path / "w.safetensors").exists()


def test_a_compressed_chunk_in_a_sharded_folder_is_refused_in_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    dcp.save({"w": torch.arange(64.0)}, checkpoint_id=folder)
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # the test's own file
    ((index, record),) = metadata.storage_data.items()
    shard = folder / record.relative_path
    (tmp_path / "chunk.pt").write_bytes(shard.read_bytes()[record.offset : record.offset + record.length])
    shard.write_bytes(deflated(tmp_path / "chunk.pt", tmp_path / "zipped.pt").read_bytes())
    metadata.storage_data[index] = dataclasses.replace(record, offset=0, length=shard.stat().st_size)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))

    with pytest.raises(
        ValueError, match=r"__0_0.distcp is corrupt: 'w', chunk at \[0\] .* holds compressed records"
    ):
        export_state_dict(folder, tmp_path / "w.safetensors")
    assert not (tmp_path / "w.safetensors").exists()


def test_a_zip_bomb_is_refused_before_any_record_is_inflated(tmp_path: Path) -> None:
    """480 MiB of zeros in a record of under 1 MiB, read by a process that may allocate only 240 MiB more:
    the size check itself must not inflate it (torch 2.6-2.8 read every record even for ``meta``)."""
    plain, _ = lightning_checkpoint(tmp_path)
    deflated(plain, tmp_path / "bomb.ckpt", lambda data: bytes(480 << 20))
    result = run_script(
        """
        import resource, psutil
        from lightning_mgpu import export_state_dict
        import torch._subclasses.fake_tensor, torch.distributed  # imported before the limit is set
        vms = psutil.Process().memory_info().vms
        resource.setrlimit(resource.RLIMIT_AS, (vms + (240 << 20), resource.RLIM_INFINITY))
        try:
            export_state_dict("bomb.ckpt", "w.safetensors")
        except ValueError as err:
            print("refused:", err)
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.output[-3000:]
    assert "refused: " in result.stdout, result.output[-3000:]
    assert "is corrupt or crafted: record" in result.stdout
    assert "to 503,316,480" in result.stdout
    assert not (tmp_path / "w.safetensors").exists()
