"""One batch run as micro-batches, forward (and backward in training) in turn, rerun smaller on out-of-memory.

``MicroBatchRunner.run`` replaces one call of the strategy's ``training_step``:

- the batch is cut along dim 0 into micro-batches of at most ``size`` rows (``split.batch``);
- each one runs the host strategy's own ``training_step`` (so ``mgpu_dp`` still spreads it over
  its replicas), with ``self.log`` captured, the module's metrics swapped for copies, and DDP's
  gradient sync off; its loss, weighted by its share of the rows (or, when the step used
  ``global_mean``, by its count), goes backward at once and the graph is freed;
- every rank then tells the others in one all-reduce whether it ran out of memory, and the
  count ``global_mean`` saw; no gradient has crossed ranks yet, so a rank that failed in
  backward leaves no other rank waiting in a collective;
- under ``"auto"`` a rank that ran out of memory drops what the attempt held, halves its
  micro-batches and runs the batch again while the others wait at the next all-reduce;
  when no rank failed, the gradients are averaged over the ranks once (``grads``), the logs
  replayed once and the metrics merged, as one unsplit step would have left them.

A runner made for ``validation_step``, ``test_step`` or ``predict_step`` runs the same attempts with
forward only: no gradients to keep apart, no loss to weight, and the outputs (predictions) made
one in the batch's order. The ranks meet after each attempt as in training, except in
``predict_step`` where the passes need no other rank (every strategy but ``mgpu_fsdp``): Lightning's
predict sampler gives the ranks different numbers of batches, so there each rank recovers alone.
"""

from __future__ import annotations

import gc
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu._words import counted, ranks
from lightning_mgpu.losses import MicroCounts, micro_counts
from lightning_mgpu.oom import is_out_of_memory
from lightning_mgpu.strategies.microbatch.agreement import FATAL, OK, RETRY, Agreement
from lightning_mgpu.strategies.microbatch.first_size import estimated_start
from lightning_mgpu.strategies.microbatch.grads import BatchGradients
from lightning_mgpu.strategies.microbatch.host import CollectivePasses, MicroBatchHost
from lightning_mgpu.strategies.microbatch.sizes import MicroBatchSizes
from lightning_mgpu.strategies.split.batch import (
    check_cuttable,
    combine_outputs,
    scatter_batch,
    split_rows,
    split_sizes,
)
from lightning_mgpu.strategies.split.logs import LogCapture, replay_logs
from lightning_mgpu.strategies.split.merge_metrics import PartMetrics

__all__ = ["EVALUATION_STEPS", "MicroBatchOutOfMemoryError", "MicroBatchRunner"]

EVALUATION_STEPS = ("validation_step", "test_step", "predict_step")
"""The steps that run forward only; ``"training_step"`` is the other one a runner serves."""

log = logging.getLogger(__name__)


class MicroBatchOutOfMemoryError(MemoryError):
    """A batch did not fit even in micro-batches of one row, on this rank or another."""


@dataclass(frozen=True)
class _Done:
    """What a successful attempt leaves for the end of the batch."""

    outputs: list[Any]
    captures: list[LogCapture]
    sizes: list[int]
    counts: list[Tensor]

    def local_count(self) -> Tensor | None:
        """The count ``global_mean`` saw over this rank's micro-batches, if the step used it."""
        if not self.counts:
            return None
        return torch.stack([c.to(torch.float64) for c in self.counts]).sum()


def _where(trainer: Trainer, stage: str) -> str:
    """The batch being run, for messages: ``"batch 3 of epoch 0"``, ``"validation batch 2 of epoch 1"``."""
    fitting = trainer.state.fn == TrainerFn.FITTING
    epoch = f" of epoch {trainer.current_epoch}" if fitting else ""
    if stage == "training_step":
        return f"batch {trainer.fit_loop.epoch_loop.batch_idx}{epoch}"
    if stage == "predict_step":
        progress, kind = trainer.predict_loop.batch_progress, "predict"
    elif stage == "test_step":
        progress, kind = trainer.test_loop.batch_progress, "test"
    elif fitting:
        progress = trainer.fit_loop.epoch_loop.val_loop.batch_progress
        kind = "sanity-check validation" if trainer.sanity_checking else "validation"
    else:
        progress, kind = trainer.validate_loop.batch_progress, "validation"
    return f"{kind} batch {progress.current.ready - 1}{epoch}"


