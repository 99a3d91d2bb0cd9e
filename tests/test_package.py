"""The package imports cheaply and registers its strategies with Lightning."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_mgpu


def test_strategies_registered() -> None:
    assert "mgpu_ddp" in StrategyRegistry
    assert StrategyRegistry["mgpu_ddp"]["strategy"] is lightning_mgpu.MGPUDDPStrategy


def test_import_twice_and_reload_are_harmless() -> None:
    importlib.import_module("lightning_mgpu")
    importlib.reload(lightning_mgpu)
    assert "mgpu_ddp" in StrategyRegistry


def test_registers_when_lightning_is_imported_afterwards() -> None:
    code = (
        "import sys, lightning_mgpu\n"
        "assert 'torch' not in sys.modules, 'import lightning_mgpu imported torch'\n"
        "import lightning as L\n"
        "t = L.Trainer(strategy='mgpu_ddp', accelerator='cpu', devices=1, logger=False)\n"
        "print(type(t.strategy).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("MGPUDDPStrategy")


@pytest.mark.parametrize(
    "module", ["lightning_mgpu.estimate.batch", "lightning_mgpu.oom", "lightning_mgpu.strategies.split.batch"]
)
def test_a_module_the_strategies_use_can_be_imported_first(module: str) -> None:
    # the first import of Lightning registers the strategies, which import these modules again
    code = (
        f"import {module}\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "assert {'mgpu_ddp', 'mgpu_fsdp', 'mgpu_dp', 'mgpu_auto'} <= set(StrategyRegistry)\n"
    )
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)


def test_unknown_public_name() -> None:
    with pytest.raises(AttributeError, match="NoSuchThing"):
        lightning_mgpu.NoSuchThing  # noqa: B018
