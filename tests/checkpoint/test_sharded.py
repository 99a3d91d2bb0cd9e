"""Sharded checkpoint folders (``torch.distributed.checkpoint``) exported, loaded, inspected as plain weights.

One real 2-process run of Lightning's ``ModelParallelStrategy`` (FSDP2 on gloo) writes the folder
that most checks share (``fsdp_run``, see ``_sharded``), with every tensor split over both ranks'
files; the rest save folders in this process, which ``torch.distributed.checkpoint`` does without
a process group.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_mgpu import export_state_dict, inspect_checkpoint, load_state_dict
from lightning_mgpu.cli.main import main
from tests.checkpoint._sharded import Touch, copy_of, only_inputs_left, plain_model
from tests.helpers import run_file


def test_the_run_wrote_shards_of_every_tensor(fsdp_run: tuple[Path, dict]) -> None:
    folder, _ = fsdp_run
    assert sorted(p.name for p in folder.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "meta.pt",
    ]
    chunks = (
        dcp.FileSystemReader(folder).read_metadata().state_dict_metadata["state_dict.model.0.weight"].chunks
    )
    assert len(chunks) == 2  # so export assembles each tensor from both ranks' files


def test_export_loads_strictly_into_a_plain_model(fsdp_run: tuple[Path, dict], tmp_path: Path) -> None:
    folder, reference = fsdp_run
    report = export_state_dict(folder, tmp_path / "model.safetensors")
    assert report.removed_prefixes == ["model."]
    assert report.tensors == 4  # the AdamW state beside the weights is not exported

    model = plain_model()
    safetensors.torch.load_model(model, tmp_path / "model.safetensors", strict=True)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=0)

    # cast while streaming (safetensors), and with every tensor read first (torch.save)
    export_state_dict(folder, tmp_path / "model_bf16.safetensors", dtype="bfloat16")
    export_state_dict(folder, tmp_path / "model_bf16.pt", dtype="bfloat16")
    for half in (
        safetensors.torch.load_file(tmp_path / "model_bf16.safetensors"),
        torch.load(tmp_path / "model_bf16.pt", weights_only=True),
    ):
        assert half.keys() == reference.keys()
        for name, value in half.items():
            torch.testing.assert_close(value, reference[name].bfloat16(), rtol=0, atol=0)


def test_load_state_dict_reads_the_folder(fsdp_run: tuple[Path, dict]) -> None:
    folder, reference = fsdp_run
    model = plain_model()
    report = load_state_dict(model, folder, strict=True)
    assert report.loaded == 4
    assert report.removed_prefixes == ["model."]
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=0)

    dp = nn.DataParallel(plain_model())
    load_state_dict(dp, folder)
    torch.testing.assert_close(dp.module[2].bias, reference["2.bias"], rtol=0, atol=0)

    with pytest.raises(ValueError, match=r"each rank saves its own part, in its own order\), so by_order"):
        load_state_dict(plain_model(), folder, by_order=True)


def test_inspect_and_the_command_line(
    fsdp_run: tuple[Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    folder, reference = fsdp_run
    info = inspect_checkpoint(folder)
    assert (info.kind, info.format, info.weights_key) == (
        "Lightning checkpoint",
        "torch.distributed.checkpoint",
        "state_dict",
    )
    assert info.details[0] == "saved by 2 ranks in 2 shard files"
    assert "optimizer_0" in info.other_entries
    assert [(t.name, list(t.shape)) for t in info.tensors] == [
        ("model." + k, list(v.shape)) for k, v in reference.items()
    ]
    assert info.lightning_attribute == "model."
    assert info.size == sum(p.stat().st_size for p in folder.iterdir())

    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "saved by 2 ranks in 2 shard files" in out
    assert f"lightning-mgpu export {folder} {folder.with_name('last.safetensors')}" in out

    assert main(["export", str(folder), str(tmp_path / "cli.safetensors")]) == 0
    assert "removed prefixes: model." in capsys.readouterr().out
    weights = safetensors.torch.load_file(tmp_path / "cli.safetensors")
    assert weights.keys() == reference.keys()


def test_a_missing_shard_is_named_and_nothing_written(fsdp_run: tuple[Path, dict], tmp_path: Path) -> None:
    folder = copy_of(fsdp_run[0], tmp_path)
    (folder / "__1_0.distcp").unlink()
    with pytest.raises(FileNotFoundError, match=r"1 of its 2 shard files is missing: __1_0\.distcp \(holds"):
        export_state_dict(folder, tmp_path / "out.safetensors")
    assert main(["export", str(folder), str(tmp_path / "out.safetensors")]) == 1
    with pytest.raises(FileNotFoundError, match=r"__1_0\.distcp"):
        load_state_dict(plain_model(), folder)
    only_inputs_left(tmp_path, folder.name)


def test_a_truncated_or_damaged_shard(fsdp_run: tuple[Path, dict], tmp_path: Path) -> None:
    folder = copy_of(fsdp_run[0], tmp_path)
    shard = folder / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"__0_0\.distcp is truncated"):
        export_state_dict(folder, tmp_path / "out.safetensors")

    # same length, bytes overwritten: found only when the tensor is read, halfway through the export
    shard.write_bytes(bytes(len(data)))
    with pytest.raises(ValueError, match=r"__0_0\.distcp is corrupt: 'state_dict\.model\."):
        export_state_dict(folder, tmp_path / "out.safetensors")
    only_inputs_left(tmp_path, folder.name)


def test_an_output_inside_the_source_is_refused(
    fsdp_run: tuple[Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    folder = copy_of(fsdp_run[0], tmp_path)
    saved = {p.name: p.read_bytes() for p in folder.iterdir()}
    (tmp_path / "link.safetensors").symlink_to(folder / "__0_0.distcp")  # a shard under another name
    for out in (folder / "__0_0.distcp", folder / "model.safetensors", folder, tmp_path / "link.safetensors"):
        assert main(["export", str(folder), str(out)]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert f"error: {out} " in err
        assert "would replace what is being read" in err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == saved
    assert (tmp_path / "link.safetensors").is_symlink()

    weights = tmp_path / "weights.pt"
    torch.save(plain_model().state_dict(), weights)
    with pytest.raises(ValueError, match=r"weights.pt is the checkpoint .* that it would be exported from"):
        export_state_dict(weights, weights)
    export_state_dict(folder, tmp_path / "beside.safetensors")  # beside the folder is fine


def test_missing_or_corrupt_metadata(fsdp_run: tuple[Path, dict], tmp_path: Path) -> None:
    folder = copy_of(fsdp_run[0], tmp_path)
    index = folder / ".metadata"
    data = index.read_bytes()
    index.unlink()
    with pytest.raises(FileNotFoundError, match=r"\.metadata is missing .* the save did not finish"):
        export_state_dict(folder, tmp_path / "out.safetensors")
    index.write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError, match=r"\.metadata is truncated or corrupt"):
        inspect_checkpoint(folder)
    index.write_bytes(b"not a pickle at all")
    with pytest.raises(ValueError, match=r"\.metadata is truncated or corrupt"):
        export_state_dict(folder, tmp_path / "out.safetensors")
    only_inputs_left(tmp_path, folder.name)


def test_metadata_is_never_unpickled_unrestricted(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=folder)
    marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(pickle.dumps(Touch(marker)))
    with pytest.raises(ValueError, match=r"pathlib\.Path\.touch|refused.*trust_pickle=True"):
        inspect_checkpoint(folder)
    assert not marker.exists()


def test_an_index_pickled_by_python_3_13_is_read(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=folder)
    index = folder / ".metadata"
    # Python 3.13 pickles the paths the index records as pathlib._local's classes
    metadata = pickle.loads(index.read_bytes())  # the test's own file
    as_313 = pickle.dumps(metadata, protocol=2).replace(
        b"cpathlib\nPosixPath\n", b"cpathlib._local\nPosixPath\n"
    )
    assert b"cpathlib._local\nPosixPath\n" in as_313
    index.write_bytes(as_313)
    export_state_dict(folder, tmp_path / "out.safetensors")
    written = safetensors.torch.load_file(tmp_path / "out.safetensors")
    torch.testing.assert_close(written, {"w": torch.arange(4.0)})


def test_a_folder_that_is_no_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(IsADirectoryError, match="no .metadata and no .distcp shard files"):
        export_state_dict(tmp_path / "empty", tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_fabric_layout_and_a_bare_state_dict(tmp_path: Path) -> None:
    """Fabric saves the user's names (``model``, ``optimizer``); ``dcp.save(model.state_dict())`` none."""
    torch.manual_seed(0)
    trained = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    optimizer = torch.optim.Adam(trained.parameters())
    trained(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    dcp.save(
        {"model": trained.state_dict(), "optimizer": optimizer.state_dict()},
        checkpoint_id=tmp_path / "fabric",
    )
    dcp.save(trained.state_dict(), checkpoint_id=tmp_path / "bare")

    for name, key in (("fabric", "model"), ("bare", None)):
        info = inspect_checkpoint(tmp_path / name)
        assert info.weights_key == key
        assert not info.loads_into_plain  # torch.load reads no folder: the report suggests the export
        assert f"lightning-mgpu export {tmp_path / name} {tmp_path / name}.safetensors" in str(info)
        report = export_state_dict(tmp_path / name, tmp_path / f"{name}.safetensors")
        assert report.tensors == 9  # BatchNorm's buffers too, its int64 counter included
        model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
        load_state_dict(model, tmp_path / f"{name}.safetensors", strict=True)
        for k, v in trained.state_dict().items():
            torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=0)


