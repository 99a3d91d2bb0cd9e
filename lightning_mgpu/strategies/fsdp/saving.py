"""``ResavingOwnCheckpoints``: a sharded checkpoint saved again over the run's own, without torch's warning.

torch's ``FileSystemWriter`` warns on every rank whenever the folder it writes to holds a checkpoint
already ("Detected an existing checkpoint in .../last.ckpt, overwriting"). ``ModelCheckpoint``
saves ``last.ckpt`` again at every save by design (it adds a version, ``last-v1.ckpt``, rather
than write over a folder it did not save), so every run printed that warning on every rank from
its second save on. Here it stays quiet for a folder this strategy saved earlier in the run, or the
checkpoint the fit resumed from; a folder another run left keeps torch's warning.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

from typing_extensions import override

from lightning_mgpu._compat.lightning import PATH, attached_trainer
from lightning_mgpu.strategies.mixin import StrategyMixin

__all__ = ["ResavingOwnCheckpoints"]

log = logging.getLogger(__name__)

_OVERWRITING = "Detected an existing checkpoint in "
"""How torch's ``FileSystemWriter.prepare_local_plan`` starts its warning."""


class ResavingOwnCheckpoints(StrategyMixin):
    """Saves over a checkpoint of this run (``last.ckpt`` again) without torch's overwrite warning.

    A mixin placed before Lightning's ``ModelParallelStrategy`` in a strategy's bases.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._saved_checkpoints: set[str] = set()
        super().__init__(*args, **kwargs)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PATH, storage_options: Any | None = None
    ) -> None:
        path = os.path.realpath(filepath)
        module = self.lightning_module
        resumed = (
            module.trainer.ckpt_path if module is not None and attached_trainer(module) is not None else None
        )
        own = path in self._saved_checkpoints or (resumed is not None and os.path.realpath(resumed) == path)
        with warnings.catch_warnings():
            if own:
                log.debug("saving %s again, over this run's own checkpoint", path)
                warnings.filterwarnings("ignore", message=_OVERWRITING, category=UserWarning)
            super().save_checkpoint(checkpoint, filepath, storage_options)
        self._saved_checkpoints.add(path)
