"""The watchdog of a DDP run: every rank stops within seconds when one dies, stalls or is left behind.

- ``watchdog.py``: ``Watchdog``, the thread each rank runs, and the ``watchdog()`` singleton;
- ``heartbeats.py``: ranks' heartbeats through the process group's store;
- ``verdicts.py``: pure decisions from heartbeats (``Beat``, ``RankInfo``, ``Verdict``, ``Judge``);
- ``processes.py``: exit codes, stacks and process-tree facts read from the operating system;
- ``signals.py``: SIGTERM/SIGINT forwarded into the watchdog thread.
"""
