"""Damaged or malformed files are named with what is wrong; big sources are read without holding them."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch

from lightning_mgpu import export_state_dict, inspect_checkpoint, load_state_dict
from lightning_mgpu.checkpoint._zip_check import Archive, ArchiveCheck
from lightning_mgpu.cli.main import main
from tests.checkpoint._models import net
from tests.helpers import run_script


def _write_safetensors(path: Path, metadata: object) -> None:
    """A one-tensor safetensors file with ``metadata`` as its header's ``__metadata__``, as given."""
    header = {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "__metadata__": metadata}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16))


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"lightning_mgpu.order": "['w'"}, r"__metadata__\['lightning_mgpu.order'\] is not valid JSON"),
        ({"lightning_mgpu.order": "5"}, r"__metadata__\['lightning_mgpu.order'\] should be a JSON list"),
        ({"lightning_mgpu.order": "[1, 2]"}, r"__metadata__\['lightning_mgpu.order'\] should be a JSON list"),
        ({"lr": 5}, r"bad metadata: __metadata__\['lr'\] is 5, not a string"),
        ([1], r"bad metadata: its header's '__metadata__' is a list, not a map"),
    ],
)
def test_malformed_safetensors_metadata_names_the_file_and_the_field(
    tmp_path: Path, metadata: object, message: str, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "bad.safetensors"
    _write_safetensors(path, metadata)
    for call in (
        lambda: export_state_dict(path, tmp_path / "out.safetensors"),
        lambda: load_state_dict(torch.nn.Linear(4, 1, bias=False), path),
        lambda: inspect_checkpoint(path),
    ):
        with pytest.raises(ValueError, match=message) as err:
            call()
        assert str(path) in str(err.value)
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"lightning-mgpu inspect: error: {path} ")
    assert len(err.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.safetensors"]


def test_a_safetensors_source_is_mapped_not_read(tmp_path: Path) -> None:
    """Exporting reads a safetensors source as it reads a torch file: mapped, copied by the kernel."""
    model = net(seed=3)
    export_state_dict(model, tmp_path / "w.safetensors")
    target = net(seed=4)
    assert load_state_dict(target, tmp_path / "w.safetensors").ok
    torch.testing.assert_close(target.state_dict(), model.state_dict(), rtol=0, atol=0)

    size_mib = 96
    weights = {f"layer{i}.weight": torch.full((1024, 1024), float(i)) for i in range(size_mib // 4)}
    torch.save(weights, tmp_path / "big.pt")
    export_state_dict(tmp_path / "big.pt", tmp_path / "big.safetensors")
    del weights
    # peak RSS of the export call alone, in a fresh process: it must not hold the source's pages
    result = run_script(
        f"""
        import resource
        from lightning_mgpu import export_state_dict

        def peak_mib():
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

        for source in ("big.safetensors", "big.pt"):
            before = peak_mib()
            export_state_dict(source, "out.safetensors")
            print(source, (peak_mib() - before) / {size_mib})
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.output
    ratios = dict(line.split() for line in result.stdout.splitlines())
    assert float(ratios["big.safetensors"]) <= 0.3, ratios
    assert float(ratios["big.pt"]) <= 0.3, ratios
    written = safetensors.torch.load_file(tmp_path / "out.safetensors")
    assert sorted(written) == sorted(f"layer{i}.weight" for i in range(size_mib // 4))
    assert all(bool((written[f"layer{i}.weight"] == i).all()) for i in range(size_mib // 4))


def test_a_flipped_bit_in_a_tensor_of_a_torch_file_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    model = net(seed=1)
    state = model.state_dict()
    state["3.weight"] = torch.full((2, 6), 0.125)  # bytes easy to find in the file
    path = tmp_path / "fit.ckpt"
    torch.save(
        {"pytorch-lightning_version": "2.6.0", "state_dict": {f"model.{k}": v for k, v in state.items()}},
        path,
    )
    raw = bytearray(path.read_bytes())
    at = raw.index(torch.full((2, 6), 0.125).numpy().tobytes())
    raw[at + 5] ^= 0x10
    path.write_bytes(bytes(raw))

    message = (
        r"fit.ckpt is corrupt: the stored bytes of tensor model.3.weight \(record .*/data/\d+\) do not match"
    )
    for out in ("w.safetensors", "w.pt"):
        with pytest.raises(ValueError, match=message):
            export_state_dict(path, tmp_path / out)
    target = net(seed=2)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        load_state_dict(target, path)
    torch.testing.assert_close(target.state_dict(), before, rtol=0, atol=0)  # nothing loaded
    assert main(["export", str(path), str(tmp_path / "w.safetensors")]) == 1
    assert "model.3.weight" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fit.ckpt"]


def test_a_whole_file_that_is_no_archive_is_named_without_a_byte_span(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a zip archive " * 8)
    with pytest.raises(ValueError, match="is corrupt: data is no readable torch archive") as info:
        ArchiveCheck([Archive(bad)]).verify()
    assert str(bad) in str(info.value)
    assert "copy the file again from where it was written" in str(info.value)
    assert "bytes" not in str(info.value)  # the whole file, not a span of it
