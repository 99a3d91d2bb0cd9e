"""Lightning callbacks of the package, one per module.

- ``memory.py``: ``DeviceMemoryMonitor``;
- ``export.py``: ``PlainStateDictExport``.
"""
