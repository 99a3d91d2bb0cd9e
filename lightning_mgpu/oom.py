"""``is_out_of_memory``: an error is an out-of-memory, as torch and Lightning tell it.

One predicate for everything that reacts to running out of memory: micro-batching's ``"auto"``
(retry smaller) and ``DeviceMemoryMonitor`` (explain the error with the memory of every rank).
"""

from __future__ import annotations

import torch

__all__ = ["is_out_of_memory"]


def is_out_of_memory(error: BaseException) -> bool:
    """Out of memory on any device: CUDA's and cuDNN's errors, the CPU allocator's, or a ``MemoryError``.

    Lightning's ``is_oom_error`` reads the ``RuntimeError`` messages of CUDA, cuDNN and the CPU
    allocator ("DefaultCPUAllocator: can't allocate memory"); ``torch.cuda.OutOfMemoryError``
    and Python's ``MemoryError`` are recognised by their type.

    Example::

        from lightning_mgpu.oom import is_out_of_memory

        is_out_of_memory(MemoryError())  # True
        is_out_of_memory(ValueError("out of range"))  # False
    """
    return isinstance(error, (MemoryError, torch.cuda.OutOfMemoryError)) or memory.is_oom_error(error)


# After the definition: importing Lightning registers the mgpu_* strategies, whose micro-batching
# imports this module; when this module is the first to import Lightning, the name must exist by then.
from lightning.pytorch.utilities import memory  # noqa: E402
