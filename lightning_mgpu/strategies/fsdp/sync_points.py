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

Every unit's collectives must be watched: a unit whose collectives torch does not let a strategy give
(several parameter groups, from ``fully_shard``'s ``shard_placement_fn`` with per-parameter meshes) is
refused at the first step. ``FSDPModule.reset_iter_state`` is in torch from 2.13 (where every unit of one
parameter group can take custom collectives): on an older torch ``micro_batch_size="auto"`` under
``mgpu_fsdp`` is refused at the first step, naming the version.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from lightning_mgpu._compat.torch import FSDP_RESET_ITER_STATE, fsdp_param_groups, require, unsharded_param
from lightning_mgpu.strategies.fsdp.buffers import DTYPES, WatchedCollective, nothing_before, watch_buffers
from lightning_mgpu.strategies.microbatch.agreement import Agreement

__all__ = ["SyncPoints"]

log = logging.getLogger(__name__)


class SyncPoints:
    """The announcements of one sharded model's collectives; inactive (costing a test) unless ``watching``.

    Args:
        root: The root FSDP module (the LightningModule ``mgpu_fsdp`` sharded).
    """

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self._agreement: Agreement | None = None
        self._seen: list[list[int]] = []  # the collectives this attempt entered, described
        self._learned: dict[Hashable, list[list[int]]] = {}
        self._candidate: tuple[Hashable, list[list[int]]] | None = None
        self._repeats = True
        self._announcing = True
        watched = watch_buffers(root, self._before)
        self._collectives = watched.collectives
        self._unwatched = watched.unwatched
        log.debug("announcements before the %d collectives of the FSDP units", len(watched.collectives))

    @contextmanager
    def watching(self, agreement: Agreement, kind: Hashable = None) -> Iterator[None]:
        """Announcements active for one attempt of ``kind`` (its stage and number of
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
        if self._unwatched:
            raise ValueError(
                f"micro_batch_size='auto' under mgpu_fsdp watches the collectives of every FSDP unit, but"
                f" {self._unwatched} unit(s) hold several parameter groups (fully_shard's shard_placement_fn"
                " with per-parameter meshes), whose collectives torch lets no strategy watch: shard each unit"
                " over one mesh, or use a fixed micro_batch_size"
            )
        if self._candidate is not None:  # the last attempt succeeded: nothing reset it
            self._learn(*self._candidate)
        known = self._learned.get(kind) if self._repeats else None
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
        """Stop announcing: FSDP's collectives run with nothing before them again."""
        watch_buffers(self.root, nothing_before)

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
