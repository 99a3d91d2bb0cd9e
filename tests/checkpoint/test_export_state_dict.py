"""export_state_dict: prefixes, submodules, formats, tied weights, order, dtype."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from torch import nn

from lightning_mgpu import export_state_dict, load_state_dict
from lightning_mgpu._atomic import start_writeback
from lightning_mgpu.checkpoint import ExportReport
from tests.checkpoint._models import LitNet, LitTwo, assert_same, net


class Tied(nn.Module):
    """A language-model-style head that shares its weight with the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_tied_weights_stored_once_and_restored_under_every_name(tmp_path: Path) -> None:
    model = Tied()
    report = export_state_dict(nn.DataParallel(model), tmp_path / "tied.safetensors")
    assert report.aliases == {"head.weight": "embed.weight"}
    with safe_open(tmp_path / "tied.safetensors", framework="pt") as f:
        assert sorted(f.keys()) == ["body.bias", "body.weight", "embed.weight"]

    fresh = Tied()
    assert load_state_dict(fresh, tmp_path / "tied.safetensors", strict=True).ok
    assert_same(model.state_dict(), fresh.state_dict())
    assert fresh.head.weight is fresh.embed.weight

    # the same convention as safetensors' own save_model, so its load_model takes the file too
    other = Tied()
    missing, unexpected = safetensors.torch.load_model(other, tmp_path / "tied.safetensors", strict=True)
    assert not missing
    assert not unexpected
    assert_same(model.state_dict(), other.state_dict())


def test_tied_weights_stay_tied_when_cast(tmp_path: Path) -> None:
    model = Tied()
    report = export_state_dict(model, tmp_path / "half.safetensors", dtype="float16")
    assert report.aliases == {"head.weight": "embed.weight"}
    fresh = Tied().half()
    assert load_state_dict(fresh, tmp_path / "half.safetensors", strict=True).ok
    assert_same({k: v.half() for k, v in model.state_dict().items()}, fresh.state_dict())


