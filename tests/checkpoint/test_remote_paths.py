"""URLs of other file systems: written through fsspec in a transaction, or refused in one line."""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import safetensors.torch
import torch

from lightning_mgpu import export_state_dict, load_state_dict
from lightning_mgpu.cli.main import main
from tests.checkpoint._models import assert_same, net
from tests.checkpoint._sharded import plain_model


@pytest.fixture
def bucket() -> Iterator[str]:
    """A folder of fsspec's in-memory file system, emptied afterwards (it lives as long as the process)."""
    name = f"memory://bucket-{uuid.uuid4().hex}"
    yield name
    fs = fsspec.filesystem("memory")
    if fs.exists(name):
        fs.rm(name, recursive=True)


def test_export_to_a_url_writes_the_same_file_as_a_local_export(bucket: str, tmp_path: Path) -> None:
    model = net(seed=1)
    for name in ("w.safetensors", "w.pt"):
        report = export_state_dict(model, f"{bucket}/{name}")
        assert report.path == f"{bucket}/{name}"
        assert str(report).startswith(f"wrote {bucket}/{name} (")
        with fsspec.open(f"{bucket}/{name}", "rb") as f:
            data = f.read()
        assert len(data) == report.bytes
        (tmp_path / name).write_bytes(data)
        assert load_state_dict(net(seed=2), tmp_path / name).ok
    assert_same(model.state_dict(), safetensors.torch.load((tmp_path / "w.safetensors").read_bytes()))
    assert_same(model.state_dict(), torch.load(tmp_path / "w.pt", weights_only=True))


def test_export_from_a_mapped_checkpoint_to_a_url(bucket: str, tmp_path: Path) -> None:
    """A memory-mapped source cannot be copied file-to-file into a remote store: its bytes are written."""
    model = net(seed=3)
    export_state_dict(model, tmp_path / "src.safetensors")
    torch.save({"state_dict": model.state_dict()}, tmp_path / "src.ckpt")
    for source in ("src.safetensors", "src.ckpt"):
        export_state_dict(tmp_path / source, f"{bucket}/{source}.safetensors")
        with fsspec.open(f"{bucket}/{source}.safetensors", "rb") as f:
            assert_same(model.state_dict(), safetensors.torch.load(f.read()))


def test_export_of_a_sharded_folder_to_a_url(fsdp_run: tuple[Path, dict], bucket: str) -> None:
    """The folder's tensors, assembled one at a time, are written into the remote file as they are locally."""
    folder, reference = fsdp_run
    report = export_state_dict(folder, f"{bucket}/model.safetensors")
    assert report.removed_prefixes == ["model."]
    with fsspec.open(f"{bucket}/model.safetensors", "rb") as f:
        written = safetensors.torch.load(f.read())
    model = plain_model()
    model.load_state_dict(written, strict=True)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=0)


def test_a_failed_export_to_a_url_leaves_the_old_file(bucket: str) -> None:
    url = f"{bucket}/w.safetensors"
    export_state_dict(net(seed=1), url)
    with fsspec.open(url, "rb") as f:
        before = f.read()
    unstorable = {"w": torch.ones(2), "z": torch.ones(2, dtype=torch.complex64)}  # found while writing
    for name in ("w.safetensors", "new.safetensors"):
        with pytest.raises(ValueError, match="cannot store 'z' of dtype torch.complex64"):
            export_state_dict(unstorable, f"{bucket}/{name}")
    fs = fsspec.filesystem("memory")
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(bucket, detail=False)) == ["w.safetensors"]
    with fsspec.open(url, "rb") as f:
        assert f.read() == before


def test_a_file_url_is_written_atomically_as_a_local_path(tmp_path: Path) -> None:
    model = net(seed=4)
    report = export_state_dict(model, f"file://{tmp_path}/w.safetensors")
    assert report.path == tmp_path / "w.safetensors"
    assert_same(model.state_dict(), safetensors.torch.load_file(tmp_path / "w.safetensors"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]


@pytest.mark.skipif(importlib.util.find_spec("s3fs") is not None, reason="with s3fs it would connect")
def test_a_url_fsspec_cannot_open_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match="cannot write s3://bucket/w.safetensors") as err:
        export_state_dict(net(), "s3://bucket/w.safetensors")
    assert "s3fs" in str(err.value)
    assert "or give a local path" in str(err.value)
    with pytest.raises(ValueError, match="Protocol not known: nosuchfs"):
        export_state_dict(net(), "nosuchfs://bucket/w.safetensors")
    export_state_dict(net(), tmp_path / "w.safetensors")
    assert main(["export", str(tmp_path / "w.safetensors"), "s3://bucket/w.safetensors"]) == 1
    message = capsys.readouterr().err
    assert len(message.splitlines()) == 1
    assert "s3fs" in message
