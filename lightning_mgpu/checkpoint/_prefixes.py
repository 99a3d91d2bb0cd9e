"""Key prefixes that wrappers add to a state_dict, and how to take them off or put them on.

- ``module.`` comes from ``nn.DataParallel`` and ``DistributedDataParallel``;
- ``_orig_mod.`` comes from ``torch.compile``;
- ``_forward_module.`` comes from older Lightning wrappers and DeepSpeed;
- a LightningModule adds the name of the attribute that holds the model (``model.``, ``net.``, ...).

Where the module itself is at hand, the wrappers are found by type (:func:`find_wrappers`) and
exactly their prefixes are removed: a user's own class that keeps its only child in ``self.module``
is never a wrapper.

A file or a dict does not say which classes it came from, so its names decide, by position. A
wrapper holds exactly one child and nothing else, so a component named like a wrapper is only
removed where every key below that point goes through it, and then:

- ``_orig_mod`` anywhere (nobody names an attribute that);
- ``module`` and ``_forward_module`` only where a wrapper plausibly sits: at the top
  (``module.0.weight``), directly after another removed wrapper (``_orig_mod.module.``,
  ``model._orig_mod.module.``), or directly under a top-level name that is not a number and that
  is the whole of the state: the only top-level name (``model.module.0.weight``), or, in the
  weights of a LightningModule, that module's attribute (``model.module.`` beside ``loss_fn.``).
  Positions count in the names with the outer wrappers already removed.

So ``blocks.0.module.weight`` and ``0.module.weight`` (a residual block keeping its layer in
``self.module``) stay as they are, and so does ``encoder.module.weight`` beside ``head.weight`` in a
plain model's file: one child among several carrying ``module.`` is that child's own attribute.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Collection, Iterable, Mapping
from itertools import accumulate
from typing import TypeVar

from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from lightning_mgpu._compat.torch import ORIG_MOD, compile_wrapper_type

__all__ = [
    "WRAPPERS",
    "add_prefix",
    "explain",
    "find_wrappers",
    "plain_names",
    "select",
    "split_top",
    "strip_wrappers",
    "wrapped_child",
]

T = TypeVar("T")

logger = logging.getLogger(__name__)

# wrapper attribute -> who adds it
WRAPPERS: dict[str, str] = {
    "module": "nn.DataParallel / DistributedDataParallel",
    "_orig_mod": "torch.compile",
    "_forward_module": "Lightning / DeepSpeed wrapper",
}
# a wrapper name no model uses for its own attribute: removable at any depth in a file
_DISTINCTIVE = frozenset({"_orig_mod"})
# packages whose single-child modules holding ``module`` / ``_forward_module`` are wrappers
_WRAPPER_PACKAGES = frozenset({"lightning", "pytorch_lightning", "deepspeed"})


def explain(prefix: str, otherwise: str) -> str:
    """``"module. (nn.DataParallel / DistributedDataParallel)"`` for a wrapper's prefix, else
    ``otherwise``."""
    last = prefix.rstrip(".").rsplit(".", 1)[-1]
    return f"{prefix} ({WRAPPERS[last]})" if last in WRAPPERS else otherwise


def wrapped_child(module: nn.Module) -> str | None:
    """The attribute holding the wrapped model if ``module`` is a wrapper, else None.

    Wrappers are ``nn.DataParallel``, ``DistributedDataParallel``, ``torch.compile``'s
    ``OptimizedModule`` (looked up only if dynamo is already imported) and the classes of the
    ``lightning``, ``pytorch_lightning`` and ``deepspeed`` packages whose single child is
    ``module`` or ``_forward_module``.

    Example::

        wrapped_child(nn.DataParallel(net))  # "module"
        wrapped_child(Residual(net))         # None: a user's class is never a wrapper
    """
    children = dict(module.named_children())
    if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        return "module" if "module" in children else None
    optimized = compile_wrapper_type()
    if optimized is not None and isinstance(module, optimized):
        return ORIG_MOD if ORIG_MOD in children else None
    if type(module).__module__.split(".", 1)[0] in _WRAPPER_PACKAGES and len(children) == 1:
        (name,) = children
        return name if name in ("module", "_forward_module") else None
    return None


def find_wrappers(module: nn.Module) -> list[str]:
    """The key prefixes of every wrapper inside ``module``, outermost first.

    Example::

        find_wrappers(torch.compile(nn.DataParallel(net)))  # ["_orig_mod.", "_orig_mod.module."]
    """
    found = []
    for path, sub in module.named_modules(remove_duplicate=False):
        child = wrapped_child(sub)
        if child is not None:
            found.append(f"{path}.{child}." if path else f"{child}.")
    return found


def plain_names(
    keys: Iterable[str],
    wrappers: Collection[str] | None = None,
    kinds: Collection[str] = tuple(WRAPPERS),
    *,
    lightning: bool = False,
) -> tuple[dict[str, str], list[str]]:
    """Map every key to its name without wrapper components.

    Args:
        keys: The state_dict's names.
        wrappers: The exact wrapper prefixes (:func:`find_wrappers`) when the module is known;
            None judges by the names, as the module docstring describes.
        kinds: The wrapper names that may be removed when judging by the names.
        lightning: The names are a LightningModule's, whose top-level names are its attributes: a
            wrapper directly under one of them counts even beside other attributes.

    Returns:
        ``(names, removed)``: ``names[key]`` is the plain name; ``removed`` lists each wrapper prefix
        found, in the keys' own spelling and outermost first (``"module."``, ``"module._orig_mod."``).
    """
    known = None if wrappers is None else frozenset(wrappers)
    keys = list(keys)
    # how many keys lie below each prefix ("model.", "model.module.", ...)
    below = Counter(p for key in keys for p in accumulate(f"{part}." for part in key.split(".")[:-1]))
    below[""] = len(keys)

    def reason(part: str, prefix: str, plain: str, after_wrapper: bool, whole: bool) -> str | None:
        """Why ``part`` (at ``prefix``) is a wrapper; None if it is not. Judged by the names, only a part
        that is the only child where it sits can be one."""
        if known is not None:
            return "a wrapper module holds it" if prefix in known else None
        if part not in kinds:
            return None
        if part in _DISTINCTIVE:
            return "a name only torch.compile gives"
        if after_wrapper:
            return "directly inside another wrapper"
        if not plain:
            return "at the top"
        top = plain[:-1]
        if "." in top or top.isdigit():
            return None  # inside a model's own layers: a block's attribute
        if not whole:
            logger.debug(
                "kept %r under %r: other top-level entries sit beside %r, so it is the model's own attribute",
                part,
                top,
                top,
            )
            return None
        return f"directly under {top!r}, " + (
            "a LightningModule attribute" if lightning else "the only top-level name"
        )

    names: dict[str, str] = {}
    wrapper: dict[str, bool] = {}  # prefix -> whether it is a wrapper's, decided once, in order
    for key in keys:
        *parts, leaf = key.split(".")
        raw = plain = ""
        after_wrapper = whole = False
        for part in parts:
            prefix = f"{raw}{part}."
            only = below[prefix] == below[raw]  # every key below ``raw`` goes through ``part``
            if prefix not in wrapper:
                # a wrapper found by type is one even where it keeps tensors of its own beside its child
                why = reason(part, prefix, plain, after_wrapper, whole) if only or known is not None else None
                if why is not None:
                    logger.debug(
                        "removed wrapper prefix %r: every key below %r goes through it, %s",
                        prefix,
                        raw or "the top",
                        why,
                    )
                wrapper[prefix] = why is not None
            if not wrapper[prefix]:
                if not plain:
                    # a top-level name is the whole state when it is the only one, or when it is an attribute
                    # of a LightningModule, whose other attributes (a loss's weights) say nothing of its model
                    whole = lightning or only
                plain += f"{part}."
            after_wrapper, raw = wrapper[prefix], prefix
        names[key] = plain + leaf
    return names, [prefix for prefix, removed in wrapper.items() if removed]


def strip_wrappers(
    state_dict: Mapping[str, T],
    wrappers: Collection[str] | None = None,
    kinds: Collection[str] = tuple(WRAPPERS),
    *,
    lightning: bool = False,
) -> tuple[OrderedDict[str, T], list[str]]:
    """Remove the wrapper prefixes, keeping the order of the entries.

    ``wrappers``, ``kinds`` and ``lightning`` are as in :func:`plain_names`: the exact prefixes of a
    known module, or None to judge by the names.

    Returns:
        The renamed state_dict and the removed prefixes (see :func:`plain_names`).

    Example::

        sd, removed = strip_wrappers({"module._orig_mod.0.weight": w})
        # sd == {"0.weight": w}; removed == ["module.", "module._orig_mod."]
        sd, removed = strip_wrappers({"0.module.weight": w})
        # unchanged: a wrapper does not sit under a numbered entry
    """
    names, removed = plain_names(state_dict, wrappers, kinds, lightning=lightning)
    # a wrapper is the only child where it sits, so the plain names stay unique
    return OrderedDict((names[k], v) for k, v in state_dict.items()), removed


def split_top(keys: Iterable[str]) -> dict[str, int]:
    """Count keys per first name component, in order of first appearance."""
    counts: dict[str, int] = {}
    for key in keys:
        top = key.split(".", 1)[0]
        counts[top] = counts.get(top, 0) + 1
    return counts


def select(state_dict: Mapping[str, T], name: str) -> OrderedDict[str, T]:
    """The entries under submodule ``name`` (``"model"``, ``"model.encoder"``), renamed relative to it.

    An empty ``name`` keeps everything.

    Raises:
        KeyError: nothing lives under ``name``; the message lists the top-level names there are.

    Example::

        select({"model.0.weight": w, "loss.weight": v}, "model")  # {"0.weight": w}
    """
    if not name:
        return OrderedDict(state_dict)
    prefix = name.rstrip(".") + "."
    out: OrderedDict[str, T] = OrderedDict((k, v) for k, v in state_dict.items() if k.startswith(prefix))
    if not out:
        tops = ", ".join(split_top(state_dict))
        raise KeyError(f"no submodule {name!r}: the weights hold {tops}")
    consume_prefix_in_state_dict_if_present(out, prefix)
    return out


def add_prefix(state_dict: Mapping[str, T], prefix: str) -> OrderedDict[str, T]:
    """Put ``prefix`` (``"module."`` for the DataParallel form) in front of every key."""
    if prefix and not prefix.endswith("."):
        prefix += "."
    return OrderedDict((prefix + k, v) for k, v in state_dict.items())
