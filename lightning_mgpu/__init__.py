"""Lightning strategies, callbacks and checkpoint tools for training on several GPUs.

Importing the package registers ``mgpu_ddp``, ``mgpu_dp``, ``mgpu_fsdp`` and ``mgpu_auto`` in
Lightning's ``StrategyRegistry``::

    import lightning as L
    import lightning_mgpu  # registers the strategies

    trainer = L.Trainer(accelerator="gpu", devices=[0, 3], strategy="mgpu_ddp")

Public names are imported on first use, so ``import lightning_mgpu`` (and the
``lightning-mgpu --help`` command line) stays fast and does not import torch.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from lightning_mgpu._registration import register_when_lightning_loads

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "MGPUDDPStrategy": "lightning_mgpu.strategies.ddp.strategy",
    "MGPUDataParallelStrategy": "lightning_mgpu.strategies.dp.strategy",
    "MGPUFSDPStrategy": "lightning_mgpu.strategies.fsdp.strategy",
    "MGPUAutoStrategy": "lightning_mgpu.strategies.auto",
    "choose_strategy": "lightning_mgpu.strategies.auto",
    "StrategyChoice": "lightning_mgpu.strategies.auto",
    "DeviceMemoryMonitor": "lightning_mgpu.callbacks.memory",
    "DeviceTimeMonitor": "lightning_mgpu.callbacks.time",
    "PlainStateDictExport": "lightning_mgpu.callbacks.export",
    "export_state_dict": "lightning_mgpu.checkpoint",
    "load_state_dict": "lightning_mgpu.checkpoint",
    "inspect_checkpoint": "lightning_mgpu.checkpoint",
    "LoadReport": "lightning_mgpu.checkpoint",
    "estimate_memory": "lightning_mgpu.estimate",
    "MemoryEstimate": "lightning_mgpu.estimate",
    "plot_memory": "lightning_mgpu.plot",
    "plot_time": "lightning_mgpu.plot",
    "global_mean": "lightning_mgpu.losses",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_mgpu' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    setattr(sys.modules[__name__], name, value)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


register_when_lightning_loads()
