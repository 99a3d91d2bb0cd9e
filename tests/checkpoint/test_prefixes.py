"""Wrapper prefixes are removed where a wrapper sits, and nowhere else."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mgpu.checkpoint._prefixes import add_prefix, select, strip_wrappers


def test_nested_wrappers_in_any_order_and_depth() -> None:
    sd = {
        "module._orig_mod.encoder._forward_module.0.weight": 1,
        "module._orig_mod.encoder._forward_module.0.bias": 2,
        "module._orig_mod.head.weight": 3,
    }
    plain, removed = strip_wrappers(sd)
    assert list(plain) == ["encoder.0.weight", "encoder.0.bias", "head.weight"]
    assert removed == ["module.", "module._orig_mod.", "module._orig_mod.encoder._forward_module."]


def test_an_attribute_named_module_next_to_siblings_is_kept() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)
            self.norm = nn.LayerNorm(2)

    plain, removed = strip_wrappers(nn.DataParallel(Block()).state_dict())
    assert removed == ["module."]
    assert list(plain) == ["module.weight", "module.bias", "norm.weight", "norm.bias"]


def test_a_leaf_named_like_a_wrapper_is_kept() -> None:
    plain, removed = strip_wrappers({"module": torch.zeros(1)})
    assert (list(plain), removed) == (["module"], [])


def test_select_and_add_prefix() -> None:
    sd = {"model.encoder.w": 1, "model.head.w": 2, "loss.w": 3}
    assert select(sd, "model.encoder") == {"w": 1}
    assert select(sd, "") == sd
    with pytest.raises(KeyError, match="no submodule 'decoder': the weights hold model, loss"):
        select(sd, "decoder")
    assert list(add_prefix({"w": 1}, "module")) == ["module.w"]
