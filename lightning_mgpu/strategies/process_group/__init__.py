"""What every multi-process ``mgpu_*`` strategy (``mgpu_ddp``, ``mgpu_fsdp``) adds to its Lightning base.

- ``services.py``: ``ProcessGroupServices``, the mixin: checks, backend, watchdog, kept shuffle,
  summary, requeue, each hook calling the host's own;
- ``launcher.py``: Lightning's subprocess launcher, watched so a failed rank fails the command;
- ``torchrun_store.py``: under torchrun, each attempt's process group in a key space of torchrun's store
  that no earlier (dead) attempt wrote to;
- ``at_exit.py``: the process group destroyed before the interpreter exits, so a finished run exits 0;
- ``checks.py``: the backend for a device, and the device, backend and ``sync_batchnorm`` checks
  made before any process starts;
- ``summary.py``: the start-up summary printed by rank 0;
- ``requeue.py``: SLURM's requeue signal acted on between two batches, by every rank at once;
- ``errors.py``: a peer's failure told from this rank's own, and explanations added to errors;
- ``watchdog/``: dead, stalled and left-behind ranks found and stopped within seconds.
"""

__all__: list[str] = []  # internal: import from the module that defines a name
