"""``mgpu_dp``: DataParallel for Lightning 2.x, one process, one replica per device.

- ``strategy.py``: ``MGPUDataParallelStrategy``, registered as ``mgpu_dp``;
- ``scatter.py``: splitting a batch along dim 0 and combining the replicas' outputs;
- ``replicas.py``: building the replicas and routing each step's calls into them;
- ``lockstep.py``: running the replicas' steps in threads that meet at each optimizer call;
- ``metrics.py``: ``self.log`` values and torchmetrics states merged across replicas.
"""

from lightning_mgpu.strategies.dp.strategy import MGPUDataParallelStrategy

__all__ = ["MGPUDataParallelStrategy"]
