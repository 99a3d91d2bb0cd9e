"""The training loader's place in its epoch, saved in every checkpoint and restored: exact mid-epoch resume.

Lightning restores a run's step and batch counters, but a plain ``DataLoader`` starts its epoch
again from the first batch: after a cut in the middle of an epoch, its first batches are seen twice
and its last ones never. :class:`LoaderPosition`, a callback the strategy adds, wraps the training
loader's sampler (a ``DistributedSampler``, shuffled or not, inside a plain ``BatchSampler``) in a
:class:`ResumableSampler`, and keeps with every checkpoint (as its callback state, which any other
strategy resuming the checkpoint ignores):

- the sampler's epoch, seed and shuffle, the batches this epoch's training steps consumed
  (Lightning's own count of processed batches, which is where it resumes), the batch size, the
  number of processes and of samples;
- restored, the sampler gets the saved seed and epoch back, and its next pass over that epoch
  starts after the consumed samples, before Lightning's first ``iter()`` of the loader.

A ``DistributedSampler``'s epoch is one permutation of the dataset (from the seed and the epoch)
dealt to the ranks in turn, so the global batches are the same runs of that permutation whatever
the number of processes: resumed with another number of processes but the same global batch size
(processes x batch size), every global batch is the one the uncut run had. With another global
batch size the epoch goes on after the last new-size batch the consumed samples fill, Lightning's
batch counter is set to match, and a warning says how many samples see a second step.
A loader with a state of its own (``StatefulDataLoader``, say), or another sampler, is left alone; one
of unknown length (an ``IterableDataset``) resumed in the middle of its epoch gets a warning that the
epoch starts again, which Lightning gives only where the length is known.
"""

from __future__ import annotations

import itertools
import logging
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Sampler
from typing_extensions import override

from lightning_mgpu._compat.lightning import Stateful, combined_loader, update_dataloader

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["LoaderPosition", "ResumableSampler"]

log = logging.getLogger(__name__)

_VERSION = 1
_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"
"""How Lightning's warning about a loader it cannot resume starts."""


class ResumableSampler(Sampler[int]):
    """A ``DistributedSampler`` whose next pass over a given epoch can start after its first samples.

    Args:
        inner: The sampler; ``set_epoch`` and its order are its own.
    """

    def __init__(self, inner: DistributedSampler) -> None:
        self.inner = inner
        self._skip = 0
        self._skip_epoch: int | None = None

    def skip_next(self, epoch: int, samples: int) -> None:
        """Leave out the first ``samples`` of this rank's next pass, if that pass is over ``epoch``."""
        self._skip, self._skip_epoch = samples, epoch

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        # a generator: the decision waits for the first batch, after Lightning set the epoch
        skip = self._skip if self._skip_epoch == self.inner.epoch else 0
        self._skip, self._skip_epoch = 0, None
        yield from itertools.islice(iter(self.inner), skip, None)

    def __len__(self) -> int:
        # the whole epoch: Lightning counts the resumed epoch's batches from where it left off
        return len(self.inner)


