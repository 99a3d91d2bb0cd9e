"""Lightning callbacks of the package, one per module, and what only they use.

- ``memory.py``: ``DeviceMemoryMonitor``; ``memory_readings.py``: what it reads on each device;
  ``memory_report.py``: its table, JSON and OOM guidance;
- ``time.py``: ``DeviceTimeMonitor``; ``time_clocks.py``: how it times the all-reduce and CUDA batches;
  ``time_report.py``: its verdict, table and JSON;
- ``export.py``: ``PlainStateDictExport``;
- ``predictions.py``: ``PredictionCSV``, the runner's ``predictions.csv``;
- ``_monitor.py``: what both monitors share: their arguments, every rank's rows gathered to rank 0,
  their lines at the start and tables at the end of ``fit`` logged as one block;
- ``_distributed.py``: the object all-gather the callbacks share.
"""
