"""``mgpu_dp``: DataParallel for Lightning 2.x, one process, one replica per device.

- ``strategy.py``: ``MGPUDataParallelStrategy``, registered as ``mgpu_dp``;
- ``replicas.py``: building the replicas and routing each step's calls into them;
- ``lockstep.py``: manual optimization, the replicas' threads meeting at each optimizer call;
- ``step.py``: ``ReplicaStep``, one step over the replicas: the batch cut, each replica's own metric
  copies (``split.merge_metrics.PartMetrics``) and logs, the replicas run at once in threads, the
  results made one.

Cutting the batch, replaying ``self.log`` and merging metrics are shared with micro-batching in ``split/``.

Set ``logging.getLogger("lightning_mgpu.strategies.dp").setLevel(logging.DEBUG)`` to see how each
batch is split and how the replicas run.
"""

from lightning_mgpu.strategies.dp.strategy import MGPUDataParallelStrategy

__all__ = ["MGPUDataParallelStrategy"]
