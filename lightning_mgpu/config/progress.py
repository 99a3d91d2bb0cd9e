"""Progress a log file can hold: whole lines instead of a redrawn bar, and no warnings users cannot act on.

- ``LineProgressBar`` prints one line per training epoch (time, batches, the metrics logged with
  ``prog_bar=True``) and one per validate / test / predict run, timed from its ``setup``. Lightning's
  TQDM bar redraws its line with ``\\r`` many times a second, and in a file every redraw stays (about
  60 KB for the ``digits`` recipe).
- ``progress_bar_for(stream)`` picks it when ``stream`` is not a terminal; on a terminal Lightning's
  own bar stays.
- ``hide_unactionable_warnings()`` filters, by message and module, warnings that Lightning's or
  torch's own code raises about itself (their users cannot change that code).

This module imports Lightning; ``config.instantiate.build_trainer`` uses it.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import IO, Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar
from typing_extensions import override

__all__ = ["LineProgressBar", "hide_unactionable_warnings", "progress_bar_for"]

log = logging.getLogger(__name__)

# (message regex, module regex) of warnings raised inside Lightning about torch's API it uses
_UNACTIONABLE = (
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", r"lightning\.pytorch\.utilities\._pytree"),
)

# the line ending a validate / test / predict run, and the Trainer's batch counts it reads
_RUNS = {
    "validate": ("validation", "num_val_batches"),
    "test": ("test", "num_test_batches"),
    "predict": ("prediction", "num_predict_batches"),
}


class LineProgressBar(ProgressBar):
    """Lightning's progress bar slot, filled with one line per epoch: what a log file should hold.

    Example::

        trainer = L.Trainer(callbacks=[LineProgressBar()])
        # epoch 1/10: 23 batches in 1.2s, train/loss=0.4213, val/acc=0.9306
    """

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True
        self._start = time.monotonic()

    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._start = time.monotonic()

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = time.monotonic()

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        limit = f"/{trainer.max_epochs}" if trainer.max_epochs not in (None, -1) else ""
        batches = trainer.fit_loop.epoch_loop.batch_progress.current.completed
        self._line(trainer, pl_module, f"epoch {trainer.current_epoch + 1}{limit}: {batches} batches")

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage in _RUNS:  # a fit's validation results are on its epoch lines
            what, counts = _RUNS[stage]
            self._line(trainer, pl_module, f"{what}: {_total(sum(getattr(trainer, counts)))} batches")

    def _line(self, trainer: L.Trainer, pl_module: L.LightningModule, what: str) -> None:
        if not self._enabled:
            return
        metrics = {k: v for k, v in self.get_metrics(trainer, pl_module).items() if k != "v_num"}
        shown = "".join(f", {k}={_number(v)}" for k, v in metrics.items())
        self.print(f"{what} in {time.monotonic() - self._start:.1f}s{shown}", flush=True)


def progress_bar_for(stream: IO[Any]) -> ProgressBar | None:
    """``LineProgressBar`` when ``stream`` is not a terminal (a log file, a pipe), else ``None``.

    Example::

        bar = progress_bar_for(sys.stdout)  # None in a terminal: Lightning's bar
    """
    if getattr(stream, "isatty", lambda: False)():
        log.debug("progress: %r is a terminal, Lightning's bar redraws in place", stream)
        return None
    log.debug("progress: %r is not a terminal (a log file or a pipe), one line per epoch", stream)
    return LineProgressBar()


def hide_unactionable_warnings() -> None:
    """Ignore warnings Lightning raises about its own use of torch's API: nothing a user can change.

    Each filter names the message and the module raising it, so the same words from user code
    still show.
    """
    for message, module in _UNACTIONABLE:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning, module=module)


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _total(batches: float) -> str:
    return str(int(batches)) if batches != float("inf") else "?"
