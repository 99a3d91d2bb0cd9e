"""Wrapper prefixes are removed where a wrapper sits, and nowhere else."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from lightning_mgpu import export_state_dict, inspect_checkpoint, load_state_dict
from lightning_mgpu.checkpoint._prefixes import add_prefix, find_wrappers, select, strip_wrappers
from tests.checkpoint._models import LitNet, LitTwo, Residual, ResNet, assert_same


def test_nested_wrappers_in_any_order_and_depth() -> None:
    sd = {
        "module._orig_mod.encoder._forward_module.0.weight": 1,
        "module._orig_mod.encoder._forward_module.0.bias": 2,
        "module._orig_mod.head.weight": 3,
    }
    plain, removed = strip_wrappers(sd)
    # beside ``head``, ``encoder``'s ``_forward_module`` is not the whole state: kept as the model's own
    assert list(plain) == [
        "encoder._forward_module.0.weight",
        "encoder._forward_module.0.bias",
        "head.weight",
    ]
    assert removed == ["module.", "module._orig_mod."]
    plain, removed = strip_wrappers({k: v for k, v in sd.items() if "head" not in k})
    assert list(plain) == ["encoder.0.weight", "encoder.0.bias"]
    assert removed == ["module.", "module._orig_mod.", "module._orig_mod.encoder._forward_module."]


def test_an_attribute_named_module_next_to_siblings_is_kept() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)
            self.norm = nn.LayerNorm(2)

    plain, removed = strip_wrappers(nn.DataParallel(Block()).state_dict())
    assert removed == ["module."]
    assert list(plain) == ["module.weight", "module.bias", "norm.weight", "norm.bias"]


def test_a_leaf_named_like_a_wrapper_is_kept() -> None:
    plain, removed = strip_wrappers({"module": torch.zeros(1)})
    assert (list(plain), removed) == (["module"], [])


def test_select_and_add_prefix() -> None:
    sd = {"model.encoder.w": 1, "model.head.w": 2, "loss.w": 3}
    assert select(sd, "model.encoder") == {"w": 1}
    assert select(sd, "") == sd
    with pytest.raises(KeyError, match="no submodule 'decoder': the weights hold model, loss"):
        select(sd, "decoder")
    assert list(add_prefix({"w": 1}, "module")) == ["module.w"]


def test_a_file_loses_module_only_where_a_wrapper_can_sit() -> None:
    kept = ["blocks.0.module.weight", "0.module.weight", "model.blocks.0._forward_module.weight"]
    for key in kept:
        assert strip_wrappers({key: 1, "head.weight": 2}) == ({key: 1, "head.weight": 2}, [])
        assert strip_wrappers({key: 1}) == ({key: 1}, [])
    removed = {
        "module.0.weight": ("0.weight", ["module."]),
        "model.module.0.weight": ("model.0.weight", ["model.module."]),
        "blocks.0._orig_mod.weight": ("blocks.0.weight", ["blocks.0._orig_mod."]),
        "blocks.0._orig_mod.module.weight": (
            "blocks.0.weight",
            ["blocks.0._orig_mod.", "blocks.0._orig_mod.module."],
        ),
        "module.model._forward_module.w": ("model.w", ["module.", "module.model._forward_module."]),
    }
    for key, (plain, prefixes) in removed.items():
        assert strip_wrappers({key: 1}) == ({plain: 1}, prefixes), key


def test_a_module_loses_exactly_its_wrappers(tmp_path: Path) -> None:
    model = ResNet(seed=1)
    assert find_wrappers(model) == []
    wrapped = nn.DataParallel(torch.compile(model))
    assert find_wrappers(wrapped) == ["module.", "module._orig_mod."]
    for source, removed in ((model, []), (wrapped, ["module.", "module._orig_mod."])):
        report = export_state_dict(source, tmp_path / "res.safetensors")
        assert report.removed_prefixes == removed
        fresh = ResNet(seed=2)
        fresh.load_state_dict(safetensors.torch.load_file(tmp_path / "res.safetensors"), strict=True)
        assert_same(model.state_dict(), fresh.state_dict())

    target = nn.DataParallel(ResNet(seed=2))
    report = load_state_dict(target, model)
    assert (report.removed_prefixes, report.added_prefixes) == ([], ["module."])
    assert_same(model.state_dict(), target.module.state_dict())


def test_a_wrapper_with_tensors_of_its_own_still_loses_its_prefix(tmp_path: Path) -> None:
    class CountingDataParallel(nn.DataParallel):
        def __init__(self, module: nn.Module) -> None:
            super().__init__(module)
            self.register_buffer("calls", torch.zeros(()))

    model = ResNet(seed=1)
    report = export_state_dict(CountingDataParallel(model), tmp_path / "w.safetensors")
    assert report.removed_prefixes == ["module."]
    saved = safetensors.torch.load_file(tmp_path / "w.safetensors")
    assert set(saved) == set(model.state_dict()) | {"calls"}
    target = CountingDataParallel(ResNet(seed=2))
    report = load_state_dict(target, model, strict=False)  # the plain model has no "calls"
    assert (report.added_prefixes, report.missing) == (["module."], ["calls"])
    assert_same(model.state_dict(), target.module.state_dict())


def test_lightning_wrapper_classes_are_wrappers() -> None:
    from lightning.pytorch.plugins.precision.double import LightningDoublePrecisionModule

    with pytest.warns(match="deprecated"):
        wrapped = LightningDoublePrecisionModule(LitNet(ResNet(seed=1)))
    assert find_wrappers(wrapped) == ["module."]
    report = load_state_dict(ResNet(seed=2), wrapped)
    assert report.removed_prefixes == ["module.", "model."]


class _Net(nn.Module):
    """A plain model whose encoder is a user's block keeping its layer in ``self.module``."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.encoder = Residual(nn.Linear(4, 4))
        self.head = nn.Linear(4, 2)


