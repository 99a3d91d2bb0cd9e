"""FSDP's own collectives, watched: an out-of-memory on one rank never leaves another waiting in one.

Before each collective FSDP2 allocates a buffer of its own: the gathered parameters of a unit
before its all-gather, the gradients to reduce-scatter before that. Where torch lets a strategy
give FSDP its collectives (``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``),
``watch_buffers`` gives every unit FSDP's own, wrapped (a :class:`WatchedCollective` each):

- an out-of-memory allocating a buffer says which buffer (the unit, the collective, the bytes) and
  is raised as it is;
- right before the collective, ``before`` runs (under ``micro_batch_size="auto"``: the announcement
  of ``SyncPoints``, an all-reduce nothing waits for, see ``microbatch/agreement.py``);
- :meth:`WatchedCollective.shadow` runs the same collective with buffers of its own, on a rank that
  left its pass after an out-of-memory error, so that the ranks still in theirs do not wait in it;
- an out-of-memory inside the collective itself (gloo's own temporaries on CPU) leaves the other
  ranks inside it: it becomes ``CollectiveOutOfMemoryError``, which nothing retries, and the watchdog
  stops every rank within seconds, the error naming the collective.

Without ``"auto"`` an out-of-memory ends the run, and the watchdog stops the other ranks within
seconds. On a torch without these methods FSDP's collectives run as they are.

``SyncPoints``: FSDP2's passes under ``"auto"``, where an out-of-memory on one rank leaves no other
waiting in a collective.

Under ``mgpu_fsdp`` every unit gathers its parameters in its forward and again in its backward, and
reduce-scatters its gradients after its backward: collectives every rank must call in the same order. A
rank that runs out of memory while computing a unit stops calling them, and the others would wait in the
next one for good. With ``micro_batch_size="auto"``, ``SyncPoints`` makes each rank announce each of
FSDP's collectives right before it enters it, after FSDP allocated its buffers (``watch_buffers``
above): an all-reduce nothing waits for (``Agreement.announce``). A rank that ran out of memory leaves
its pass for ``Agreement.agree``, whose exchanges meet those announcements: it runs each collective
announced with buffers of its own (``WatchedCollective.shadow``) until the others reach the end of their
pass, where all learn that the attempt failed. Every rank then resets FSDP's per-pass state
(``FSDPModule.reset_iter_state``) and the batch runs again in smaller micro-batches.

Once an attempt of a kind (its stage and number of micro-batches) ran without an error, the next
ones of that kind announce nothing: every rank knows their collectives, in order, and a rank that
runs out of memory runs those of the pass it did not enter (``Agreement.leave``) before it meets the
others at the end. A step without an error then costs nothing but the agreement at its end. Should
the collectives of a kind ever change from one attempt to the next (every rank sees it at once), all
announce again from then on.

An out-of-memory allocating FSDP's buffers is recovered so too: leaving the pass frees what it held,
which the shadowed collective uses. One inside a collective (gloo's own temporaries) is not: the
other ranks are in it; it stops every rank within seconds, named (``CollectiveOutOfMemoryError``),
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
import math
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from lightning_mgpu._compat.torch import (
    FSDP_RESET_ITER_STATE,
    fsdp_comms,
    fsdp_param_groups,
    require,
    unsharded_param,
)
from lightning_mgpu.devices import format_bytes
from lightning_mgpu.oom import is_out_of_memory
from lightning_mgpu.strategies.microbatch.agreement import Agreement
from lightning_mgpu.strategies.process_group.errors import add_to_message

__all__ = [
    "DTYPES",
    "CollectiveOutOfMemoryError",
    "SyncPoints",
    "Watched",
    "WatchedCollective",
    "nothing_before",
    "watch_buffers",
]

log = logging.getLogger(__name__)

DTYPES = (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8, torch.int8, torch.int32,
    torch.int64, torch.float8_e4m3fn, torch.float8_e5m2,
)  # fmt: skip
"""The dtypes of the buffers a description can name (its index here)."""


class CollectiveOutOfMemoryError(Exception):
    """Out of memory inside one of FSDP's collectives, which the other ranks had entered: the run stops.

    Not an out-of-memory to ``is_out_of_memory``: micro-batching must not run the batch again while
    the other ranks wait in the collective. The out-of-memory is its ``__cause__``.
    """


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


Before = Callable[["WatchedCollective", torch.Tensor, torch.Tensor], None]
"""What runs right before a watched collective: the collective, its output and input buffers."""


def nothing_before(collective: WatchedCollective, output: torch.Tensor, input: torch.Tensor) -> None:
    """Nothing to do before the collective."""


class WatchedCollective:
    """FSDP's all-gather or reduce-scatter of one unit, its buffers and its call watched (see the module).

    Args:
        inner: FSDP's own collective.
        what: ``"all-gather of the parameters of unit 'layers.0'"``, for messages.
        index: Its place among the watched collectives of the model (the same on every rank).
        group: The process group FSDP runs it in, when known before the first call.
    """

    def __init__(self, inner: Any, what: str, index: int, group: dist.ProcessGroup | None) -> None:
        self.inner = inner
        self.what = what
        self.index = index
        self.group = group
        self.before: Before = nothing_before
        self.op: Any = None
        self.seconds = 0.0
        """Host seconds spent inside the collective's calls so far (``DeviceTimeMonitor`` reads the sum)."""

    @property
    def gathers(self) -> bool:
        return self.what.startswith("all-gather")

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        try:
            return self.inner.allocate(size, dtype=dtype, device=device)
        except BaseException as error:
            if is_out_of_memory(error):
                nbytes = format_bytes(math.prod(int(s) for s in size) * dtype.itemsize)
                line = f"[rank {_rank()}] out of memory allocating {nbytes} for mgpu_fsdp's {self.what}"
                log.warning("%s", line)
                add_to_message(error, line)
            raise

    def describe(self, output: torch.Tensor, input: torch.Tensor) -> list[int]:
        """The four numbers another rank needs to run this collective with this one (``shadow``)."""
        dtype = DTYPES.index(input.dtype) if input.dtype in DTYPES else -1
        return [self.index, input.numel(), output.numel(), dtype]

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        self.group = group
        if not self.gathers:
            self.op = kwargs.get("op", args[0] if args else None)
        self.before(self, output_tensor, input_tensor)  # every buffer is allocated: the ranks may meet
        start = time.perf_counter()
        try:
            return self.inner(output_tensor, input_tensor, group, *args, **kwargs)
        except BaseException as error:
            if not is_out_of_memory(error):
                raise
            first = (str(error).strip().splitlines() or [""])[0]
            raise CollectiveOutOfMemoryError(
                f"[rank {_rank()}] out of memory inside mgpu_fsdp's {self.what}, which the other ranks had"
                f" entered, so the batch cannot run again in smaller micro-batches ({first}). FSDP's buffers"
                " grow with its units, not with the batch: shard smaller units"
                " (MGPUFSDPStrategy(block_classes=[...])), gather in bfloat16 (precision='bf16-mixed'), or"
                " leave room for them (a smaller batch or micro_batch_size)"
            ) from error
        finally:
            self.seconds += time.perf_counter() - start

    def shadow(self, input_numel: int, output_numel: int, dtype: torch.dtype, device: torch.device) -> None:
        """Run this collective with buffers of this rank's own, whose values nobody reads."""
        if self.group is None:
            raise RuntimeError(f"mgpu_fsdp cannot run its {self.what} without its process group")
        if self.gathers:  # in place, as FSDP gathers: this rank's input is its slice of the output
            output = torch.empty(output_numel, dtype=dtype, device=device)
            rank = dist.get_rank(self.group)
            self.inner(
                output, output[rank * input_numel : (rank + 1) * input_numel], self.group, async_op=False
            )
            return
        op = self.op if self.op is not None else dist.ReduceOp.SUM
        input = torch.zeros(input_numel, dtype=dtype, device=device)
        self.inner(
            torch.empty(output_numel, dtype=dtype, device=device), input, self.group, op=op, async_op=False
        )


