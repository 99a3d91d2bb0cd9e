"""Every source kind into every target kind, with strict=True and equal tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import safetensors.torch
import torch
from torch import nn

from lightning_mgpu import export_state_dict, inspect_checkpoint, load_state_dict
from tests.checkpoint._models import (
    WRAPS,
    LitNet,
    assert_same,
    init_single_process_group,
    lightning_checkpoint,
    net,
    plain_of,
    wrap,
)

SOURCES = [*WRAPS, "lightning_ckpt", "state_dict_of_dataparallel", "training_checkpoint_dict"]
TARGETS = list(WRAPS)


@pytest.fixture(scope="module")
def ckpt_path(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("lightning") / "fit.ckpt"
    module = lightning_checkpoint(path)
    return path, {k: v.clone() for k, v in module.model.state_dict().items()}


def make_source(kind: str, ckpt: tuple[Path, dict[str, torch.Tensor]]) -> tuple[Any, dict[str, torch.Tensor]]:
    """A source of the given kind and the plain weights it holds."""
    if kind == "lightning_ckpt":
        return ckpt
    model = net(seed=1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    if kind == "state_dict_of_dataparallel":
        return nn.DataParallel(model).state_dict(), expected
    if kind == "training_checkpoint_dict":
        return {"epoch": 3, "model_state_dict": model.state_dict(), "optimizer_state_dict": {}}, expected
    return wrap(kind, model, role="source"), expected


@pytest.fixture
def process_group(tmp_path: Path) -> None:
    init_single_process_group(tmp_path)


@pytest.mark.parametrize("target_kind", TARGETS)
@pytest.mark.parametrize("source_kind", SOURCES)
def test_load_any_source_into_any_target(
    source_kind: str, target_kind: str, ckpt_path: Any, process_group: None
) -> None:
    source, expected = make_source(source_kind, ckpt_path)
    target = wrap(target_kind, net(seed=2))
    report = load_state_dict(target, source, strict=True)
    assert report.ok
    assert report.loaded == len(expected)
    assert_same(expected, plain_of(target))


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
@pytest.mark.parametrize("source_kind", SOURCES)
def test_exported_file_loads_into_plain_and_wrapped_models(
    source_kind: str, fmt: str, ckpt_path: Any, process_group: None, tmp_path: Path
) -> None:
    source, expected = make_source(source_kind, ckpt_path)
    out = tmp_path / f"plain.{fmt}"
    export_state_dict(source, out)

    # torch's own loader takes the plain file into a plain model as is
    plain = net(seed=2)
    raw = safetensors.torch.load_file(out) if fmt == "safetensors" else torch.load(out, weights_only=True)
    plain.load_state_dict(raw, strict=True)
    assert_same(expected, plain.state_dict())

    for target_kind in TARGETS:
        target = wrap(target_kind, net(seed=2))
        assert load_state_dict(target, out).ok
        assert_same(expected, plain_of(target))


@pytest.mark.parametrize("source_kind", ["plain", "compiled_dataparallel", "lightning_ckpt"])
def test_dataparallel_form_loads_into_dataparallel_with_torch(
    source_kind: str, ckpt_path: Any, tmp_path: Path
) -> None:
    source, expected = make_source(source_kind, ckpt_path)
    report = export_state_dict(source, tmp_path / "dp.pt", prefix="module.")
    assert report.added_prefix == "module."
    target = nn.DataParallel(net(seed=2))
    target.load_state_dict(torch.load(tmp_path / "dp.pt", weights_only=True), strict=True)
    assert_same(expected, target.module.state_dict())


def test_lightning_module_target_from_plain_file(tmp_path: Path) -> None:
    source = net(seed=1)
    export_state_dict(source, tmp_path / "w.safetensors")
    target = LitNet(net(seed=2))
    report = load_state_dict(target, tmp_path / "w.safetensors")
    assert report.added_prefixes == ["model."]
    assert_same(source.state_dict(), target.model.state_dict())


def test_removed_prefixes_are_reported(ckpt_path: Any) -> None:
    nested = wrap("compiled_dataparallel", net(), role="source")
    report = load_state_dict(net(seed=2), nested)
    assert report.removed_prefixes == ["_orig_mod.", "_orig_mod.module."]
    report = load_state_dict(net(seed=2), ckpt_path[0])
    assert report.removed_prefixes == ["model."]
    assert report.added_prefixes == []


class NoWeights(L.LightningModule):
    """A LightningModule without parameters or buffers."""


def test_a_model_without_weights_round_trips_as_an_empty_state_dict(tmp_path: Path) -> None:
    # torch saves {} and nn.Module.load_state_dict takes it; so do export, inspect and load
    lightning_ckpt = {"pytorch-lightning_version": "2.6.0", "epoch": 0, "state_dict": {}}
    for source in (nn.ReLU(), NoWeights(), {}, lightning_ckpt):
        for fmt in ("safetensors", "pt"):
            out = tmp_path / f"empty.{fmt}"
            assert export_state_dict(source, out).tensors == 0
            raw = (
                safetensors.torch.load_file(out)
                if fmt == "safetensors"
                else torch.load(out, weights_only=True)
            )
            assert raw == {}
            info = inspect_checkpoint(out)
            assert (info.loads_into_plain, info.loads_into_dataparallel) == (True, True)
            assert "weights: 0 tensors, 0 values\n" in str(info)
            assert load_state_dict(NoWeights(), out).loaded == 0
        assert load_state_dict(nn.ReLU(), source).ok
    with pytest.raises(ValueError, match=r"missing from the source \(2\): weight, bias"):
        load_state_dict(nn.Linear(2, 2), tmp_path / "empty.pt")