def test_module_under_one_child_among_several_is_the_models_own(tmp_path: Path) -> None:
    model = _Net(seed=1)
    torch.save(model.state_dict(), tmp_path / "net.pt")
    report = export_state_dict(tmp_path / "net.pt", tmp_path / "net.safetensors")
    assert report.removed_prefixes == []
    fresh = _Net(seed=2)
    fresh.load_state_dict(safetensors.torch.load_file(tmp_path / "net.safetensors"), strict=True)
    assert_same(model.state_dict(), fresh.state_dict())
    info = inspect_checkpoint(tmp_path / "net.pt")
    assert info.wrappers == []
    assert "saved through: no wrapper" in str(info)
    assert info.loads_into_plain

    # the whole state under one name, or a LightningModule's attribute, does carry a wrapper
    sd = {"encoder.module.weight": 1, "head.weight": 2}
    assert strip_wrappers(sd) == (sd, [])
    assert strip_wrappers({"encoder.module.weight": 1}) == ({"encoder.weight": 1}, ["encoder.module."])
    stripped = strip_wrappers({"model.module.0.weight": 1, "loss_fn.weight": 2}, lightning=True)
    assert stripped == ({"model.0.weight": 1, "loss_fn.weight": 2}, ["model.module."])


def test_a_lightning_attribute_wrapped_in_dataparallel_beside_a_loss(tmp_path: Path) -> None:
    module = LitTwo()
    module.model = nn.DataParallel(module.model)
    torch.save({"pytorch-lightning_version": "2.6.0", "state_dict": module.state_dict()}, tmp_path / "a.ckpt")
    report = export_state_dict(tmp_path / "a.ckpt", tmp_path / "m.safetensors", submodule="model")
    assert report.removed_prefixes == ["model.module.", "model."]
    assert_same(module.model.module.state_dict(), safetensors.torch.load_file(tmp_path / "m.safetensors"))