def _unit_name(name: str) -> str:
    return f"unit {name!r}" if name else "the root unit"  # named_modules' name of the root is ""


class Watched(NamedTuple):
    """What ``watch_buffers`` did: the collectives it watches, and the units whose collectives it cannot."""

    collectives: list[WatchedCollective]
    """Every unit's all-gather and reduce-scatter, in the model's order (``WatchedCollective.index``)."""
    unwatched: int
    """Units that gather parameters but whose collectives torch does not let a strategy give (an older
    torch, a unit with several parameter groups)."""


def watch_buffers(root: nn.Module, before: Before | None = None) -> Watched:
    """Give every FSDP unit of ``root`` FSDP's own collectives, watched; ``before`` runs before each one.

    Called again, it keeps the units' watched collectives; a ``before`` replaces theirs (``None`` keeps
    it: none at first). ``SyncPoints`` gives its announcement while it exists.
    """
    collectives: list[WatchedCollective] = []
    unwatched = 0
    for name, unit in root.named_modules():
        if not isinstance(unit, FSDPModule):
            continue
        set_gather = getattr(unit, "set_custom_all_gather", None)
        set_reduce = getattr(unit, "set_custom_reduce_scatter", None)
        if set_gather is None or set_reduce is None:
            unwatched += 1
            continue
        groups = fsdp_param_groups(unit)
        if len(groups) != 1:
            unwatched += len(groups) > 1  # none: nothing to gather; several: a grouping set_custom_* refuses
            continue
        mine: list[WatchedCollective] = []
        for (comm, known), setter, what in zip(
            fsdp_comms(groups[0]),
            (set_gather, set_reduce),
            ("all-gather of the parameters", "reduce-scatter of the gradients"),
            strict=False,
        ):
            if not isinstance(comm, WatchedCollective):
                comm = WatchedCollective(comm, f"{what} of {_unit_name(name)}", 0, known)
                setter(comm)
            mine.append(comm)
        if len(mine) != 2:
            unwatched += 1
            continue
        for comm in mine:
            comm.index = len(collectives)
            comm.before = before or comm.before
            collectives.append(comm)
    log.debug("FSDP's collectives watched on %d unit(s), not on %d", len(collectives) // 2, unwatched)
    return Watched(collectives, unwatched)


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
