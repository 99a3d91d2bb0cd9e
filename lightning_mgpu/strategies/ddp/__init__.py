"""``mgpu_ddp``: Lightning's DDP with a start-up summary, device checks and a watchdog.

- ``strategy.py``: ``MGPUDDPStrategy``, registered as ``mgpu_ddp``;
- ``services.py``: ``ProcessGroupServices``, what every multi-process ``mgpu_*`` strategy adds to
  its Lightning base (checks, backend, watchdog, kept shuffle, summary); ``fsdp/`` uses it too;
- ``launcher.py``: Lightning's subprocess launcher, watched so a failed rank fails the command;
- ``checks.py``: device and backend checks made before any process starts;
- ``summary.py``: the start-up summary printed by rank 0;
- ``errors.py``: DDP's own errors rewritten to name the parameter or the lost peer;
- ``watchdog/``: dead, stalled and left-behind ranks found and stopped within seconds.
"""

from lightning_mgpu.strategies.ddp.strategy import MGPUDDPStrategy

__all__ = ["MGPUDDPStrategy"]