def test_metadata_of_other_tools_is_not_taken_for_tied_weights(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    notes = {"format": "pt", "description": "bias", "source_layer": "weight"}
    safetensors.torch.save_file(model.state_dict(), tmp_path / "notes.safetensors", metadata=notes)
    fresh = nn.Linear(2, 2)
    assert load_state_dict(fresh, tmp_path / "notes.safetensors", strict=True).ok
    assert_same(model.state_dict(), fresh.state_dict())
    # tied weights saved by safetensors' own save_model still come back under every name
    tied = Tied()
    safetensors.torch.save_model(tied, tmp_path / "tied.safetensors")
    other = Tied()
    assert load_state_dict(other, tmp_path / "tied.safetensors", strict=True).ok
    assert other.head.weight is other.embed.weight
    assert_same(tied.state_dict(), other.state_dict())


def test_tied_weights_in_pt_keep_sharing(tmp_path: Path) -> None:
    export_state_dict(Tied(), tmp_path / "tied.pt")
    sd = torch.load(tmp_path / "tied.pt", weights_only=True)
    assert sd["head.weight"].data_ptr() == sd["embed.weight"].data_ptr()


def test_overlapping_views_are_written_apart(tmp_path: Path) -> None:
    base = torch.arange(12.0)
    sd = {"whole": base, "half": base[:6], "view": base.view(3, 4)}
    report = export_state_dict(sd, tmp_path / "views.safetensors")
    assert report.aliases == {}
    loaded = safetensors.torch.load_file(tmp_path / "views.safetensors")
    assert_same(
        {k: sd[k] for k in ("whole", "half", "view")}, {k: loaded[k] for k in ("whole", "half", "view")}
    )


def test_order_is_kept_in_safetensors(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    export_state_dict(model, tmp_path / "m.safetensors")
    with safe_open(tmp_path / "m.safetensors", framework="pt") as f:
        assert json.loads(f.metadata()["lightning_mgpu.order"]) == list(model.state_dict())


def test_lightning_module_loses_its_attribute_prefix(tmp_path: Path) -> None:
    module = LitNet(torch.compile(net()))
    report = export_state_dict(module, tmp_path / "w.safetensors")
    assert report.removed_prefixes == ["model._orig_mod.", "model."]
    assert list(safetensors.torch.load_file(tmp_path / "w.safetensors")) != []
    fresh = net(seed=5)
    fresh.load_state_dict(safetensors.torch.load_file(tmp_path / "w.safetensors"))
    assert_same(module.model._orig_mod.state_dict(), fresh.state_dict())
    # the layers inside the one attribute (0, 1, 3) are no attributes kept for the user to pick from
    assert report.kept_attributes == {}
    assert "kept every entry" not in str(report)


class LitLayers(LitNet):
    """The common layout: the layers are the LightningModule's own attributes, no single ``self.model``."""

    def __init__(self) -> None:
        super().__init__()
        del self.model
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 2)


def test_a_module_with_several_submodules_keeps_every_entry_and_says_how_to_pick(tmp_path: Path) -> None:
    module = LitLayers()
    torch.save({"pytorch-lightning_version": "2.6.0", "state_dict": module.state_dict()}, tmp_path / "l.ckpt")
    for source in (module, tmp_path / "l.ckpt"):
        report = export_state_dict(source, tmp_path / "w.safetensors")
        assert report.removed_prefixes == []
        assert report.kept_attributes == {"embed": 1, "blocks": 4, "head": 2}
        text = str(report)
        assert (
            "kept every entry, named as the LightningModule names them: embed (1 tensor), blocks (4" in text
        )
        assert "pass submodule='embed' (command line: --submodule embed)" in text
        fresh = LitLayers()
        fresh.load_state_dict(safetensors.torch.load_file(tmp_path / "w.safetensors"), strict=True)
        assert_same(module.state_dict(), fresh.state_dict())

    two = LitTwo()  # a model and a loss with state: both kept, as named
    assert export_state_dict(two, tmp_path / "two.safetensors").kept_attributes == {"model": 9, "loss_fn": 1}
    assert set(safetensors.torch.load_file(tmp_path / "two.safetensors")) == set(two.state_dict())
    report = export_state_dict(two, tmp_path / "w.safetensors", submodule="model")
    assert report.kept_attributes == {}
    assert_same(two.model.state_dict(), safetensors.torch.load_file(tmp_path / "w.safetensors"))


def test_unknown_submodule_lists_what_exists(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="no submodule 'encoder'.*model, loss_fn"):
        export_state_dict(LitTwo(), tmp_path / "w.safetensors", submodule="encoder")


def test_nested_submodule_of_a_plain_model(tmp_path: Path) -> None:
    model = nn.ModuleDict({"encoder": net(), "decoder": nn.Linear(2, 4)})
    export_state_dict(nn.DataParallel(model), tmp_path / "enc.pt", submodule="encoder")
    assert_same(model["encoder"].state_dict(), torch.load(tmp_path / "enc.pt", weights_only=True))


def test_format_follows_suffix_unless_given(tmp_path: Path) -> None:
    assert export_state_dict(net(), tmp_path / "a.pth").format == "pt"
    assert export_state_dict(net(), tmp_path / "a.bin", format="safetensors").format == "safetensors"
    assert export_state_dict(net(), tmp_path / "weights").format == "safetensors"
    assert safetensors.torch.load_file(tmp_path / "a.bin")
    with pytest.raises(ValueError, match="format must be"):
        export_state_dict(net(), tmp_path / "a.x", format="onnx")
    with pytest.raises(ValueError, match=r"a\.safetensors would hold torch\.save data"):
        export_state_dict(net(), tmp_path / "a.safetensors", format="pt")
    assert not (tmp_path / "a.safetensors").exists()


def test_dtype_casts_floating_point_only(tmp_path: Path) -> None:
    export_state_dict(net(), tmp_path / "half.safetensors", dtype="bfloat16")
    loaded = safetensors.torch.load_file(tmp_path / "half.safetensors")
    assert loaded["0.weight"].dtype == torch.bfloat16
    assert loaded["1.num_batches_tracked"].dtype == torch.int64


def test_report_says_what_was_written(tmp_path: Path) -> None:
    report = export_state_dict(nn.DataParallel(net()), tmp_path / "w.safetensors", prefix="module")
    assert isinstance(report, ExportReport)
    assert report.bytes == (tmp_path / "w.safetensors").stat().st_size
    assert report.tensors == len(net().state_dict()) == 9
    assert report.values == sum(v.numel() for v in net().state_dict().values())
    text = str(report)
    assert "removed prefixes: module. (nn.DataParallel / DistributedDataParallel)" in text
    assert "added prefix: module." in text
    assert list(safetensors.torch.load_file(tmp_path / "w.safetensors"))[0].startswith("module.")


def test_overwrites_atomically_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    out = tmp_path / "w.safetensors"
    out.write_bytes(b"old")
    out.chmod(0o640)
    export_state_dict(net(), out)
    assert out.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]
    assert safetensors.torch.load_file(out)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_files_larger_than_the_writeback_step_keep_every_byte(tmp_path: Path, suffix: str) -> None:
    # 80 MiB: both writers hand finished parts to the disk every 16 MiB while they go;
    # what loads back must be what was exported
    generator = torch.Generator().manual_seed(0)
    state_dict = {f"module.w{i}": torch.randn(5 << 20, generator=generator) for i in range(4)}
    export_state_dict(state_dict, tmp_path / f"w{suffix}")
    if suffix == ".safetensors":
        loaded = safetensors.torch.load_file(tmp_path / f"w{suffix}")
    else:
        loaded = torch.load(tmp_path / f"w{suffix}", weights_only=True)
    assert list(loaded) == [k.removeprefix("module.") for k in state_dict]
    for key, tensor in state_dict.items():
        assert torch.equal(loaded[key.removeprefix("module.")], tensor)


def test_writeback_hint_is_harmless_where_unsupported() -> None:
    read, write = os.pipe()  # sync_file_range refuses pipes; the hint must not fail the write
    with os.fdopen(write, "wb") as file:
        file.write(b"data")
        start_writeback(file)
    with os.fdopen(read, "rb") as file:
        assert file.read() == b"data"


def test_a_value_safetensors_cannot_store_is_refused_and_pt_takes_it(tmp_path: Path) -> None:
    state = {"w": torch.ones(2), "norm._extra_state": {"scale": 1}}
    with pytest.raises(
        ValueError, match=r"only tensors, but 'norm._extra_state' holds a dict; export with format='pt'"
    ):
        export_state_dict(state, tmp_path / "w.safetensors")
    assert not (tmp_path / "w.safetensors").exists()
    export_state_dict(state, tmp_path / "w.pt")
    assert torch.load(tmp_path / "w.pt", weights_only=True)["norm._extra_state"] == {"scale": 1}
