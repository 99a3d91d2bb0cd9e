"""Checkpoints that load anywhere: plain and DataParallel exports, a universal loader, inspection.

- :func:`export_state_dict` writes the plain weights of a Lightning ``.ckpt``, a (wrapped) module or
  a state_dict, atomically, as safetensors or ``.pt`` (``export.exported_state_dict`` gives them
  without writing: what callbacks use to check their arguments early);
- :func:`load_state_dict` loads any of those into a plain, DataParallel, DDP or compiled model and
  returns a :class:`LoadReport`, or raises :class:`LoadError` listing what does not fit;
- :func:`inspect_checkpoint` describes a file: its kind, tensors, wrappers and what it loads into.

Nothing here knows about strategies; files are only ever unpickled with ``weights_only=True``
unless the caller passes ``trust_pickle=True``.
"""

from lightning_mgpu.checkpoint._report import LoadReport
from lightning_mgpu.checkpoint.export import ExportReport, export_state_dict
from lightning_mgpu.checkpoint.inspect import CheckpointInfo, inspect_checkpoint
from lightning_mgpu.checkpoint.load import LoadError, load_state_dict

__all__ = [
    "CheckpointInfo",
    "ExportReport",
    "LoadError",
    "LoadReport",
    "export_state_dict",
    "inspect_checkpoint",
    "load_state_dict",
]
