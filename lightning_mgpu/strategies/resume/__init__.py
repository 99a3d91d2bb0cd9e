"""A run cut anywhere goes on where it stopped: the restart read, the checkpoint chosen, the loader's place.

- ``restart.py``: whether this run is a restart (torchrun's and SLURM's counts), pure;
- ``attempt_record.py``: the record of the run's attempt in its checkpoint folder, which makes the same
  command run again by hand after an unfinished attempt a restart too;
- ``candidates.py``: the run's checkpoints, newest first, and the newest one a kill did not cut short;
- ``auto_resume.py``: ``AutoResume``, a restarted ``fit`` without ``ckpt_path`` resuming from that checkpoint;
- ``position.py``: the training loader's place in its epoch, in every checkpoint, so that a run
  resumed mid-epoch sees every sample once, in the uncut order;
- ``safety_net.py``: ``checkpoint_every``, a resumable checkpoint every N steps or minutes, on by
  itself where the run can be restarted, and ``ResumeCheckpoint``, which saves them;
- ``requeue_failed.py``: ``requeue_on_failure``, a SLURM job whose task failed requeued, bounded;
- ``resumption.py``: ``Resumption``, the three options and the strategy hooks that call them.

The strategies use it through ``process_group/services.py``; nothing here imports another room.
"""

__all__: list[str] = []  # internal: import from the module that defines a name