class LoaderPosition(Callback):
    """Saves the training loader's place in its epoch in every checkpoint and puts it back on resume.

    The strategy adds it to the Trainer and gives it the training loader to wrap (:meth:`wrap`).

    Args:
        name: The strategy's name, for messages.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.sampler: ResumableSampler | None = None
        self.batch_size = 0
        self._trainer: pl.Trainer | None = None
        self._pending: dict[str, Any] | None = None

    def wrap(self, loader: object, trainer: pl.Trainer) -> object:
        """``loader`` with a :class:`ResumableSampler`, at the saved place if a checkpoint was loaded.

        - a ``DataLoader`` with a ``state_dict`` of its own, or another sampler than a
          ``DistributedSampler`` in a plain ``BatchSampler``: ``loader`` itself;
        - otherwise a new ``DataLoader`` made as Lightning makes one with a new sampler.
        """
        if not isinstance(loader, DataLoader) or isinstance(loader, Stateful):
            return loader
        sampler, batch_sampler = loader.sampler, loader.batch_sampler
        if type(sampler) is not DistributedSampler or type(batch_sampler) is not BatchSampler:
            log.debug("%s: the training loader's sampler %s is left alone", self.name, type(sampler).__name__)
            return loader
        self.sampler = ResumableSampler(sampler)
        self.batch_size, self._trainer = batch_sampler.batch_size, trainer
        wrapped = update_dataloader(loader, self.sampler, mode=RunningStage.TRAINING)
        # before Lightning's first iter(): its workers may take the first indices at once
        if self._pending is not None:
            state, self._pending = self._pending, None
            self._restore(state)
        return wrapped

    def _progress(self) -> Any:
        assert self._trainer is not None
        return self._trainer.fit_loop.epoch_loop.batch_progress

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A loader of unknown length, kept as it is, resumed in the middle of its epoch: say what happens.

        Lightning warns where the epoch's length is known; without one (an ``IterableDataset``) it
        replays the epoch from its first batch in silence.
        """
        progress: Any = trainer.fit_loop.epoch_loop.batch_progress
        done = progress.current.processed
        if self.sampler is not None or trainer.num_training_batches != float("inf"):
            return
        if not done or progress.is_last_batch:
            return
        loader = combined_loader(trainer)
        if loader is not None and all(isinstance(part, Stateful) for part in loader.flattened):
            return
        rank_zero_warn(
            f"{self.name}: resumed {done} batches into epoch {trainer.current_epoch} with a training loader"
            " of unknown length that keeps no position of its own (an IterableDataset, say): the epoch"
            f" starts again from its first batch, so its first {done} batches are trained on twice. A"
            " loader with a state_dict (torchdata's StatefulDataLoader) resumes where it stopped."
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.sampler is None or self._trainer is None:
            return {}
        inner = self.sampler.inner
        return {
            "version": _VERSION,
            "epoch": inner.epoch,
            "seed": inner.seed,
            "shuffle": inner.shuffle,
            "batches": self._progress().current.processed,
            "batch_size": self.batch_size,
            "processes": inner.num_replicas,
            "samples": len(inner.dataset),  # type: ignore[arg-type]
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != _VERSION:
            rank_zero_warn(
                f"{self.name}: the checkpoint holds no loader position of this version: {state_dict}"
            )
            return
        self._pending = state_dict

    def _restore(self, state: dict[str, Any]) -> None:
        assert self.sampler is not None
        inner = self.sampler.inner
        inner.seed = state["seed"]
        if self._progress().is_last_batch:
            # The checkpoint closed its epoch: the next pass is the next epoch's, whole. Its epoch is set
            # here because a loader with workers draws its first indices when Lightning makes its
            # iterator, before Lightning sets the sampler's epoch (and skips nothing).
            inner.set_epoch(state["epoch"] + 1)
            log.debug("epoch %d was over: the next starts from its first batch", state["epoch"])
            return
        inner.set_epoch(state["epoch"])
        samples = len(inner.dataset)  # type: ignore[arg-type]
        changed = [
            f"{what} {state[key]} then, {now} now"
            for what, key, now in (("shuffle", "shuffle", inner.shuffle), ("dataset of", "samples", samples))
            if state[key] != now
        ]
        if changed:
            rank_zero_warn(
                f"{self.name}: the training loader changed since the checkpoint ({'; '.join(changed)}): epoch"
                f" {state['epoch']} goes on after {state['batches']} batches of a different order"
            )
        # Lightning cannot see that this loader goes on where it stopped, and would say otherwise
        warnings.filterwarnings("ignore", message=_NOT_RESUMABLE, category=PossibleUserWarning)
        consumed = state["batches"] * state["batch_size"] * state["processes"]  # every rank's
        old_global = state["batch_size"] * state["processes"]
        new_global = self.batch_size * inner.num_replicas
        batches = consumed // new_global
        self.sampler.skip_next(state["epoch"], batches * self.batch_size)
        if new_global == old_global:
            log.debug("epoch %d goes on at batch %d, in the uncut order", state["epoch"], batches)
            return
        self._shift_counters(batches - state["batches"])
        again = consumed - batches * new_global
        rank_zero_info(
            f"{self.name}: the global batch is {new_global} samples now ({inner.num_replicas} x"
            f" {self.batch_size}), {old_global} in the checkpoint: epoch {state['epoch']} goes on at sample"
            f" {batches * new_global} of {samples}, batch {batches} of the new size"
            + (f"; {again} samples see a second step this epoch" if again else "")
        )

    def _shift_counters(self, delta: int) -> None:
        """Move Lightning's batch counters to the new batch size, keeping their differences (its restart
        stage)."""
        progress = self._progress()
        for counts in (progress.current, progress.total):
            for field in ("ready", "started", "processed", "completed"):
                setattr(counts, field, getattr(counts, field) + delta)
