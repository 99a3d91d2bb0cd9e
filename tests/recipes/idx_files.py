"""Tiny MNIST-style IDX files for the tests."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np


def write_idx(path: Path, array: np.ndarray, type_code: int = 0x08, gz: bool = False) -> Path:
    """Write ``array`` in the IDX format (big-endian), gzipped when ``gz``; returns the path written."""
    dtype = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}[type_code]
    header = struct.pack(">BBBB", 0, 0, type_code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(dtype).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def write_mnist(root: Path, train: int = 64, val: int = 32, gz: bool = True) -> dict[str, np.ndarray]:
    """The four MNIST files with random 28x28 images; returns the arrays written."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, (train,), dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (val, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, (val,), dtype=np.uint8),
    }
    for name, array in arrays.items():
        write_idx(root / name, array, gz=gz and "labels" not in name)  # a mix of .gz and raw files
    return arrays
