"""Key prefixes that wrappers add to a state_dict, and how to take them off or put them on.

- ``module.`` comes from ``nn.DataParallel`` and ``DistributedDataParallel``;
- ``_orig_mod.`` comes from ``torch.compile``;
- ``_forward_module.`` comes from older Lightning wrappers and DeepSpeed;
- a LightningModule adds the name of the attribute that holds the model (``model.``, ``net.``, ...).

A wrapper holds exactly one child and nothing else, so a component named like a wrapper is
removed only where every key below that point goes through it. A user's own attribute that
happens to be called ``module`` next to siblings is left alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import TypeVar

from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

__all__ = ["WRAPPERS", "add_prefix", "plain_names", "select", "split_top", "strip_wrappers"]

T = TypeVar("T")

# wrapper attribute -> who adds it
WRAPPERS: dict[str, str] = {
    "module": "nn.DataParallel / DistributedDataParallel",
    "_orig_mod": "torch.compile",
    "_forward_module": "Lightning / DeepSpeed wrapper",
}


def plain_names(keys: Iterable[str]) -> tuple[dict[str, str], list[str]]:
    """Map every key to its name without wrapper components.

    Returns:
        ``(names, removed)``: ``names[key]`` is the plain name; ``removed`` lists each wrapper prefix
        found, in the keys' own spelling and outermost first (``"module."``, ``"module._orig_mod."``).
    """
    names: dict[str, str] = {}
    removed: list[str] = []
    _walk([(key, key.split(".")) for key in keys], "", "", names, removed)
    return names, removed


def _walk(
    entries: list[tuple[str, list[str]]],
    raw_prefix: str,
    plain_prefix: str,
    names: dict[str, str],
    removed: list[str],
) -> None:
    groups: dict[str, list[tuple[str, list[str]]]] = {}
    leaves = []
    for key, parts in entries:
        if len(parts) == 1:
            leaves.append((key, parts[0]))
        else:
            groups.setdefault(parts[0], []).append((key, parts[1:]))
    if not leaves and len(groups) == 1:
        (child,) = groups
        if child in WRAPPERS:
            removed.append(f"{raw_prefix}{child}.")
            _walk(groups[child], f"{raw_prefix}{child}.", plain_prefix, names, removed)
            return
    for key, leaf in leaves:
        names[key] = plain_prefix + leaf
    for child, sub in groups.items():
        _walk(sub, f"{raw_prefix}{child}.", f"{plain_prefix}{child}.", names, removed)


def strip_wrappers(state_dict: Mapping[str, T]) -> tuple[OrderedDict[str, T], list[str]]:
    """Remove every wrapper prefix at any depth, keeping the order of the entries.

    Returns:
        The renamed state_dict and the removed prefixes (see :func:`plain_names`).

    Example::

        sd, removed = strip_wrappers({"module._orig_mod.0.weight": w})
        # sd == {"0.weight": w}; removed == ["module.", "module._orig_mod."]
    """
    names, removed = plain_names(state_dict)
    if not removed:
        return OrderedDict(state_dict), []
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
