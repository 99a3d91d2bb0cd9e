"""A sharded checkpoint saved again over the run's own, without torch's warning.

torch's ``FileSystemWriter`` warns on every rank whenever the folder it writes to holds a checkpoint
already ("Detected an existing checkpoint in .../last.ckpt, overwriting"). ``ModelCheckpoint``
saves ``last.ckpt`` again at every save by design (it adds a version, ``last-v1.ckpt``, rather
than write over a folder it did not save), so every run printed that warning on every rank from
its second save on. ``saving_over_own`` keeps it quiet for a folder this strategy saved earlier in the
run, or the checkpoint the fit resumed from; a folder another run left keeps torch's warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator

from lightning_mgpu._compat.lightning import PATH

__all__ = ["saving_over_own"]

log = logging.getLogger(__name__)

_OVERWRITING = "Detected an existing checkpoint in "
"""How torch's ``FileSystemWriter.prepare_local_plan`` starts its warning."""


@contextlib.contextmanager
def saving_over_own(filepath: PATH, saved: set[str], resumed: PATH | None) -> Iterator[None]:
    """While a checkpoint is saved to ``filepath``: no overwrite warning over ``saved`` or ``resumed``.

    A save that returns adds ``filepath`` to ``saved``, the run's own checkpoints.
    """
    path = os.path.realpath(filepath)
    with warnings.catch_warnings():
        if path in saved or (resumed is not None and os.path.realpath(resumed) == path):
            log.debug("saving %s again, over this run's own checkpoint", path)
            warnings.filterwarnings("ignore", message=_OVERWRITING, category=UserWarning)
        yield
    saved.add(path)
