"""The IDX reader and the MNIST data module, on tiny IDX files written here."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_mgpu.recipes.mnist import MNIST_FILES, MNISTData, find_mnist_files, read_idx
from tests.recipes.idx_files import write_idx, write_mnist


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
@pytest.mark.parametrize(
    ("type_code", "dtype"),
    [(0x08, np.uint8), (0x09, np.int8), (0x0B, np.int16), (0x0C, np.int32), (0x0D, np.float32)],
)
def test_read_idx_round_trip(tmp_path: Path, gz: bool, type_code: int, dtype: type) -> None:
    array = (
        (np.arange(2 * 3 * 4) * (-1 if type_code in (0x09, 0x0B, 0x0C) else 1)).reshape(2, 3, 4).astype(dtype)
    )
    path = write_idx(tmp_path / "a-idx3", array, type_code=type_code, gz=gz)
    got = read_idx(path)
    assert got.shape == (2, 3, 4)
    np.testing.assert_array_equal(got.numpy(), array)


def test_read_idx_rejects_bad_files(tmp_path: Path) -> None:
    not_idx = tmp_path / "not-idx"
    not_idx.write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(ValueError, match="not-idx is not an IDX file: it must start with two zero bytes"):
        read_idx(not_idx)
    good = write_idx(tmp_path / "cut", np.zeros((4, 5), dtype=np.uint8))
    good.write_bytes(good.read_bytes()[:-3])
    with pytest.raises(ValueError, match=r"cut holds 17 data bytes; its header announces \(4, 5\), 20 bytes"):
        read_idx(good)
    gz = tmp_path / "odd.gz"
    gz.write_bytes(gzip.compress(b"\x00\x00\x42\x01\x00\x00\x00\x01\x00"))
    with pytest.raises(ValueError, match="unknown IDX type byte 0x42"):
        read_idx(gz)


def test_missing_files_say_where_and_what(tmp_path: Path) -> None:
    (tmp_path / "mnist").mkdir()
    write_idx(tmp_path / "mnist" / "train-images-idx3-ubyte", np.zeros((1, 28, 28), dtype=np.uint8), gz=True)
    with pytest.raises(FileNotFoundError) as info:
        find_mnist_files(tmp_path / "mnist")
    message = str(info.value)
    assert f"looked in {tmp_path / 'mnist'} and {tmp_path / 'mnist' / 'MNIST' / 'raw'}" in message
    assert (
        "for train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte (each may end in .gz)"
        in message
    )
    assert "put the four MNIST IDX files" in message
    assert "or set data.root=FOLDER" in message


def test_data_module_reads_gz_and_raw_and_torchvision_layout(tmp_path: Path) -> None:
    arrays = write_mnist(tmp_path / "MNIST" / "raw", train=20, val=10)
    files = find_mnist_files(tmp_path)
    assert {p.name for p in files.values()} == {
        "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte",
    }
    data = MNISTData(root=str(tmp_path), batch_size=4)
    data.setup("fit")
    image, label = data.train_set[3]
    assert image.shape == (1, 28, 28)
    assert image.dtype == torch.float32
    torch.testing.assert_close(image[0], torch.from_numpy(arrays["train-images-idx3-ubyte"][3]).float() / 255)
    assert label == int(arrays["train-labels-idx1-ubyte"][3])
    assert len(data.val_set) == 10
    assert set(MNIST_FILES.values()) == {k for k in arrays}
