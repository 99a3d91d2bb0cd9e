"""``mnist``: the ``digits`` classifier on MNIST, read from the standard IDX files in a folder you give.

Usage::

    lightning-mgpu run mnist data.root=/path/to/mnist
    lightning-mgpu run mnist data.root=/path/to/mnist trainer.strategy=mgpu_dp trainer.devices=2

The folder holds the four files from the MNIST distribution, gzipped or not (torchvision's
``MNIST/raw`` sub-folder is searched too)::

    train-images-idx3-ubyte[.gz]  train-labels-idx1-ubyte[.gz]
    t10k-images-idx3-ubyte[.gz]   t10k-labels-idx1-ubyte[.gz]

Nothing is downloaded. The 10,000 ``t10k`` images are the held-out validation set.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset
from typing_extensions import override

from lightning_mgpu.config import schema

from ._base import Recipe, RecipeData
from .digits import ConvClassifier, ModelConfig

__all__ = ["MNIST_FILES", "MNISTData", "find_mnist_files", "read_idx"]

MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "val_images": "t10k-images-idx3-ubyte",
    "val_labels": "t10k-labels-idx1-ubyte",
}

# IDX type byte -> big-endian numpy dtype
_IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> torch.Tensor:
    """The array stored in an IDX file (the MNIST format), gzipped or not, as a tensor.

    Raises:
        ValueError: not an IDX file, an unknown type byte, or a size that does not match the header.

    Example::

        images = read_idx("mnist/train-images-idx3-ubyte.gz")  # uint8 [60000, 28, 28]
    """
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path} is not an IDX file: it must start with two zero bytes")
    type_code, ndim = raw[2], raw[3]
    if type_code not in _IDX_TYPES:
        raise ValueError(f"{path}: unknown IDX type byte 0x{type_code:02x}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path} is truncated: its header announces {ndim} dimensions")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">i4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_TYPES[type_code])
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(
            f"{path} holds {len(raw) - header} data bytes; its header announces {shape}, {expected} bytes"
        )
    array = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return torch.from_numpy(array.astype(dtype.newbyteorder("=")))


def find_mnist_files(root: str | Path) -> dict[str, Path]:
    """The four MNIST files in ``root`` (or ``root/MNIST/raw``), each gzipped or not.

    Raises:
        FileNotFoundError: a file is missing; the message says where it looked and what to put there.

    Example::

        files = find_mnist_files("data/mnist")
        files["train_images"]  # data/mnist/train-images-idx3-ubyte.gz
    """
    root = Path(root).expanduser()
    folders = [root, root / "MNIST" / "raw"]
    found: dict[str, Path] = {}
    for key, stem in MNIST_FILES.items():
        for folder in folders:
            hits = [
                folder / f"{stem}{suffix}" for suffix in ("", ".gz") if (folder / f"{stem}{suffix}").is_file()
            ]
            if hits:
                found[key] = hits[0]
                break
    missing = [stem for key, stem in MNIST_FILES.items() if key not in found]
    if missing:
        looked = " and ".join(str(f.resolve()) for f in folders)
        raise FileNotFoundError(
            f"MNIST files not found: looked in {looked} for {', '.join(missing)} (each may end in .gz); "
            f"put the four MNIST IDX files ({', '.join(MNIST_FILES.values())}) there, or set data.root=FOLDER"
        )
    return found


@dataclass
class DataConfig(schema.DataConfig):
    """MNIST from IDX files.

    Example::

        lightning-mgpu run mnist data.root=/data/mnist
    """

    root: str = "data/mnist"
    """Folder of the four IDX files (or of torchvision's ``MNIST/raw``), relative to the current folder."""


class MNISTData(RecipeData):
    """MNIST's 60,000 training and 10,000 test images, scaled to [0, 1], shape ``[1, 28, 28]``.

    The files are looked up when the data module is made, so a wrong folder fails before any
    training process starts; they are read in ``setup``.

    Example::

        data = MNISTData(root="data/mnist", batch_size=128)
    """

    def __init__(self, root: str = "data/mnist", **loader: Any) -> None:
        super().__init__(**loader)
        self.files = find_mnist_files(root)

    @override
    def setup(self, stage: str) -> None:
        if hasattr(self, "train_set"):
            return
        tensors = {key: read_idx(path) for key, path in self.files.items()}
        for split_name in ("train", "val"):
            images, labels = tensors[f"{split_name}_images"], tensors[f"{split_name}_labels"]
            if len(images) != len(labels):
                raise ValueError(
                    f"{self.files[f'{split_name}_images']} holds {len(images)} images but "
                    f"{self.files[f'{split_name}_labels']} holds {len(labels)} labels"
                )
            dataset = TensorDataset(images.unsqueeze(1).float() / 255.0, labels.long())
            setattr(self, f"{split_name}_set", dataset)


RECIPE = Recipe(
    "mnist", ConvClassifier, MNISTData, ModelConfig, DataConfig, tasks=("fit", "validate", "predict")
)
