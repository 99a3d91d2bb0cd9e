"""``mgpu_fsdp``: sharded training on torch's FSDP2, with the process-group services of ``process_group/``.

- ``strategy.py``: ``MGPUFSDPStrategy``, on Lightning's ``ModelParallelStrategy`` (launcher,
  device mesh, sharded checkpoints) and ``process_group``'s ``ProcessGroupServices``; its ``setup``
  shards the model itself (no ``configure_model`` needed), then runs Lightning's own steps;
- ``mesh.py``: ``shared_mesh``, the one device mesh every fit of a process uses, so that fits leave no
  process groups behind;
- ``lightning_mgpu._sharding.plan``: which submodules become units (shared with the estimate);
- ``sharding.py``: the options (checked against the run inside ``Trainer(...)``), the Trainer
  precision's dtypes, and the ``fully_shard`` calls;
- ``lightning_mgpu._sharding.per_device``: the least memory a device needs under a plan;
- ``need.py``: that need with the model's optimizer state and the Trainer precision's dtypes, weighed by
  ``mgpu_auto``, and ``check_fits``, the refusal on GPUs before sharding when it exceeds a device;
- ``saving.py``: sharded checkpoints saved again over the run's own (``last.ckpt``) without torch's warning;
- ``collectives.py``: FSDP's own collectives, watched: an out-of-memory in their buffers is named, and
  recovered under ``"auto"``; one inside a collective stops every rank (``CollectiveOutOfMemoryError``);
  ``SyncPoints`` announces each one, so micro-batching's ``"auto"`` survives an out-of-memory on one rank;
- ``lightning_mgpu.estimate.model_state``: bytes of parameters, gradients and optimizer state held by this
  rank and by the whole model.
"""

from lightning_mgpu.strategies.fsdp.strategy import MGPUFSDPStrategy

__all__ = ["MGPUFSDPStrategy"]
