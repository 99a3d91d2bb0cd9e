"""``mgpu_ddp``: Lightning's DDP with the process-group services and micro-batching.

- ``strategy.py``: ``MGPUDDPStrategy``, registered as ``mgpu_ddp`` (and ``..._find_unused_parameters_true``);
- ``unused.py``: DDP's unused-parameter error rewritten to name the parameters and give both fixes.

What it shares with ``mgpu_fsdp`` (checks, launcher, summary, requeue, watchdog) is in ``process_group/``.
"""

from lightning_mgpu.strategies.ddp.strategy import MGPUDDPStrategy

__all__ = ["MGPUDDPStrategy"]
