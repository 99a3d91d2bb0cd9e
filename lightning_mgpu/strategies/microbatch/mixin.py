"""``MicroBatching``: the ``micro_batch_size=`` argument of every ``mgpu_*`` strategy."""

from __future__ import annotations

import functools
import numbers
from typing import TYPE_CHECKING, Any

from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from lightning_mgpu.strategies.microbatch.batch_runner import EVALUATION_STEPS, MicroBatchRunner
from lightning_mgpu.strategies.microbatch.host import CollectivePasses
from lightning_mgpu.strategies.microbatch.sizes import MicroBatchSizes
from lightning_mgpu.strategies.mixin import StrategyMixin

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["STEP_CONTEXTS", "MicroBatching", "check_micro_batch_size"]

STEP_CONTEXTS = {
    "training_step": "train_step_context",
    "validation_step": "val_step_context",
    "test_step": "test_step_context",
    "predict_step": "predict_step_context",
}
"""Each step and the precision plugin's method that gives the context it runs in."""

_MANUAL_OPTIMIZATION = (
    "micro_batch_size needs automatic optimization: with `automatic_optimization = False` the"
    " training_step calls backward itself. Split the batch inside training_step instead, or"
    " remove micro_batch_size."
)


def check_micro_batch_size(value: Any) -> int | str | None:
    """``value`` if it is a positive integer (of any integer type, as an ``int``), ``"auto"`` or ``None``.

    Raises:
        ValueError: for anything else, naming the value.
    """
    if value is None or value == "auto":
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 1:
        return int(value)  # numpy.int64(4), a size computed with numpy, is 4 rows
    raise ValueError(
        f"micro_batch_size must be a positive number of rows, 'auto' (halve on out-of-memory) or None"
        f" (off), got {value!r}"
    )


