"""``mgpu_ddp`` and what every multi-process ``mgpu_*`` strategy shares: checks, launcher, summary, watchdog.

- ``strategy.py``: ``MGPUDDPStrategy``, registered as ``mgpu_ddp`` (and ``..._find_unused_parameters_true``);
- ``services.py``: ``ProcessGroupServices``, what every multi-process ``mgpu_*`` strategy adds to
  its Lightning base (checks, backend, watchdog, kept shuffle, summary); ``fsdp/`` uses it too;
- ``launcher.py``: Lightning's subprocess launcher, watched so a failed rank fails the command;
- ``checks.py``: the backend for a device, and the device, backend and ``sync_batchnorm`` checks
  made before any process starts;
- ``summary.py``: the start-up summary printed by rank 0;
- ``requeue.py``: SLURM's requeue signal acted on between two batches, by every rank at once;
- ``errors.py``: DDP's unused-parameter error rewritten to name the parameters; communication
  errors told from a rank's own;
- ``watchdog/``: dead, stalled and left-behind ranks found and stopped within seconds.
"""

from lightning_mgpu.strategies.ddp.strategy import MGPUDDPStrategy

__all__ = ["MGPUDDPStrategy"]
