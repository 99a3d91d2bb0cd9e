"""FSDP2's passes under ``"auto"``: an out-of-memory on one rank leaves no other waiting in a collective.

Under ``mgpu_fsdp`` every unit gathers its parameters in its forward and again in its backward,
and reduce-scatters its gradients after its backward: collectives every rank must call in the
same order. A rank that runs out of memory while computing a unit stops calling them, and the
others would wait in the next one for good. With ``micro_batch_size="auto"``, ``SyncPoints``
makes each rank announce each of FSDP's collectives right before it enters it, after FSDP allocated
its buffers (``buffers.py``, where torch lets a strategy give FSDP its collectives): an all-reduce
nothing waits for (``Agreement.announce``). A rank that ran out of memory leaves its pass for
``Agreement.agree``, whose exchanges meet those announcements: it runs each collective announced with
buffers of its own (``WatchedCollective.shadow``) until the others reach the end of their pass, where
all learn that the attempt failed. Every rank then resets FSDP's per-pass state
(``FSDPModule.reset_iter_state``) and the batch runs again in smaller micro-batches.

Once an attempt of a kind (its stage and number of micro-batches) ran without an error, the next
ones of that kind announce nothing: every rank knows their collectives, in order, and a rank that
runs out of memory runs those of the pass it did not enter (``Agreement.leave``) before it meets the
others at the end. A step without an error then costs nothing but the agreement at its end. Should
the collectives of a kind ever change from one attempt to the next (every rank sees it at once), all
announce again from then on.

An out-of-memory allocating FSDP's buffers is recovered so too: leaving the pass frees what it held,
which the shadowed collective uses. One inside a collective (gloo's own temporaries) is not: the
other ranks are in it; it stops every rank within seconds, named (``buffers.CollectiveOutOfMemoryError``),
as does a shadowed collective that finds no memory either.

Where a unit's collectives cannot be given (a torch without ``set_custom_all_gather``, a unit with
several parameter groups), hooks on every unit put checkpoints, where every rank waits for the others
(``Agreement.checkpoint``), where the passes reach those collectives:

- before each unit's forward (before its parameters are gathered);
- in backward, where the gradient reaches a unit's output (before FSDP gathers it again) and
  where it leaves the unit's input (before the unit's gradients are reduce-scattered);
- at the end of the backward, before the root unit's gradients are reduce-scattered.

The rank that failed meets the others at their next checkpoint, where they abandon the pass. An
out-of-memory in FSDP's buffers on a torch that cannot take custom collectives stops every rank,
possibly only after ``stall_timeout``. ``FSDPModule.reset_iter_state`` is in torch from 2.13: on an
older torch ``micro_batch_size="auto"`` under ``mgpu_fsdp`` is refused at the first step, naming the
version.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle

from lightning_mgpu._compat.torch import (
    FSDP_RESET_ITER_STATE,
    fsdp_param_groups,
    queue_backward_callback,
    require,
    unsharded_param,
)
from lightning_mgpu.strategies.fsdp.buffers import DTYPES, WatchedCollective, nothing_before, watch_buffers
from lightning_mgpu.strategies.microbatch.agreement import Agreement

__all__ = ["SyncPoints"]

log = logging.getLogger(__name__)


class _BackwardCheckpoint(torch.autograd.Function):
    """Identity in forward; runs ``check`` when the gradient passes in backward."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, check: Callable[[], None]) -> Tensor:
        ctx.check = check
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        ctx.check()
        return grad, None


