"""Predict what a training or inference step needs on each device, before anything runs.

- ``predict.py``: ``estimate_memory`` and its ``MemoryEstimate`` report (public);
- ``training.py``: one warm-up and two measured training steps on copies of the module;
- ``inference.py``: two measured forward passes under ``torch.no_grad()``;
- ``live_bytes.py``: the one counter of bytes held by live tensors, on any device including ``meta``.
"""

from lightning_mgpu.estimate.predict import STRATEGIES, MemoryEstimate, estimate_memory

__all__ = ["STRATEGIES", "MemoryEstimate", "estimate_memory"]
