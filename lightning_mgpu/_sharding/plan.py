"""Which submodules ``mgpu_fsdp`` shards as units of their own: a pure function of the module tree.

FSDP2 gathers the parameters of one ``fully_shard``-ed unit at a time, so the peak memory of
a step is the sharded model state plus the largest unit. The units are the model's repeated
blocks, and the root holds whatever is left (embeddings, heads, norms).

The automatic policy (``find_blocks``), walking the tree from the root, outermost first:

1. In an ``nn.ModuleList`` or ``nn.Sequential``, the children that hold parameters are blocks
   when there are at least two and all have the same class: transformer blocks
   (``blocks = nn.ModuleList(Block() for _ in range(n))``), the residual blocks of a ResNet
   stage (``layer1 = nn.Sequential(BasicBlock(), BasicBlock())``), the layers of an MLP
   (``nn.Sequential(nn.Linear, nn.ReLU, nn.Linear)``: the ReLU holds nothing).
2. Among the direct children of any other module, those of a class defined outside
   ``torch.nn`` that appears at least twice with parameters are blocks: stages held as
   attributes (``self.stage1 = Stage(...)``, ``self.stage2 = Stage(...)``).
3. A block is not searched further; every other child is.

``block_classes=`` replaces the policy: every outermost submodule of one of those classes
(given as classes, or as class names, plain or dotted) is a block. The root is always the
last unit and is never listed as a block.

``mgpu_fsdp`` shards by it (``strategies/fsdp/sharding.py``); the estimate predicts ``mgpu_fsdp``'s
memory from the same units.
"""

from __future__ import annotations

import difflib
import logging
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from torch import nn

__all__ = ["ShardingPlan", "find_blocks", "plan_sharding", "validate_block_classes"]

log = logging.getLogger(__name__)

BlockClasses = Sequence[str | type[nn.Module]]


@dataclass(frozen=True)
class ShardingPlan:
    """The submodules sharded as units of their own, and how they were chosen.

    Attributes:
        blocks: Dotted names of the blocks (``"blocks.0"``), in module order; the root
            (``""``) is sharded last and is not listed.
        chosen_by: ``"block_classes"`` or ``"automatic policy"``.
    """

    blocks: tuple[str, ...]
    chosen_by: str

    @property
    def units(self) -> int:
        """Number of ``fully_shard`` calls: one per block, plus the root."""
        return len(self.blocks) + 1

    def describe(self, limit: int = 4) -> str:
        """``"3 units: net.0, net.2 and the root"``, listing at most ``limit`` blocks."""
        names = list(self.blocks[:limit])
        if len(self.blocks) > limit:
            names.append(f"{len(self.blocks) - limit} more")
        listed = f"{', '.join(names)} and the root" if names else "the root"
        return f"{self.units} unit(s): {listed}"


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _user_class(module: nn.Module) -> bool:
    return not type(module).__module__.startswith("torch.nn.")


def _repeated_children(module: nn.Module) -> list[str]:
    """Names of ``module``'s direct children that are blocks by rules 1 and 2 of the policy."""
    children = [(name, child) for name, child in module.named_children() if _holds_parameters(child)]
    if isinstance(module, (nn.ModuleList, nn.Sequential)):
        classes = {type(child) for _, child in children}
        return [name for name, _ in children] if len(children) >= 2 and len(classes) == 1 else []
    counts = Counter(type(child) for _, child in children)
    return [name for name, child in children if _user_class(child) and counts[type(child)] >= 2]


def find_blocks(module: nn.Module) -> list[str]:
    """The repeated blocks of ``module`` by the automatic policy of this module's docstring.

    Args:
        module: The model (its root is never a block).

    Returns:
        Dotted names of the outermost blocks, in module order; empty when nothing repeats.
    """
    return _outermost(module, lambda parent: set(_repeated_children(parent)))


