"""ResNet: torchvision's state_dict keys, image folders, weights loading and prediction on a chosen device."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from lightning_mgpu.cli.main import main
from lightning_mgpu.config import ConfigError, load_config
from lightning_mgpu.recipes.resnet import ImageData, ImageFiles, ResNet, resnet18, resnet50

DATA = Path(__file__).parent / "data"


def torchvision_keys(arch: str) -> list[tuple[str, str]]:
    """Keys and shapes of torchvision's ``models.<arch>()`` state_dict, stored from torchvision 0.29.2."""
    lines = (DATA / f"torchvision_{arch}_keys.txt").read_text().splitlines()
    return [(key, shape) for key, shape in (line.split() for line in lines if not line.startswith("#"))]


@pytest.mark.parametrize(
    ("arch", "factory", "count"), [("resnet18", resnet18, 122), ("resnet50", resnet50, 320)]
)
def test_state_dict_keys_and_shapes_are_torchvisions(arch: str, factory: type, count: int) -> None:
    state = factory().state_dict()
    ours = [(k, "x".join(map(str, v.shape)) or "scalar") for k, v in state.items()]
    assert ours == torchvision_keys(arch)
    assert len(ours) == count


def write_images(folder: Path, count: int, colour: tuple[int, int, int], size: int = 40) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        pixels = np.full((size, size + 8, 3), colour, dtype=np.uint8)
        pixels[i % size] = 255 - pixels[i % size]
        path = folder / f"img{i}.{'png' if i % 2 else 'jpg'}"
        Image.fromarray(pixels).save(path)
        paths.append(path)
    return paths


def test_image_folder_classes_and_split(tmp_path: Path) -> None:
    write_images(tmp_path / "cat", 5, (200, 10, 10))
    write_images(tmp_path / "dog", 5, (10, 10, 200))
    (tmp_path / "notes.txt").write_text("not a class")
    data = ImageData(root=str(tmp_path), image_size=32, val_fraction=0.2, batch_size=2)
    assert data.classes == ["cat", "dog"]
    assert len(data.train_set) == 8
    assert len(data.val_set) == 2
    image, label = data.train_set[0]
    assert image.shape == (3, 32, 32)
    assert label in (0, 1)


def test_train_and_val_folders_are_used_as_given(tmp_path: Path) -> None:
    for split, n in (("train", 4), ("val", 2)):
        write_images(tmp_path / split / "a", n, (0, 0, 0))
        write_images(tmp_path / split / "b", n, (255, 255, 255))
    data = ImageData(root=str(tmp_path), image_size=32, batch_size=2)
    assert len(data.train_set) == 8
    assert len(data.val_set) == 4


def test_class_count_must_match_the_model(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        write_images(tmp_path / name, 1, (0, 0, 0))
    with pytest.raises(ConfigError) as info:
        load_config("resnet18", [f"data.root={tmp_path}"])
    assert info.value.problems == [
        "model.num_classes=10 but data.root has 3 class folders (a, b, c, ...); set model.num_classes=3"
    ]
    with pytest.raises(ConfigError, match="is not a folder; give a folder of class sub-folders"):
        load_config("resnet18", [f"data.root={tmp_path / 'nope'}"])


def test_fit_on_an_image_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_images(tmp_path / "imgs" / "red", 4, (220, 0, 0))
    write_images(tmp_path / "imgs" / "blue", 4, (0, 0, 220))
    args = [
        "run",
        "resnet18",
        "data.root=imgs",
        "model.num_classes=2",
        "data.image_size=32",
        "data.batch_size=4",
    ]
    args += ["trainer.fast_dev_run=true", "trainer.devices=1", "trainer.accelerator=cpu", "run_dir=out"]
    assert main([*args, "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]) == 0
    exported = load_file(tmp_path / "out" / "checkpoints" / "final.safetensors")
    resnet18(num_classes=2).load_state_dict(exported, strict=True)  # torchvision's keys, no prefix
    assert sorted(exported) == sorted(key for key, _ in torchvision_keys("resnet18"))


def test_predict_with_torchvision_style_weights(tmp_path: Path) -> None:
    torch.manual_seed(1)
    net = ResNet("resnet18", num_classes=4).eval()
    weights = tmp_path / "resnet18-custom.pth"
    torch.save(net.state_dict(), weights)  # how torchvision's checkpoints are saved
    images = write_images(tmp_path / "to_label" / "nested", 3, (30, 120, 60))
    args = ["run", "resnet18_predict", f"weights={weights}", "model.num_classes=4", "data.image_size=32"]
    args += [f"data.predict_dir={tmp_path / 'to_label'}", "trainer.accelerator=cpu", "trainer.devices=1"]
    assert main([*args, f"run_dir={tmp_path / 'run'}", "trainer.enable_progress_bar=false"]) == 0

    with (tmp_path / "run" / "predictions.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["name"] for r in rows] == [str(p) for p in sorted(images)]
    batch = torch.stack([ImageFiles(sorted(images), [0] * 3, 32)[i][0] for i in range(3)])
    with torch.no_grad():
        prob, pred = torch.softmax(net(batch), dim=-1).max(dim=-1)
    assert [int(r["pred"]) for r in rows] == pred.tolist()
    torch.testing.assert_close(torch.tensor([float(r["prob"]) for r in rows]), prob, atol=1e-5, rtol=0)


def test_weights_that_do_not_fit_are_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = tmp_path / "wrong.pth"
    torch.save(ResNet("resnet18", num_classes=1000).state_dict(), weights)
    args = [
        "run",
        "resnet18_predict",
        f"weights={weights}",
        "trainer.accelerator=cpu",
        f"run_dir={tmp_path / 'r'}",
    ]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert f"cannot load {weights} into ResNet with strict=True" in err
    assert "fc.weight: source [1000, 512], model [10, 512]" in err
    assert "strict=False" not in err  # a Python option, not one of the command line
    assert f"`lightning-mgpu inspect {weights}` shows what the file holds" in err


def test_device_lists_select_gpus_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "resnet18_predict", "trainer.accelerator=cpu", "trainer.devices=[1]"]) == 1
    assert (
        "error: trainer.devices=[1]: device indices select GPUs, and trainer.accelerator is cpu;"
        " give a count such as trainer.devices=2 to run that many CPU processes"
    ) in capsys.readouterr().err


@pytest.mark.gpu
def test_predict_on_a_chosen_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    last = torch.cuda.device_count() - 1
    args = [
        "run",
        "resnet18_predict",
        "trainer.accelerator=gpu",
        f"trainer.devices=[{last}]",
        "data.num_samples=16",
    ]
    assert main([*args, f"run_dir={tmp_path}", "trainer.enable_progress_bar=false"]) == 0
    out = capsys.readouterr().out
    assert "predict done" in out
    assert f"cuda:{last}" in out
    held_out = len(ImageData(num_samples=16).val_set)  # the validation split, labelled without predict_dir
    assert held_out == 3
    assert len((tmp_path / "predictions.csv").read_text().splitlines()) == 1 + held_out
