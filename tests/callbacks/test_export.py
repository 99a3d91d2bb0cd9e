"""PlainStateDictExport writes plain weights next to every checkpoint, on one device, mgpu_dp and mgpu_ddp."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_mgpu import PlainStateDictExport, load_state_dict
from lightning_mgpu.strategies.resume.attempt_record import RECORD_NAME
from tests.checkpoint._models import LitNet, LitTwo, ResNet, assert_same, loader, net, trainer
from tests.helpers import run_script


def check_exports(folder: Path) -> dict[str, list[str]]:
    """Every checkpoint has a sibling holding its plain weights, and no export is orphaned."""
    checkpoints = sorted(p.stem for p in folder.glob("*.ckpt"))
    exports = sorted(p.stem for p in folder.glob("*.safetensors"))
    assert exports == sorted([*checkpoints, "final"]), (checkpoints, exports)
    # beside the checkpoints mgpu_ddp keeps the run's attempt record (strategies/resume/attempt_record.py)
    assert not [p for p in folder.glob(".*") if p.name != RECORD_NAME], "temporary files left behind"
    for stem in checkpoints:
        plain = safetensors.torch.load_file(folder / f"{stem}.safetensors")
        expected = net(seed=9)
        load_state_dict(expected, folder / f"{stem}.ckpt")
        assert_same(expected.state_dict(), plain)
        model = net(seed=8)
        model.load_state_dict(plain, strict=True)  # torch's own loader takes it as is
    return {"checkpoints": checkpoints, "exports": exports}


def callbacks(folder: Path) -> list:
    every_epoch = ModelCheckpoint(dirpath=folder, monitor="val_loss", save_top_k=2, save_last=True)
    return [every_epoch, PlainStateDictExport()]


@pytest.mark.parametrize(
    ("strategy", "devices"),
    [("auto", 1), ("mgpu_dp", 2)],
)
def test_in_process_strategies(tmp_path: Path, strategy: str, devices: int) -> None:
    module = LitNet(net(seed=1))
    fit = trainer(
        tmp_path,
        strategy=strategy,
        devices=devices,
        max_steps=-1,
        max_epochs=4,
        enable_checkpointing=True,
        callbacks=callbacks(tmp_path / "ckpt"),
    )
    fit.fit(module, loader(), loader())
    found = check_exports(tmp_path / "ckpt")
    assert len(found["checkpoints"]) == 3  # top 2 + last: the others and their exports were removed
    assert_same(
        module.model.state_dict(), safetensors.torch.load_file(tmp_path / "ckpt" / "final.safetensors")
    )
    assert type(fit.strategy.checkpoint_io).__name__ == "TorchCheckpointIO"  # put back at teardown


def test_mgpu_ddp_two_processes(tmp_path: Path) -> None:
    result = run_script(
        f"""
        import json
        from pathlib import Path
        import lightning_mgpu
        from lightning.pytorch.callbacks import ModelCheckpoint
        from lightning_mgpu import PlainStateDictExport
        from tests.checkpoint._models import LitNet, loader, net, trainer

        folder = Path({str(tmp_path)!r}) / "ckpt"
        module = LitNet(net(seed=1))
        fit = trainer(
            folder.parent, strategy="mgpu_ddp", devices=2, max_steps=-1, max_epochs=2,
            enable_checkpointing=True,
            callbacks=[
                ModelCheckpoint(dirpath=folder, monitor="val_loss", save_top_k=1, save_last=True),
                PlainStateDictExport(final_name="end"),
            ],
        )
        fit.fit(module, loader(32), loader(32))
        print(json.dumps({{"rank": fit.global_rank, "world": fit.world_size}}))
        """,
        tmp_path,
        timeout=180,
    )
    assert result.returncode == 0, result.output
    ranks = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    assert ranks[0]["world"] == 2
    folder = tmp_path / "ckpt"
    (folder / "end.safetensors").rename(folder / "final.safetensors")
    found = check_exports(folder)
    assert len(found["checkpoints"]) == 2  # best + last
    last = net(seed=9)
    load_state_dict(last, folder / "last.ckpt")
    assert_same(last.state_dict(), safetensors.torch.load_file(folder / "final.safetensors"))


class LitLate(LitNet):
    """Builds its layers in ``configure_model``, after callbacks' ``setup``; ``two`` adds a weighted loss."""

    def __init__(self, two: bool = False) -> None:
        super().__init__()
        self.model = None  # type: ignore[assignment]
        self.two = two

    def configure_model(self) -> None:
        if self.model is None:
            self.model = ResNet(seed=1)
            if self.two:
                self.loss_fn = torch.nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("module", [LitTwo, lambda: LitLate(two=True)], ids=["built", "configure_model"])