def test_every_dtype_and_chunks_side_by_side(tmp_path: Path) -> None:
    """Chunks split along the last dimension (as tensor parallelism splits a layer) land in place."""
    left, right = torch.arange(8.0).view(4, 2), torch.arange(8.0, 16.0).view(4, 2)
    typed = {
        "bool": torch.tensor([True, False, True]),
        "bf16": torch.randn(3, 5).bfloat16(),
        "int64": torch.arange(6).view(2, 3),
        "uint8": torch.arange(7, dtype=torch.uint8),
        "half": torch.randn(2, 2).half(),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
    }
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"state_dict": {"left": left, "right": right, **typed}}, checkpoint_id=tmp_path / "ckpt")
    index = tmp_path / "ckpt" / ".metadata"
    metadata = pickle.loads(index.read_bytes())  # our own folder: torch's reader does the same
    saved, storage = metadata.state_dict_metadata, metadata.storage_data
    whole = saved.pop("state_dict.right")
    saved["state_dict.left"].size = torch.Size([4, 4])
    saved["state_dict.left"].chunks.append(type(whole.chunks[0])(torch.Size([0, 2]), torch.Size([4, 2])))
    right_record = storage.pop(next(k for k in storage if k.fqn == "state_dict.right"))
    storage[type(next(iter(storage)))("state_dict.left", [0, 2])] = right_record
    metadata.planner_data.pop("state_dict.right")
    index.write_bytes(pickle.dumps(metadata))

    expected = {"left": torch.cat([left, right], dim=1), **typed}
    for suffix in ("safetensors", "pt"):
        export_state_dict(tmp_path / "ckpt", tmp_path / f"out.{suffix}")
        if suffix == "pt":
            out = torch.load(tmp_path / "out.pt", weights_only=True)
        else:
            out = safetensors.torch.load_file(tmp_path / "out.safetensors")
        assert out.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(out[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_export_memory_stays_near_the_largest_tensor(tmp_path: Path) -> None:
    mib = 1 << 20
    weights = {f"layers.{i}.weight": torch.full((4 * mib // 4,), float(i)) for i in range(8)}  # 8 x 4 MiB
    weights["layers.0.weight"] = torch.zeros(8 * mib // 4)  # the largest: 8 MiB of 36
    dcp.save(
        {"state_dict": weights, "optimizer_0": {"state": {k: {"exp_avg": v} for k, v in weights.items()}}},
        checkpoint_id=tmp_path / "big",
    )
    dcp.save({"state_dict": {"w": torch.ones(2)}}, checkpoint_id=tmp_path / "warm")
    del weights
    total = sum(p.stat().st_size for p in (tmp_path / "big").iterdir())
    assert total > 70 * mib  # weights and optimizer state

    out = tmp_path / "out.safetensors"
    result = run_file(
        "export_peak.py", tmp_path, args=[str(tmp_path / "big"), str(tmp_path / "warm"), str(out)]
    )
    assert result.returncode == 0, result.output
    growth = int(result.stdout.split()[-1])
    # reading everything (as dcp_to_torch_save does) would grow by the whole 72 MiB
    assert growth < 20 * mib, f"peak grew by {growth / mib:.1f} MiB for a {total / mib:.0f} MiB folder"
    written = safetensors.torch.load_file(out)
    assert written["layers.3.weight"].eq(3).all()
    assert written["layers.0.weight"].shape == (2 * mib,)
