"""inspect_checkpoint: kind, entries by prefix, wrappers, and what the file loads into as is."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn

from lightning_mgpu import export_state_dict, inspect_checkpoint
from tests.checkpoint._models import Residual, lightning_checkpoint, net


def test_lightning_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "fit.ckpt"
    lightning_checkpoint(path, cfg=OmegaConf.create({"lr": 0.1}))
    info = inspect_checkpoint(path)
    assert info.kind == "Lightning checkpoint"
    assert info.format == "torch zip"
    assert info.weights_key == "state_dict"
    assert info.lightning_attribute == "model."
    assert (info.loads_into_plain, info.loads_into_dataparallel) == (False, False)
    assert info.values == sum(v.numel() for v in net().state_dict().values())
    assert "hyper_parameters (DictConfig)" in info.other_entries
    text = str(info)
    assert f"{path}: Lightning checkpoint (torch zip, " in text
    assert "epoch 1, global step 2" in text
    assert "hparams_type (DictConfig)" in text
    assert "saved through: model. (LightningModule attribute)" in text
    suggestion = f"no  -> lightning-mgpu export {path} {tmp_path / 'fit.safetensors'}"
    assert f"loads into a plain model:          {suggestion}" in text
    assert "model.0. (2 tensors, 30 values)" in text
    assert "  model.1.num_batches_tracked  []               int64" in text


def test_wrapped_state_dict_and_its_dataparallel_form(tmp_path: Path) -> None:
    torch.save(nn.DataParallel(net()).state_dict(), tmp_path / "dp.pth")
    info = inspect_checkpoint(tmp_path / "dp.pth")
    assert info.wrappers == ["module."]
    assert (info.loads_into_plain, info.loads_into_dataparallel) == (False, True)
    assert "saved through: module. (nn.DataParallel / DistributedDataParallel)" in str(info)
    assert "module.0. (2 tensors, 30 values)" in str(info)

    compiled = torch.compile(nn.DataParallel(net()))
    info = inspect_checkpoint(compiled)
    assert info.wrappers == ["_orig_mod.", "_orig_mod.module."]
    assert (info.loads_into_plain, info.loads_into_dataparallel) == (False, False)


def test_exported_file_remembers_what_was_removed(tmp_path: Path) -> None:
    export_state_dict(nn.DataParallel(net()), tmp_path / "w.safetensors")
    info = inspect_checkpoint(tmp_path / "w.safetensors")
    assert (info.kind, info.format) == ("state_dict", "safetensors")
    assert (info.loads_into_plain, info.loads_into_dataparallel) == (True, False)
    assert info.exported_from == ["module."]
    assert info.dtypes == {"float32": 8, "int64": 1}


def test_long_groups_are_cut_unless_asked(tmp_path: Path) -> None:
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(30)])
    info = inspect_checkpoint(
        {f"body.{k}": v for k, v in model.state_dict().items()} | {"head.w": torch.ones(1)}
    )
    assert list(info.groups()) == ["body.", "(top level)"] or list(info.groups()) == ["body.", "head."]
    assert "... and 40 more (--all lists every entry)" in info.render(max_per_group=20)
    assert "body.29.bias" in info.render(max_per_group=None)


def test_a_users_module_attribute_is_not_a_wrapper(tmp_path: Path) -> None:
    torch.save(
        nn.Sequential(Residual(nn.Linear(4, 4)), Residual(nn.Linear(4, 4))).state_dict(), tmp_path / "r.pt"
    )
    info = inspect_checkpoint(tmp_path / "r.pt")
    assert info.wrappers == []
    assert info.loads_into_plain
    assert "saved through: no wrapper" in str(info)
    assert "loads into a plain model:          yes" in str(info)


def test_the_suggested_export_never_overwrites_the_input(tmp_path: Path) -> None:
    export_state_dict(net(), tmp_path / "w.safetensors", prefix="module.")
    text = str(inspect_checkpoint(tmp_path / "w.safetensors"))
    folder = tmp_path
    assert f"no  -> lightning-mgpu export {folder / 'w.safetensors'} {folder / 'w_plain.safetensors'}" in text