def _loss_of(output: Any) -> Tensor | None:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict):
        loss = output.get("loss")
        return loss if isinstance(loss, Tensor) else None
    return None


class MicroBatchRunner:
    """Runs the batches of one step of one strategy as micro-batches (see the module docstring).

    Args:
        strategy: the host strategy; ``run`` gets its step (``training_step``, ...) as ``step``.
        sizes: this rank's micro-batch size decisions for that step.
        stage: the step: ``"training_step"`` or one of ``EVALUATION_STEPS`` (forward only).
    """

    def __init__(
        self, strategy: MicroBatchHost, sizes: MicroBatchSizes, stage: str = "training_step"
    ) -> None:
        if stage != "training_step" and stage not in EVALUATION_STEPS:
            raise ValueError(
                f"a micro-batch runner runs training_step or {', '.join(EVALUATION_STEPS)}, got {stage!r}"
            )
        self.strategy = strategy
        self.sizes = sizes
        self.stage = stage
        self.feature = f"micro_batch_size under {strategy.strategy_name}"  # what cuts, for errors
        self.training = stage == "training_step"
        self._metrics = PartMetrics()
        self._grads: BatchGradients | None = None
        self._phase = "forward"
        self._estimated = False
        self._whole_everywhere = False  # the last agreement: no rank cuts its next batch

    # ------------------------------------------------------------------ the batch
    def run(self, step: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``step(*args, **kwargs)`` on ``args[0]`` in micro-batches; returns the combined output."""
        module = self.strategy.lightning_module
        assert module is not None
        self._grads = None  # a batch whose loss was None never reached backward
        rows = split_rows(args[0], self.feature)
        if rows is None or (not self.sizes.auto and self.sizes.rows(rows) >= rows):
            return step(*args, **kwargs)  # nothing to split: the step as without micro-batching
        check_cuttable(args[0], rows, self.feature, module)  # now, not at an out-of-memory
        if self.training and self.sizes.auto and not self._estimated:
            self._estimated = True  # the estimate counts a training step: evaluation starts whole
            self._start_from_estimate(module, args[0], rows)
        trainer = module.trainer
        accumulate = trainer.accumulate_grad_batches if self.training else 1
        where = _where(trainer, self.stage)
        model = self.strategy.model
        ddp = isinstance(model, DistributedDataParallel)
        # mgpu_fsdp: passes gather parameters collectively, so every rank runs the same micro-batches
        lockstep = self.strategy.collective_passes
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        alone = self.stage == "predict_step" and lockstep is None  # see the module docstring
        agreement = Agreement(self._rank(), 1 if alone else world, self.strategy.root_device)
        syncing = isinstance(model, DistributedDataParallel) and model.require_backward_grad_sync
        grads = None
        if self.training:
            grads = BatchGradients(module, zeroing=trainer.fit_loop.epoch_loop.batch_idx % accumulate == 0)
        attempts: list[str] = []
        done: _Done | None = None
        while True:
            status = OK
            if done is None:
                parts = math.ceil(rows / self.sizes.rows(rows))
                # unless the last agreement said that every rank runs this batch whole (its first attempt)
                if lockstep is not None and not (self._whole_everywhere and not attempts):
                    parts = self._shared_parts(agreement, parts, rows, where)
                sizes = split_sizes(rows, parts)  # what runs: another rank may cut this one finer
                tried = max(sizes)
                watching: AbstractContextManager[None] = nullcontext()
                if lockstep is not None and self.sizes.auto:
                    watching = lockstep.watching(agreement, (self.stage, parts))
                try:
                    with watching:
                        done = self._attempt(module, step, args, kwargs, sizes, accumulate)
                except BaseException as err:
                    if not (self.sizes.auto and is_out_of_memory(err)):
                        self._metrics.forget()
                        raise
                    attempts.append(f"{counted(tried, 'row')} (out of memory in {self._phase})")
                    status = self._recover(tried, rows, where)
                if done is None:
                    self._drop(grads, lockstep)
            count = None if done is None else done.local_count()
            verdict = agreement.agree(status, count, cut=self.sizes.size is not None)
            self._whole_everywhere = not verdict.cut
            if FATAL in verdict.statuses.values():
                raise self._fatal(verdict.statuses, attempts, where)
            if all(s == OK for s in verdict.statuses.values()) and done is not None:
                break
            others = [rank for rank, s in verdict.statuses.items() if s != OK and rank != self._rank()]
            if others:
                log.debug("%s ran out of memory at %s: waiting for the rerun", ranks(others), where)
            if lockstep is not None and done is not None:
                done = None  # another rank failed after this one's last checkpoint: all run it again
                self._drop(grads, lockstep)
        # global_mean's value on a rank is its share of the mean over the ranks that took part
        factor = agreement.world if grads is None or ddp or lockstep is not None else 1
        scale = None if verdict.count is None else factor / verdict.count
        if grads is not None:
            grads.finish(scale, world if syncing else 1)
            self._grads = grads
        self.sizes.ran(rows, max(done.sizes))
        grown = self.sizes.succeeded()
        if grown is not None:
            log.info(
                "[rank %d] micro-batches grow to %s after clean batches", self._rank(), counted(grown, "row")
            )
        # each micro-batch's share of a global_mean loss: the weight its gradients got
        shares = None if scale is None else [c * scale for c in done.counts]
        return self._combine(module, done, shares)

    def _start_from_estimate(self, module: LightningModule, batch: Any, rows: int) -> None:
        """Where the device's memory is known, start ``"auto"`` at the size the estimate says fits."""
        self._metrics.begin(module)
        try:
            # the estimate's steps log nothing, update no metric
            with self._captured(module, LogCapture(), 0):
                start = estimated_start(self.strategy, module, batch, rows)
        finally:
            self._metrics.forget()
        if start is not None:
            self.sizes.start(start)

    def _shared_parts(self, agreement: Agreement, parts: int, rows: int, where: str) -> int:
        """The number of micro-batches every rank runs: the most any rank needs."""
        parts = agreement.most(parts)
        if parts > rows:
            raise ValueError(
                f"micro_batch_size: at {where} this rank has {counted(rows, 'row')} but another rank's batch"
                f" needs {parts} micro-batches, and under {self.strategy.strategy_name}"
                " every rank must run the same number. Give every rank batches of the same size (a"
                " DistributedSampler does, with drop_last=True for the last batch)."
            )
        return parts

    def _attempt(
        self,
        module: LightningModule,
        step: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        sizes: list[int],
        accumulate: int,
    ) -> _Done:
        rows = sum(sizes)
        device = self.strategy.root_device
        chunks = scatter_batch(args[0], sizes, [device] * len(sizes), self.feature, module)
        scaler = getattr(self.strategy.precision_plugin, "scaler", None)
        outputs, captures, counts = [], [], []
        self._metrics.begin(module)
        for index, (chunk, chunk_rows) in enumerate(zip(chunks, sizes, strict=True)):
            capture = LogCapture()
            captures.append(capture)
            seen = MicroCounts()
            with self.strategy.block_backward_sync():  # DDP's no_sync: the gradients are synced once
                self._phase = "forward"
                with self._captured(module, capture, index), micro_counts(seen):
                    output = step(chunk, *args[1:], **kwargs)
                loss = _loss_of(output)
                if len(seen.counts) > 1:
                    raise ValueError(
                        f"micro_batch_size: {self.stage} called global_mean more than once; under"
                        " micro-batching the step may hold one global_mean term"
                    )
                if loss is not None and self.training:
                    weight: float | Tensor = seen.counts[0] if seen.counts else chunk_rows / rows
                    scaled = loss * (weight / accumulate)
                    if scaler is not None:
                        scaled = scaler.scale(scaled)
                    self._phase = "backward"
                    module.backward(scaled)
                    del scaled, loss
            # a batch run again in small micro-batches can take long: the watchdog must see it move
            self.strategy.note_progress()
            counts.extend(seen.counts)
            outputs.append(apply_to_collection(output, Tensor, Tensor.detach))
            del output
        if counts and len(counts) != len(sizes):
            raise ValueError(
                "micro_batch_size: global_mean was called in some micro-batches of the batch but not in"
                f" others; call it once in every {self.stage}"
            )
        return _Done(outputs, captures, sizes, counts)

    @contextmanager
    def _captured(self, module: LightningModule, capture: LogCapture, index: int) -> Iterator[None]:
        self._metrics.put(module, index)
        module.__dict__["log"] = capture.log
        try:
            yield
        finally:
            module.__dict__.pop("log", None)
            self._metrics.put_back(module)

    # ------------------------------------------------------------------ out of memory
    def _rank(self) -> int:
        return self.strategy.global_rank

    def _drop(self, grads: BatchGradients | None, lockstep: CollectivePasses | None) -> None:
        """Free what an abandoned attempt held; under ``mgpu_fsdp`` reset its half-run pass too."""
        if grads is not None:
            grads.drop_attempt()
        self._metrics.forget()
        model = self.strategy.model
        if isinstance(model, DistributedDataParallel):
            # DDP broadcasts its buffers at the start of a forward that follows a synced one, and only a
            # forward that returns clears the flag: the ranks that succeeded cleared it, so the rerun
            # must not broadcast again (it would meet their all-reduce, and wait there for good)
            model.require_forward_param_sync = False
        if lockstep is not None:
            lockstep.reset()
        # the attempt's tensors went with its exception, by reference counting; a collection of the young
        # generations takes the cycles it made (a full one costs ~200 ms in a Lightning process, most of a
        # recovery), and a full one runs before the last size there is, micro-batches of one row
        gc.collect(1 if self.sizes.size is None or self.sizes.size > 1 else 2)
        if self.strategy.root_device.type == "cuda":
            torch.cuda.empty_cache()

    def _recover(self, tried: int, rows: int, where: str) -> int:
        if self.sizes.out_of_memory(tried) is None:
            return FATAL
        log.warning(
            "[rank %d] out of memory in %s at %s with micro-batches of %s: running the batch again"
            " in micro-batches of %s (%s on this rank; the global batch is unchanged)",
            self._rank(),
            self._phase,
            where,
            counted(tried, "row"),
            counted(self.sizes.rows(rows), "row"),
            counted(rows, "row"),
        )
        return RETRY

    def _fatal(self, statuses: dict[int, int], attempts: list[str], where: str) -> MicroBatchOutOfMemoryError:
        failed = [rank for rank, s in statuses.items() if s == FATAL]
        if self._rank() in failed:
            held = (
                "The model, its optimizer state and one sample"
                if self.training
                else "The model and one sample"
            )
            return MicroBatchOutOfMemoryError(
                f"[rank {self._rank()}] out of memory at {where} even with micro-batches of 1 row."
                f" Attempts on this rank: {'; '.join(attempts)}. {held}"
                " do not fit: free memory (lower precision, a smaller model, activation"
                " checkpointing) or shard the model (strategy='mgpu_fsdp')."
            )
        return MicroBatchOutOfMemoryError(
            f"[rank {self._rank()}] stopping: {ranks(failed)} ran out of memory at {where} even"
            " with micro-batches of 1 row; their error says what was tried"
        )

    # ------------------------------------------------------------------ after the batch
    def _combine(self, module: LightningModule, done: _Done, shares: list[Tensor] | None) -> Any:
        """The step's output, logs and metrics as the unsplit step leaves them.

        ``shares``: each micro-batch's weight in the batch's ``global_mean`` (its count, times the
        ranks' factor, over the global count), ``None`` when the step did not use it. The loss
        returned, and a ``global_mean`` value logged as it is, are then the sum of the micro-batches'
        values times their shares: the unsplit step's value (on each rank its share of the global
        mean, as ``global_mean`` returns it there); otherwise the mean by rows gives it.
        """
        originals = self._metrics.merge()
        replay_logs(module, done.captures, done.sizes, self.strategy.root_device, originals, shares)
        output = combine_outputs(done.outputs, done.sizes, self.strategy.root_device)
        losses = [loss for loss in map(_loss_of, done.outputs) if loss is not None]
        if shares is not None and len(losses) == len(shares):
            parts = zip(losses, shares, strict=True)
            loss = torch.stack([part * share.to(part) for part, share in parts]).sum()
            output = {**output, "loss": loss} if isinstance(output, dict) else loss
        return output

    def take_backward(self) -> bool:
        """Whether the last ``training_step`` ran its backward passes; if so, put its gradients back."""
        grads, self._grads = self._grads, None
        if grads is None:
            return False
        grads.restore()
        return True
