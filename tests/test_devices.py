"""``lightning_mgpu.devices``: what ``CUDA_VISIBLE_DEVICES`` leaves visible, read as CUDA reads it."""

from __future__ import annotations

import os

from lightning_mgpu.devices import visible_cuda_devices


def test_visible_devices_stop_at_the_first_negative_entry_as_cuda_does() -> None:
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    assert visible_cuda_devices() is None
    os.environ["CUDA_VISIBLE_DEVICES"] = " 1, GPU-5a1b ,-1,2"
    assert visible_cuda_devices() == ["1", "GPU-5a1b"]
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    assert visible_cuda_devices() == []
