"""The training loader's place in its epoch, saved in every checkpoint and restored: exact mid-epoch resume.

Lightning restores a run's step and batch counters, but a plain ``DataLoader`` starts its epoch
again from the first batch: after a cut in the middle of an epoch, its first batches are seen twice
and its last ones never. Lightning saves and restores the state of a loader that has ``state_dict``
and ``load_state_dict`` (in the fit loop's ``combined_loader`` entry); :func:`resumable` gives the
training loader the strategy set up (a ``DistributedSampler``, shuffled or not, inside a plain
``BatchSampler``) those two methods:

- ``state_dict``: the sampler's epoch, seed and shuffle, the batches this epoch's training steps
  consumed (Lightning's own count of processed batches, which is where it resumes), the batch size,
  the number of processes and of samples;
- ``load_state_dict``: the sampler gets the saved seed and epoch back, and its next pass over that
  epoch starts after the consumed samples (:class:`ResumableSampler`).

A ``DistributedSampler``'s epoch is one permutation of the dataset (from the seed and the epoch)
dealt to the ranks in turn, so the global batches are the same runs of that permutation whatever
the number of processes: resumed with another number of processes but the same global batch size
(processes x batch size), every global batch is the one the uncut run had. With another global
batch size the epoch goes on after the last new-size batch the consumed samples fill, Lightning's
batch counter is set to match, and a warning says how many samples see a second step.
A loader with a state of its own (``StatefulDataLoader``, say), or another sampler, is left alone.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Sampler

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["LoaderPosition", "ResumableSampler", "resumable"]

log = logging.getLogger(__name__)

_VERSION = 1


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


class LoaderPosition:
    """``state_dict`` / ``load_state_dict`` of the training loader, for Lightning's fit loop.

    Args:
        sampler: The loader's :class:`ResumableSampler`.
        batch_size: The loader's batch size (per process).
        trainer: Whose fit loop counts the batches consumed and resumes its counters.
        name: The strategy's name, for messages.
    """

    def __init__(self, sampler: ResumableSampler, batch_size: int, trainer: pl.Trainer, name: str) -> None:
        self.sampler, self.batch_size, self.trainer, self.name = sampler, batch_size, trainer, name

    def _progress(self) -> Any:
        return self.trainer.fit_loop.epoch_loop.batch_progress

    def state_dict(self) -> dict[str, Any]:
        inner = self.sampler.inner
        return {
            "lightning_mgpu_position": _VERSION,
            "epoch": inner.epoch,
            "seed": inner.seed,
            "shuffle": inner.shuffle,
            "batches": self._progress().current.processed,
            "batch_size": self.batch_size,
            "processes": inner.num_replicas,
            "samples": len(inner.dataset),  # type: ignore[arg-type]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("lightning_mgpu_position") != _VERSION:
            rank_zero_warn(f"{self.name}: the checkpoint holds no loader position of this version: {state!r}")
            return
        inner = self.sampler.inner
        inner.seed = state["seed"]
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


def resumable(loader: object, trainer: pl.Trainer, name: str) -> object:
    """``loader`` with a :class:`ResumableSampler` and a :class:`LoaderPosition`, where it can have them.

    - a ``DataLoader`` with a ``state_dict`` of its own, or another sampler than a
      ``DistributedSampler`` in a plain ``BatchSampler``: ``loader`` itself;
    - otherwise a new ``DataLoader`` made as Lightning makes one with a new sampler.
    """
    if not isinstance(loader, DataLoader) or isinstance(loader, _Stateful):
        return loader
    sampler, batch_sampler = loader.sampler, loader.batch_sampler
    if type(sampler) is not DistributedSampler or type(batch_sampler) is not BatchSampler:
        log.debug("%s: the training loader's sampler %s is left alone", name, type(sampler).__name__)
        return loader
    wrapped = ResumableSampler(sampler)
    new = _update_dataloader(loader, wrapped, mode=RunningStage.TRAINING)
    position = LoaderPosition(wrapped, batch_sampler.batch_size, trainer, name)
    # Lightning saves and restores the state of a loader that has these two (its `_Stateful`)
    new.state_dict = position.state_dict
    new.load_state_dict = position.load_state_dict
    return new
