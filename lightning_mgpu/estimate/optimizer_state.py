"""Optimizer state, one counter: for ``estimate_memory``, ``mgpu_auto`` and a step that runs out of memory.

- ``meta_like``: a meta tensor of a parameter's shape, in the dtype measured (a ``DTensor`` by its global
  shape); ``quiet_lightning``: Lightning's warnings about a module without a Trainer silenced;
- ``module_optimizers``: the optimizers a module's ``configure_optimizers()`` returns (or the one given);
- ``copy_optimizer``: the same optimizer, with the same settings, over copies of its parameters;
- ``state_bytes``: the bytes of the state tensors optimizers hold on a device, each storage once,
  scalars (step counters) left out: what ``estimate_memory`` reports after its measured steps;
- ``count_optimizer_state``: the state one optimizer step creates, without a batch or a forward:
  the optimizer is copied over meta tensors of its parameters' shapes (nothing is allocated), given
  zero gradients and stepped once, and ``state_bytes`` counts what it made; a second step measures the
  temporaries a step allocates beside the state (``LiveBytes``), as ``estimate_memory``'s steps do.
  Where that step cannot run (an optimizer that reads values: a norm, ``.item()``), it steps once over
  one-element CPU copies instead, and each state tensor of a parameter's shape counts at that
  parameter's size: its known state per parameter.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_mgpu._compat.torch import tree_flatten
from lightning_mgpu.estimate.batch import tensors
from lightning_mgpu.estimate.live_bytes import LiveBytes, unique_bytes

__all__ = [
    "OptimizerState",
    "copy_optimizer",
    "count_optimizer_state",
    "meta_like",
    "module_optimizers",
    "quiet_lightning",
    "state_bytes",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OptimizerState:
    """Bytes of optimizer state, and how they were counted.

    Attributes:
        bytes: The state's tensors, scalars left out.
        optimizer: The optimizers' class names (``"AdamW"``); empty when there is none.
        note: How the bytes were found when not measured, or why they are not counted; empty when measured.
        step_temporaries: The most a step after the first allocates for a moment beside the state
            (``foreach``'s intermediate lists, measured on meta tensors); 0 when not measured.
    """

    bytes: int
    optimizer: str = ""
    note: str = ""
    step_temporaries: int = 0

    @property
    def counted(self) -> bool:
        """Whether an optimizer was found and its state counted (measured or from the known table)."""
        return bool(self.optimizer) and not self.note.startswith("not counted")


def meta_like(t: torch.Tensor, dtype: torch.dtype | None, local: bool = False) -> torch.Tensor:
    """A meta tensor of ``t``'s shape, in ``dtype`` if ``t`` is floating-point: a sharded ``DTensor`` by its
    global shape, or by this rank's shard with ``local``."""
    if local and hasattr(t, "to_local"):
        t = t.to_local()
    dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
    return torch.empty(t.shape, dtype=dtype, device="meta").requires_grad_(t.requires_grad)


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Silence Lightning's warnings about a module used without a Trainer, which measuring does on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*self\.trainer.*")
        warnings.filterwarnings("ignore", message=r".*configure_optimizers.*")
        yield


def module_optimizers(
    module: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> list[torch.optim.Optimizer]:
    """``[optimizer]``, else the optimizers of ``module.configure_optimizers()`` (none without that method).

    Raises:
        TypeError: if ``optimizer`` is not a ``torch.optim.Optimizer``.
        ValueError: if ``configure_optimizers()`` fails outside a Trainer, with its error.
    """
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        return [optimizer]
    configure = getattr(module, "configure_optimizers", None)
    if configure is None:
        return []
    try:
        with quiet_lightning():
            conf = configure()
    except Exception as err:
        raise ValueError(
            f"{type(module).__name__}.configure_optimizers() failed outside a Trainer"
            f" ({type(err).__name__}: {err}); pass optimizer=..."
        ) from err
    # every optimizer in what it returns (one, a list, a dict with "optimizer", a tuple with schedulers), once
    found = (o for o in tree_flatten(conf)[0] if isinstance(o, torch.optim.Optimizer))
    return list(dict.fromkeys(found))


def copy_optimizer(opt: torch.optim.Optimizer, leaf_of: Mapping[int, torch.Tensor]) -> torch.optim.Optimizer:
    """``opt``'s class and settings over ``leaf_of[id(p)]`` for each of its parameters ``p``.

    Fused kernels are turned off (they update in place without temporaries, and run on few devices),
    and ``foreach=None`` becomes ``True``, the default on CUDA, whose temporaries are what is predicted.

    Raises:
        ValueError: if ``opt`` holds a tensor missing from ``leaf_of``, or cannot be rebuilt.
    """

    def measuring(options: dict[str, Any]) -> dict[str, Any]:
        options = dict(options)
        if options.get("fused"):
            options.update(fused=False, foreach=False)
        elif "foreach" in options and options["foreach"] is None:
            options["foreach"] = True
        return options

    groups = []
    for group in opt.param_groups:
        new = measuring({k: v for k, v in group.items() if k != "params"})
        try:
            new["params"] = [leaf_of[id(p)] for p in group["params"]]
        except KeyError:
            raise ValueError(
                f"the {type(opt).__name__} optimizer holds a tensor that is not a parameter of the module"
            ) from None
        groups.append(new)
    for kwargs in (measuring(opt.defaults), {}):
        with contextlib.suppress(TypeError):
            return type(opt)(groups, **kwargs)
    raise ValueError(f"cannot rebuild {type(opt).__name__} from its param_groups to measure its state")


def state_bytes(optimizers: list[torch.optim.Optimizer], device: torch.device) -> int:
    """Bytes of the state tensors ``optimizers`` hold on ``device``, each storage once, scalars left out.

    Scalar step counters are left out: they usually live on the CPU, and weigh nothing beside the rest.
    """
    state = [t for o in optimizers for s in o.state.values() for t in tensors(s) if t.device == device]
    return unique_bytes(state, min_dim=1)


def _stepped_once(opt: torch.optim.Optimizer, leaf_of: dict[int, torch.Tensor]) -> torch.optim.Optimizer:
    """A copy of ``opt`` over ``leaf_of``'s tensors, stepped once with zero gradients (sparse ones for an
    optimizer that takes only those, such as ``SparseAdam``)."""
    copy = copy_optimizer(opt, leaf_of)
    leaves = [leaf for leaf in leaf_of.values() if leaf.requires_grad]
    for leaf in leaves:
        leaf.grad = torch.zeros_like(leaf)
    try:
        copy.step()
    except RuntimeError as err:
        if "dense gradients" not in str(err) or leaves[0].device.type == "meta":
            raise
        for leaf in leaves:
            leaf.grad = torch.zeros_like(leaf).to_sparse()
        copy.step()
    return copy


def _meta_leaves(
    opt: torch.optim.Optimizer, dtype: torch.dtype | None, local: bool
) -> dict[int, torch.Tensor]:
    """A meta tensor of each of ``opt``'s parameters' shapes, by the parameter's ``id``."""
    return {id(p): meta_like(p, dtype, local) for group in opt.param_groups for p in group["params"]}


def _stepped_on_meta(opt: torch.optim.Optimizer, dtype: torch.dtype | None, local: bool) -> tuple[int, int]:
    """The state one step creates, and the peak of what a later step allocates beside it (temporaries)."""
    leaf_of = _meta_leaves(opt, dtype, local)
    copy = _stepped_once(opt, leaf_of)
    # the second step, as every step after the first: what it allocates beyond the tensors that exist
    # (tracked first, so an in-place update is not taken for a new tensor), as estimate_memory counts it
    tracker = LiveBytes(torch.device("meta"))
    leaves = list(leaf_of.values())
    tracker.track_all(leaves + [leaf.grad for leaf in leaves if leaf.grad is not None])
    tracker.track_all([t for s in copy.state.values() for t in tensors(s)])
    before = tracker.live
    with tracker, tracker.phase() as later:
        copy.step()
    return state_bytes([copy], torch.device("meta")), later["peak"] - before


_PROBE = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # a size of its own for each dimension


def _per_parameter(opt: torch.optim.Optimizer, dtype: torch.dtype | None, local: bool) -> int:
    """The state one step over small CPU copies of the parameters creates, scaled to the parameters' sizes.

    Each copy has a size of its own in each dimension (2 x 3 for a matrix), so a state tensor's sizes say
    which of its parameter's dimensions it keeps: a moment of the parameter's shape counts as the whole
    parameter, a factored statistic (Adafactor's 2 x 1 rows, 1 x 3 columns) as the dimensions it keeps,
    a size of 1 as 1.
    """
    shapes = _meta_leaves(opt, dtype, local)
    small = {}
    for i, meta in shapes.items():
        small[i] = torch.zeros(_PROBE[: meta.dim()], dtype=meta.dtype).requires_grad_(meta.requires_grad)
    state = _stepped_once(opt, small).state
    total = 0
    for i, leaf in small.items():
        real = dict(zip(_PROBE, shapes[i].shape, strict=False))  # a probe size -> the parameter's own size
        for t in tensors(state.get(leaf, {})):
            if t.dim() > 0:
                total += math.prod(real.get(size, size) for size in t.shape) * t.element_size()
    return total


def count_optimizer_state(
    module: nn.Module,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    optimizers: list[torch.optim.Optimizer] | None = None,
    param_dtype: torch.dtype | None = None,
    local: bool = False,
) -> OptimizerState:
    """The optimizer state one step creates for ``module``'s parameters: the count of ``estimate_memory``.

    - the optimizers are ``optimizers``, else ``[optimizer]``, else what ``module.configure_optimizers()``
      returns; one that fails to build is reported in ``note``, its state not counted;
    - each is copied over meta tensors of its parameters' shapes, in ``param_dtype`` for floating-point
      ones (a converting precision: ``bf16-true`` keeps the state in bfloat16 too), stepped once with
      zero gradients, and its state counted by ``state_bytes``; stepped again, what that step allocates
      beside the state is its ``step_temporaries``;
    - where that step fails, the state a step over small CPU copies creates, scaled to the parameters' sizes.

    Args:
        module: The model (meta parameters count by their shape).
        optimizer: An optimizer over ``module``'s parameters, instead of ``configure_optimizers()``.
        optimizers: The optimizers a run already built (the Trainer's), instead of either.
        param_dtype: The dtype floating-point parameters will be kept in; ``None`` for their own.
        local: Count a sharded parameter (a ``DTensor``) by this rank's shard, not its global shape.

    Example::

        import torch
        from torch import nn

        model = nn.Linear(256, 256, bias=False)  # 256 KiB of float32 weights
        optimizer = torch.optim.AdamW(model.parameters())
        count_optimizer_state(model, optimizer=optimizer).bytes  # 524288: two moments
    """
    if optimizers is None:
        try:
            optimizers = module_optimizers(module, optimizer)
        except ValueError as err:
            return OptimizerState(0, note=f"not counted: {err}")
    if not optimizers:
        if getattr(module, "configure_optimizers", None) is None:
            return OptimizerState(
                0, note="not counted: no optimizer given, and the model has no configure_optimizers"
            )
        return OptimizerState(0, note="not counted: configure_optimizers() returns no optimizer")
    names = ", ".join(type(o).__name__ for o in optimizers)
    total, temporaries, notes = 0, 0, []
    for opt in optimizers:
        name = type(opt).__name__
        try:
            state, step = _stepped_on_meta(opt, param_dtype, local)
            total, temporaries = total + state, max(temporaries, step)  # the optimizers step in turn
            continue
        except Exception as err:  # an optimizer that reads values, wants a closure, sparse gradients, ...
            log.debug("%s cannot step on meta tensors (%s: %s)", name, type(err).__name__, err)
        try:
            total += _per_parameter(opt, param_dtype, local)
            notes.append(f"{name}'s known state per parameter: it cannot step on meta tensors")
        except Exception as err:  # a closure, sparse gradients, ...
            log.debug("%s cannot step on CPU copies either (%s: %s)", name, type(err).__name__, err)
            notes.append(f"not counted: {name} cannot step on meta tensors and its state is not known")
    return OptimizerState(total, names, "; ".join(notes), temporaries)