def test_a_missing_submodule_fails_at_fit_start_before_training(tmp_path: Path, module: Any) -> None:
    folder = tmp_path / "ckpt"
    every = ModelCheckpoint(dirpath=folder, monitor="val_loss", save_top_k=2, save_last=True)
    fit = trainer(
        tmp_path, enable_checkpointing=True, callbacks=[every, PlainStateDictExport(submodule="net")]
    )
    with pytest.raises(KeyError, match="no submodule 'net': the weights hold model, loss_fn"):
        fit.fit(module(), loader())
    assert fit.global_step == 0
    assert not folder.exists()


def test_several_submodules_are_all_exported_by_default(tmp_path: Path) -> None:
    module = LitTwo()
    fit = trainer(tmp_path, callbacks=[PlainStateDictExport()])
    fit.fit(module, loader())
    written = safetensors.torch.load_file(tmp_path / "final.safetensors")
    assert_same(module.state_dict(), written)  # model.* and loss_fn.weight, as the module names them


def test_layers_built_in_configure_model_with_a_users_module_attribute(tmp_path: Path) -> None:
    module = LitLate()
    last = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    fit = trainer(tmp_path, enable_checkpointing=True, callbacks=[last, PlainStateDictExport()])
    fit.fit(module, loader())
    for name in ("last", "final"):
        fresh = ResNet(seed=2)
        fresh.load_state_dict(safetensors.torch.load_file(tmp_path / f"{name}.safetensors"), strict=True)
        assert_same(module.model.state_dict(), fresh.state_dict())


def test_submodule_prefix_and_format_options(tmp_path: Path) -> None:
    module = LitTwo()
    export = PlainStateDictExport(submodule="model", prefix="module.", format="pt", final_name=None)
    last = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    fit = trainer(tmp_path, enable_checkpointing=True, callbacks=[last, export])
    fit.fit(module, loader())
    saved = torch.load(tmp_path / "last.pt", weights_only=True)
    assert_same({f"module.{k}": v for k, v in module.model.state_dict().items()}, saved)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.pt"]
    with pytest.raises(ValueError, match="'safetensors' or 'pt'"):
        PlainStateDictExport(format="onnx")


class _PtCheckpoint(ModelCheckpoint):
    FILE_EXTENSION = ".pt"


def test_checkpoints_with_the_export_suffix_are_kept(tmp_path: Path) -> None:
    export = PlainStateDictExport(format="pt", final_name=None)
    callbacks = [_PtCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0), export]
    module = LitNet(net(seed=1))
    trainer(tmp_path, enable_checkpointing=True, callbacks=callbacks).fit(module, loader())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "last.weights.pt"]
    assert_same(module.model.state_dict(), torch.load(tmp_path / "last.weights.pt", weights_only=True))
    # the training checkpoint is still one: training resumes from it
    resumed = LitNet(net(seed=2))
    trainer(tmp_path, max_steps=4).fit(resumed, loader(), ckpt_path=tmp_path / "last.pt")
    assert resumed.trainer.global_step == 4
