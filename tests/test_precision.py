"""precision.py: the package's one table of Lightning's precision names and what they mean."""

from __future__ import annotations

import typing

import torch
from lightning.fabric.plugins.precision.precision import (
    _PRECISION_INPUT_STR,
    _PRECISION_INPUT_STR_ALIAS_CONVERSION,
)

from lightning_mgpu.precision import ALIASES, FSDP_PRECISIONS, PRECISIONS, precision_names


def test_the_table_holds_every_lightning_name_but_transformer_engine() -> None:
    lightning_names = {n for n in typing.get_args(_PRECISION_INPUT_STR) if not n.startswith("transformer")}
    assert set(PRECISIONS) == lightning_names
    assert ALIASES == _PRECISION_INPUT_STR_ALIAS_CONVERSION
    assert precision_names() == (*PRECISIONS, *ALIASES)


def test_every_dtype_named_is_torch_s() -> None:
    for name, dtypes in PRECISIONS.items():
        for dtype in (dtypes.parameters, dtypes.autocast):
            assert dtype is None or isinstance(getattr(torch, dtype), torch.dtype), name


def test_fsdp_precisions_leave_out_fp16_amp_and_float64() -> None:
    assert FSDP_PRECISIONS == ("32-true", "bf16-mixed", "16-true", "bf16-true")
