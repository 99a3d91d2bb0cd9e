"""The watchdog of a multi-process run: every rank stops within seconds when one dies, stalls or lags.

- ``watchdog.py``: ``Watchdog``, the thread each rank runs while a run lasts, and the ``watchdog()``
  singleton (``start``/``attach``/``detach``, ``watch_children``, ``infos``, ``verdict``,
  ``wait_for_verdict``, ``explain_failure``);
- ``heartbeats.py``: the run's keys in the process group's store (``Heartbeats``) and this rank's
  idle time (``Idleness``);
- ``verdicts.py``: pure decisions from heartbeats (``Beat``, ``RankInfo``, ``Suspect``, ``Verdict``,
  ``Judge``, ``left_behind``);
- ``local_checks.py``: what this machine tells without the store: launched ranks, the launching
  rank, other ranks on the same host (``LocalChecks``, ``Parent``);
- ``shutdown.py``: how a rank's process ends once the run must stop, the launching process's
  wait for the ranks it started, and the one-line-per-rank summary of a failed run (``ExitSummary``);
- ``processes.py``: exit codes, stacks and process-tree facts read from the operating system;
- ``signals.py``: SIGTERM/SIGINT seen from the watchdog thread (``SignalPipe``, ``quiet_sigterm``).
"""
