"""Lightning callbacks of the package, one per module, and what only they use.

- ``memory.py``: ``DeviceMemoryMonitor``; ``memory_readings.py``: what it reads on each device;
  ``memory_report.py``: its table, JSON and OOM guidance;
- ``export.py``: ``PlainStateDictExport``;
- ``predictions.py``: ``PredictionCSV``, the runner's ``predictions.csv``;
- ``_distributed.py``: the object all-gather the callbacks share.
"""