class SyncPoints:
    """The checkpoints of one sharded model; inactive (no cost but a flag test) unless ``watching``.

    Args:
        root: The root FSDP module (the LightningModule ``mgpu_fsdp`` sharded).
    """

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self._agreement: Agreement | None = None
        self._handles: list[RemovableHandle] = []
        self._seen: list[list[int]] = []  # the collectives this attempt entered, described
        self._learned: dict[Hashable, list[list[int]]] = {}
        self._candidate: tuple[Hashable, list[list[int]]] | None = None
        self._repeats = True
        self._announcing = True
        units = [m for m in root.modules() if isinstance(m, FSDPModule)]
        watched = watch_buffers(root, self._before)
        self._collectives = watched.collectives
        # no unit watched: this torch cannot take custom collectives (said once, under "auto")
        self._buffers_unwatched = not watched.collectives and watched.unwatched > 0
        if watched.unwatched == 0:
            # an announcement right before each of FSDP's collectives is all it takes: no hooks on the units
            log.debug("announcements before the %d collectives of the FSDP units", len(watched.collectives))
            return
        for unit in units:
            self._handles += [
                # before FSDP's own pre-forward (its gather): prepend
                unit.register_forward_pre_hook(self._before_forward, prepend=True),
                # after FSDP's pre-forward: the inputs it wrapped for its reduce-scatter
                unit.register_forward_pre_hook(self._wrap_inputs, with_kwargs=True),
                # after FSDP's post-forward: the outputs it hooked for its backward gather
                unit.register_forward_hook(self._wrap_outputs),
            ]
        log.debug("checkpoints around %d FSDP units: %s", len(units), watched)

    @contextmanager
    def watching(self, agreement: Agreement, kind: Hashable = None) -> Iterator[None]:
        """Announcements (or checkpoints) active for one attempt of ``kind`` (its stage and number of
        micro-batches): an attempt of a kind that ran before without an error, whose collectives
        repeat, announces nothing, its collectives being known (module docstring)."""
        if not isinstance(self.root, FSDPModule):
            raise ValueError(
                f"micro_batch_size='auto' under mgpu_fsdp needs the LightningModule itself sharded, so that a"
                f" pass abandoned after an out-of-memory can be reset, but {type(self.root).__name__}'s"
                " configure_model shards only parts of it: end configure_model with fully_shard(self), or"
                " use a fixed micro_batch_size"
            )
        require(FSDP_RESET_ITER_STATE)  # refused at the first step, not after the first out-of-memory
        if self._buffers_unwatched:
            self._buffers_unwatched = False
            rank_zero_warn(
                f"micro_batch_size='auto' under mgpu_fsdp: this torch ({torch.__version__}) cannot give FSDP"
                " its collectives (FSDPModule.set_custom_all_gather), so an out-of-memory in FSDP's own"
                " all-gather or reduce-scatter buffers is not recovered: it ends the run, possibly only"
                " after stall_timeout, the other ranks being in the collective. A newer torch recovers it."
            )
        if self._candidate is not None:  # the last attempt succeeded: nothing reset it
            self._learn(*self._candidate)
        known = self._learned.get(kind) if self._repeats and not self._handles else None
        self._announcing, self._seen = known is None, []
        self._agreement = agreement
        agreement.shadow = functools.partial(self._shadow, agreement.device)
        agreement.leave = None if known is None else functools.partial(self._leave, agreement.device, known)
        try:
            yield
        finally:
            self._agreement = None
            self._candidate = (kind, self._seen)

    def reset(self) -> None:
        """FSDP's per-pass state reset after a pass was abandoned (``FSDPModule.reset_iter_state``)."""
        require(FSDP_RESET_ITER_STATE)
        assert isinstance(self.root, FSDPModule)  # watching() refused any other root
        self.root.reset_iter_state()
        self._candidate = None  # an abandoned attempt teaches nothing
        # reset_iter_state leaves the gradients autograd already wrote to the gathered parameters:
        # they would be added to the next attempt's, so they are dropped here
        dropped = 0
        for module in self.root.modules():
            if not isinstance(module, FSDPModule):
                continue
            for group in fsdp_param_groups(module):
                for param in group.fsdp_params:
                    unsharded = unsharded_param(param)
                    if unsharded is not None and unsharded.grad is not None:
                        unsharded.grad = None
                        dropped += 1
                    if getattr(param, "unsharded_accumulated_grad", None) is not None:
                        param.unsharded_accumulated_grad = None
        log.debug("pass reset; %d gathered gradients of the abandoned attempt dropped", dropped)

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        watch_buffers(self.root, nothing_before)

    # ------------------------------------------------------------------ hooks
    def check(self) -> None:
        """A checkpoint while ``watching``, else nothing (``buffers.py`` runs one before each collective)."""
        if self._agreement is not None:
            self._agreement.checkpoint()

    def _before(self, collective: WatchedCollective, output: Tensor, input: Tensor) -> None:
        """Before one of FSDP's collectives, while ``watching``: note it, and say which one, without
        waiting, unless the attempt's collectives are known."""
        if self._agreement is None:
            return
        description = collective.describe(output, input)
        self._seen.append(description)
        if self._announcing:
            self._agreement.announce(description)

    def _learn(self, kind: Hashable, seen: list[list[int]]) -> None:
        """An attempt of ``kind`` succeeded having entered ``seen``: its known collectives, if they repeat."""
        known = self._learned.setdefault(kind, seen)
        if known != seen:
            self._repeats = False  # every rank sees it at the same attempt: all announce from now on
            log.debug(
                "the collectives of %s changed (%d, then %d): announced from now on",
                kind,
                len(known),
                len(seen),
            )

    def _leave(self, device: torch.device, known: list[list[int]]) -> None:
        """This rank left a pass whose collectives are known: run the ones it did not enter."""
        left = known[len(self._seen) :]
        log.debug("running the %d collectives of the pass this rank left", len(left))
        for description in left:
            self._shadow(device, description)

    def _shadow(self, device: torch.device, description: Sequence[int]) -> None:
        """Run the collective the ranks still in their pass announced, on this rank that left its pass."""
        index, input_numel, output_numel, dtype = description
        if not 0 <= index < len(self._collectives) or not 0 <= dtype < len(DTYPES):
            raise RuntimeError(f"mgpu_fsdp cannot run the collective announced as {list(description)}")
        self._collectives[index].shadow(input_numel, output_numel, DTYPES[dtype], device)

    def _check_then_final(self) -> None:
        """The backward checkpoint of the root's output: also one at the end of the backward."""
        self.check()
        if self._agreement is not None:
            queue_backward_callback(self.check)

    def _wrap(self, value: Any, check: Callable[[], None]) -> Any:
        def wrap(tensor: Tensor) -> Tensor:
            if not tensor.requires_grad or not torch.is_grad_enabled():
                return tensor
            return _BackwardCheckpoint.apply(tensor, check)

        return apply_to_collection(value, Tensor, wrap)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        self.check()

    def _wrap_inputs(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if self._agreement is None:
            return None
        return self._wrap(args, self.check), self._wrap(kwargs, self.check)

    def _wrap_outputs(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self._agreement is None:
            return None
        return self._wrap(output, self._check_then_final if module is self.root else self.check)