def _outermost(module: nn.Module, blocks_among: Callable[[nn.Module], Collection[str]]) -> list[str]:
    """Dotted names of the blocks, in module order: the children ``blocks_among(parent)`` names, from the
    root down, a block's own children never searched."""
    blocks: list[str] = []

    def visit(current: nn.Module, prefix: str) -> None:
        chosen = blocks_among(current)
        for name, child in current.named_children():
            if name in chosen:
                blocks.append(f"{prefix}{name}")
            else:
                visit(child, f"{prefix}{name}.")

    visit(module, "")
    return blocks


def validate_block_classes(block_classes: object) -> tuple[str | type[nn.Module], ...] | None:
    """``block_classes`` as a tuple of classes and names, or ``None``; a clear error for anything else.

    Raises:
        TypeError: If it is not a class, a name, or a sequence of them.
        ValueError: If it is an empty sequence.
    """
    if block_classes is None:
        return None
    items = (block_classes,) if isinstance(block_classes, (str, type)) else block_classes
    if not isinstance(items, Iterable):
        raise TypeError(
            "block_classes must be a module class, a class name, or a list of them"
            f" (e.g. block_classes=[Block] or ['Block']), got {block_classes!r}"
        )
    items = tuple(items)
    if not items:
        raise ValueError(
            "block_classes is empty: name at least one class, or leave it out (automatic policy)"
        )
    for item in items:
        if not (isinstance(item, str) or (isinstance(item, type) and issubclass(item, nn.Module))):
            raise TypeError(
                "block_classes takes nn.Module subclasses or their names,"
                f" got {item!r} of type {type(item).__name__}"
            )
    return items


def _matches(module: nn.Module, wanted: Sequence[str | type[nn.Module]]) -> bool:
    cls = type(module)
    names = (cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}")
    return any(isinstance(module, item) if isinstance(item, type) else item in names for item in wanted)


def _missing_classes_message(module: nn.Module, wanted: Sequence[str | type[nn.Module]]) -> str:
    containers = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
    present = sorted(
        {type(m).__name__ for m in module.modules() if _holds_parameters(m) and not isinstance(m, containers)}
        - {type(module).__name__}
    )
    names = [item if isinstance(item, str) else item.__name__ for item in wanted]
    hints = {
        hint for name in names for hint in difflib.get_close_matches(name.rsplit(".", 1)[-1], present, n=1)
    }
    message = (
        f"block_classes={names} matches no submodule of {type(module).__name__}; its submodules with"
        f" parameters are of the classes {', '.join(present)}."
    )
    if hints:
        message += f" Did you mean {' or '.join(repr(h) for h in sorted(hints))}?"
    return message + " Name one of them, or leave block_classes out to use the automatic policy."


def plan_sharding(module: nn.Module, block_classes: BlockClasses | None = None) -> ShardingPlan:
    """The sharding plan of ``module``: its blocks (``block_classes`` or the automatic policy), then the root.

    Args:
        module: The model to shard (a ``LightningModule`` or any ``nn.Module``).
        block_classes: Classes, or class names, of the blocks; ``None`` for the automatic policy.

    Returns:
        The plan; its blocks are empty when nothing repeats (the root is then the one unit).

    Raises:
        ValueError: If the model has no parameters, or no submodule is of ``block_classes``.

    Example::

        from torch import nn
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        plan_sharding(model).blocks  # ('0', '2')
    """
    if not _holds_parameters(module):
        raise ValueError(
            f"{type(module).__name__} has no parameters, so mgpu_fsdp has nothing to shard. Create the layers"
            " in __init__ or in configure_model (which runs before sharding), or use a strategy that does"
            " not shard."
        )
    if block_classes is not None:
        blocks = _outermost(
            module, lambda parent: {n for n, c in parent.named_children() if _matches(c, block_classes)}
        )
        if not blocks:
            raise ValueError(_missing_classes_message(module, block_classes))
        plan = ShardingPlan(tuple(blocks), "block_classes")
    else:
        plan = ShardingPlan(tuple(find_blocks(module)), "automatic policy")
    log.debug(
        "sharding plan of %s by the %s: %s", type(module).__name__, plan.chosen_by, plan.describe(limit=50)
    )
    return plan