class MicroBatching(StrategyMixin):
    """Runs each batch as micro-batches, training with one optimizer step; ``"auto"`` survives out-of-memory.

    A mixin that goes first in a strategy's bases; the strategy's ``__init__`` hands it
    ``micro_batch_size`` (``_init_micro_batching``):

    - ``None`` (default): off, the strategy as without it.
    - an ``int``: each training batch is cut into micro-batches of at most that many rows that run
      forward and backward in turn; the optimizer steps once per batch. With a per-row mean loss
      (or ``lightning_mgpu.global_mean``) the weights after the step equal those of the unsplit
      step; ``self.log`` values and torchmetrics updates combine as over the whole batch. A batch
      no larger than the size runs unsplit. Validation, test and predict batches are cut with the
      same size (a size chosen to fit training memory fits their forward too).
    - ``"auto"``: starts with the whole batch; when any rank runs out of memory, in forward or
      backward, every rank learns of it in the step's one all-reduce, the rank that failed frees
      what the attempt held, halves its micro-batches and runs the same batch again (ranks may end
      on different sizes; the global batch is unchanged). After ``micro_batches.grow_after`` clean
      batches the size doubles again, up to the whole batch and below any size that failed. A
      batch that does not fit in micro-batches of one row stops every rank with
      ``MicroBatchOutOfMemoryError``.

    Evaluation (``validation_step``, ``test_step``, ``predict_step``) runs forward only, by the same
    rules: each step starts from the whole batch (or the size it reached) and halves on
    out-of-memory, with sizes of its own (``micro_batches_eval``) that never change the training
    ones. Logged values (``sync_dist=True`` too: logs are replayed once the ranks agreed) and
    torchmetrics equal the unsplit batch's; predictions come back whole and in order. Every rank
    must run as many validation and test batches (Lightning's ``DistributedSampler`` sees to it);
    in ``predict_step``, whose batches Lightning gives the ranks in unequal numbers, each rank
    recovers alone, except under ``mgpu_fsdp``, whose passes gather collectively.

    A micro-batch gets its rows of every tensor (dim 0) and of every list or tuple that holds no tensor
    and one item per row (``default_collate``'s tuple of string ids); other values go whole to each.
    A list or tuple that holds no tensor and not one item per row is refused at the first batch that
    could be cut (under ``"auto"`` the first batch), before any out-of-memory, naming it. A
    LightningModule that defines ``split_batch_rows(self, batch, sizes)`` cuts its batches itself: it
    returns ``len(sizes)`` parts, part ``i`` holding the next ``sizes[i]`` rows
    (``lightning_mgpu.strategies.split.batch.SplitsBatchRows``).

    What differs from an unsplit step: BatchNorm in training mode normalises each micro-batch
    with its own statistics; dropout draws other masks; under DDP the gradients are averaged
    once after the last micro-batch instead of during backward, and buffers are not broadcast
    from rank 0 at each forward; ``on_before_backward`` and ``on_after_backward`` run once per
    batch, after the micro-batches' backward passes. Manual optimization is refused when fit starts
    (the mixin's ``setup``, before the host's own).

    The host strategy is the runner's ``MicroBatchHost`` (``microbatch/host.py``): beside what every
    ``ParallelStrategy`` has, it names itself (``strategy_name``) and provides ``note_progress``.

    Attributes:
        micro_batch_size: the setting.
        micro_batches: this rank's training ``MicroBatchSizes`` (``size`` now, ``failed``,
            ``grow_after``, and ``last_rows``, the rows per micro-batch its last batch ran in); what
            ``DeviceMemoryMonitor``'s summary shows.
        micro_batches_eval: this rank's ``MicroBatchSizes`` of each evaluation step, by its name
            (``"validation_step"``, ``"test_step"``, ``"predict_step"``).

    Raises:
        ValueError: when fit starts, for a LightningModule with ``automatic_optimization = False``.
    """

    if TYPE_CHECKING:  # what the host provides (microbatch/host.py's MicroBatchHost)
        strategy_name: str

        def note_progress(self) -> None: ...

    def _init_micro_batching(self, micro_batch_size: int | str | None) -> None:
        """Take ``micro_batch_size`` (checked) and build this rank's sizes and the runner of each step.

        Called by the host's ``__init__`` once its Lightning base is initialised; the mixin has no
        ``__init__`` of its own, so nothing reaches it through ``super().__init__(**kwargs)``.
        """
        self.micro_batch_size = check_micro_batch_size(micro_batch_size)
        auto = self.micro_batch_size == "auto"
        start = None if auto else self.micro_batch_size
        assert start is None or isinstance(start, int)
        self.micro_batches = MicroBatchSizes(start, auto=auto)
        self.micro_batches_eval = {stage: MicroBatchSizes(start, auto=auto) for stage in EVALUATION_STEPS}
        every = {"training_step": self.micro_batches, **self.micro_batches_eval}
        self._micro_runners = {stage: MicroBatchRunner(self, sizes, stage) for stage, sizes in every.items()}

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._check_micro_batching(trainer)
        super().setup(trainer)

    def _check_micro_batching(self, trainer: pl.Trainer) -> None:
        """Refuse manual optimization before the first step, not when a batch happens to be split.

        ``setup`` calls it first (a host whose ``setup`` replaces its base's calls it itself).
        """
        module = self.lightning_module
        manual = module is not None and not module.automatic_optimization
        if self.micro_batch_size is not None and manual and trainer.state.fn == TrainerFn.FITTING:
            raise ValueError(_MANUAL_OPTIMIZATION)

    @property
    def collective_passes(self) -> CollectivePasses | None:
        """``None``: a pass needs no other rank. ``mgpu_fsdp``, whose passes gather, returns its own."""
        return None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._micro_batched("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._micro_batched("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._micro_batched("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._micro_batched("predict_step", *args, **kwargs)

    def _micro_batched(self, stage: str, *args: Any, **kwargs: Any) -> Any:
        """The ``stage`` step in micro-batches when ``micro_batch_size`` is set."""
        step = functools.partial(self._unbatched_step, stage)
        if self.micro_batch_size is None or not args:
            return step(*args, **kwargs)
        return self._micro_runners[stage].run(step, args, kwargs)

    def _unbatched_step(self, stage: str, *args: Any, **kwargs: Any) -> Any:
        """One ``stage`` step on a batch or a micro-batch, as the host runs it: its Lightning base's.

        ``mgpu_dp`` overrides it (the step runs over its replicas), and ``mgpu_fsdp`` (through the
        sharded module's forward); ``STEP_CONTEXTS`` names the precision plugin's context of each step.
        """
        return getattr(super(), stage)(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self.micro_batch_size is None or not self._micro_runners["training_step"].take_backward():
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # the micro-batches ran backward already and their gradients are back in place: only the hooks
        module = self.lightning_module
        assert module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        return self.precision_plugin.post_backward(closure_loss, module)
