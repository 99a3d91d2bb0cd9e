"""``resnet``: ResNet-18 and ResNet-50 whose state_dict keys are exactly torchvision's.

Usage::

    lightning-mgpu run resnet18                                 # synthetic images, all local devices
    lightning-mgpu run resnet50 data.root=/data/pets model.num_classes=37
    lightning-mgpu run resnet18_predict weights=W.safetensors trainer.accelerator=gpu trainer.devices=[3]

``ResNet`` (``self.net`` of the module) has torchvision's layer names, so a torchvision
checkpoint (``resnet18-f37072fd.pth``) loads with ``weights=...`` when ``model.num_classes=1000``,
and the exported ``.safetensors`` loads into ``torchvision.models.resnet18()``. torchvision is not
needed.

Data (``data.root``): a folder with one sub-folder of images per class (``root/cat/1.jpg``), or
with ``train/`` and ``val/`` folders laid out that way. Images are read with Pillow (any format
it opens: PNG, JPEG, BMP, GIF, WebP, TIFF), turned to RGB, resized to ``image_size`` and
normalised with the ImageNet mean and deviation. Without ``data.root`` the images are synthetic
(class-coloured stripes plus noise), enough for a demo and the tests. ``data.predict_dir``: a
folder of images (searched recursively) to label with ``task=predict``; without it the
validation images are labelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset
from typing_extensions import override

from lightning_mgpu.config import schema

from ._base import ClassifierModule, Recipe, RecipeData, split

__all__ = ["ResNet", "ResNetClassifier", "resnet18", "resnet50"]

_LAYERS = {"resnet18": ("basic", [2, 2, 2, 2]), "resnet50": ("bottleneck", [3, 4, 6, 3])}
_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
_STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


class _Block(nn.Module):
    """A residual block: torchvision's ``BasicBlock`` (two 3x3 convs) or ``Bottleneck`` (1x1, 3x3, 1x1)."""

    def __init__(self, kind: str, inplanes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.expansion = 4 if kind == "bottleneck" else 1
        out = planes * self.expansion
        if kind == "bottleneck":  # the stride sits on the 3x3 conv ("ResNet v1.5"), as in torchvision
            shapes = [(inplanes, planes, 1, 1), (planes, planes, 3, stride), (planes, out, 1, 1)]
        else:
            shapes = [(inplanes, planes, 3, stride), (planes, planes, 3, 1)]
        for i, (cin, cout, k, s) in enumerate(shapes, start=1):
            self.add_module(f"conv{i}", nn.Conv2d(cin, cout, k, stride=s, padding=k // 2, bias=False))
            self.add_module(f"bn{i}", nn.BatchNorm2d(cout))
        self.relu = nn.ReLU(inplace=True)
        self.depth = len(shapes)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)
            )

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        for i in range(1, self.depth + 1):
            out = getattr(self, f"bn{i}")(getattr(self, f"conv{i}")(out))
            if i < self.depth:
                out = self.relu(out)
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ResNet with torchvision's module names (``conv1``, ``bn1``, ``layer1.0.conv1``, ..., ``fc``).

    Args:
        arch: ``resnet18`` or ``resnet50``.
        num_classes: outputs of ``fc`` (torchvision's ImageNet weights have 1000).

    Example::

        net = ResNet("resnet18", num_classes=1000)
        net.load_state_dict(torch.load("resnet18-f37072fd.pth", weights_only=True))
    """

    def __init__(self, arch: str = "resnet18", num_classes: int = 1000) -> None:
        super().__init__()
        kind, blocks = _LAYERS[arch]
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        inplanes = 64
        for index, (planes, count) in enumerate(zip((64, 128, 256, 512), blocks, strict=True), start=1):
            layer = []
            for b in range(count):
                block = _Block(kind, inplanes, planes, stride=2 if b == 0 and index > 1 else 1)
                inplanes = planes * block.expansion
                layer.append(block)
            self.add_module(f"layer{index}", nn.Sequential(*layer))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(inplanes, num_classes)
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for index in range(1, 5):
            x = getattr(self, f"layer{index}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 1000) -> ResNet:
    """ResNet-18 with torchvision's keys. Example: ``resnet18().state_dict()``."""
    return ResNet("resnet18", num_classes)


def resnet50(num_classes: int = 1000) -> ResNet:
    """ResNet-50 with torchvision's keys. Example: ``resnet50().state_dict()``."""
    return ResNet("resnet50", num_classes)


@dataclass
class ModelConfig:
    """The network.

    Example::

        lightning-mgpu run resnet18 model.arch=resnet50
    """

    arch: str = "resnet18"
    """``resnet18`` or ``resnet50``."""
    num_classes: int = 10
    """Classes; 1000 to load torchvision's ImageNet weights unchanged."""

    def problems(self) -> list[str]:
        """Impossible values, one message each."""
        out = [] if self.arch in _LAYERS else [f"arch: {self.arch!r} is not one of {', '.join(_LAYERS)}"]
        return out + schema.at_least("num_classes", self.num_classes, 2)


@dataclass
class DataConfig(schema.SplitDataConfig):
    """Image folders, or synthetic images.

    Example::

        lightning-mgpu run resnet18 data.root=/data/pets data.image_size=224 model.num_classes=37
    """

    root: str | None = None
    """Class sub-folders of images, or ``train/`` and ``val/`` folders of them; ``null``: synthetic."""
    image_size: int = 64
    """Images are resized to this height and width (224 matches torchvision's ImageNet weights)."""
    val_fraction: float = 0.2
    """Share held out for validation when ``root`` has no ``val/`` folder."""
    num_samples: int = 512
    """Synthetic images (without ``root``)."""
    num_classes: int = 10
    """Synthetic classes (without ``root``); must equal ``model.num_classes``."""
    predict_dir: str | None = None
    """Folder of images to label with ``task=predict``; ``null`` labels the validation images."""

    @override
    def problems(self) -> list[str]:
        halvings = schema.at_least("image_size", self.image_size, 32, " (ResNet halves it five times)")
        return super().problems() + halvings + schema.at_least("num_samples", self.num_samples, 2)


def class_folders(root: str | Path) -> list[str]:
    """Class names of an image folder: its sub-folders, sorted (of ``train/`` when it has ``val/`` too)."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(
            f"data.root {root.resolve()} is not a folder; give a folder of class sub-folders"
        )
    base = root / "train" if (root / "train").is_dir() and (root / "val").is_dir() else root
    classes = sorted(p.name for p in base.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise FileNotFoundError(
            f"data.root {base.resolve()} has no class sub-folders (e.g. {base}/cat/1.jpg)"
        )
    return classes


def _image_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in _SUFFIXES and p.is_file())


class ImageFiles(Dataset):
    """Image files with labels, read with Pillow, resized and normalised: ``(image [3, S, S], label)``."""

    def __init__(self, files: list[Path], labels: list[int], image_size: int) -> None:
        try:
            from PIL import Image
        except ImportError as err:
            raise ModuleNotFoundError("reading image folders needs Pillow: pip install pillow") from err
        self._open = Image.open
        self.files, self.labels, self.size = files, labels, image_size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        import numpy as np

        with self._open(self.files[index]) as img:
            rgb = img.convert("RGB").resize((self.size, self.size))
            pixels = torch.from_numpy(np.asarray(rgb, dtype=np.float32).copy()).permute(2, 0, 1) / 255.0
        return (pixels - _MEAN) / _STD, self.labels[index]


class SyntheticImages(Dataset):
    """Class ``c``: stripes of frequency ``1 + c // 3`` in colour channel ``c % 3``, plus noise."""

    def __init__(self, num_samples: int, num_classes: int, image_size: int, seed: int) -> None:
        self.n, self.classes, self.size, self.seed = num_samples, num_classes, image_size, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        label = index % self.classes
        image = 0.5 * torch.randn(3, self.size, self.size, generator=gen)
        phase = torch.rand(1, generator=gen) * 6.28
        stripes = torch.sin(torch.linspace(0, 6.28 * (1 + label // 3), self.size) + phase)
        image[label % 3] += stripes.view(1, -1) if label % 2 else stripes.view(-1, 1)
        return image, label


class ImageData(RecipeData):
    """Image-folder or synthetic classification data; see the module docstring for the layout.

    Example::

        data = ImageData(root="/data/pets", image_size=224, batch_size=64)
        data.classes[:2]  # ['abyssinian', 'beagle']
    """

    def __init__(
        self,
        root: str | None = None,
        image_size: int = 64,
        val_fraction: float = 0.2,
        num_samples: int = 512,
        num_classes: int = 10,
        predict_dir: str | None = None,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        self.root, self.image_size, self.val_fraction = root, image_size, val_fraction
        self.predict_names: list[str] = []
        if root is None:
            self.classes = [str(c) for c in range(num_classes)]
            full = SyntheticImages(num_samples, num_classes, image_size, self.seed)
            self.train_set, self.val_set = split(full, val_fraction, self.seed)
        else:
            self.classes = class_folders(root)
            self._read_folders(Path(root).expanduser())
        if predict_dir is not None:
            files = _image_files(Path(predict_dir).expanduser())
            if not files:
                raise FileNotFoundError(
                    f"data.predict_dir {predict_dir} holds no images ({', '.join(sorted(_SUFFIXES))})"
                )
            self.predict_set = ImageFiles(files, [-1] * len(files), image_size)
            self.predict_names = [str(f) for f in files]

    def _read_folders(self, root: Path) -> None:
        def labelled(base: Path) -> ImageFiles:
            files, labels = [], []
            for label, name in enumerate(self.classes):
                found = _image_files(base / name)
                files += found
                labels += [label] * len(found)
            if not files:
                raise FileNotFoundError(f"no images in the class folders of {base}")
            return ImageFiles(files, labels, self.image_size)

        if (root / "train").is_dir() and (root / "val").is_dir():
            self.train_set, self.val_set = labelled(root / "train"), labelled(root / "val")
        else:
            self.train_set, self.val_set = split(labelled(root), self.val_fraction, self.seed)


class ResNetClassifier(ClassifierModule):
    """A ``ResNet`` (as ``self.net``) trained with cross-entropy.

    Example::

        model = ResNetClassifier(arch="resnet50", num_classes=37)
    """

    def __init__(
        self, arch: str = "resnet18", num_classes: int = 10, optimizer: dict[str, Any] | None = None
    ) -> None:
        super().__init__(num_classes, optimizer)
        self.save_hyperparameters()
        self.net = ResNet(arch, num_classes)


def _check(cfg: Any) -> list[str]:
    if cfg.data.root is None:
        got, where = cfg.data.num_classes, f"data.num_classes={cfg.data.num_classes}"
    else:
        try:
            classes = class_folders(cfg.data.root)
        except FileNotFoundError as err:
            return [str(err)]
        got, where = (
            len(classes),
            f"data.root has {len(classes)} class folders ({', '.join(classes[:5])}, ...)",
        )
    if got == cfg.model.num_classes:
        return []
    return [f"model.num_classes={cfg.model.num_classes} but {where}; set model.num_classes={got}"]


RECIPE = Recipe(
    "resnet",
    ResNetClassifier,
    ImageData,
    ModelConfig,
    DataConfig,
    tasks=("fit", "validate", "predict"),
    check=_check,
)
