"""Lightning callbacks of the package, one per module.

- ``memory.py``: ``DeviceMemoryMonitor``; ``memory_report.py``: its table, JSON and OOM guidance;
- ``export.py``: ``PlainStateDictExport``.
"""
