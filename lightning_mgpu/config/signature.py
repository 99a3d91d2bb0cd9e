"""What a class's ``__init__`` takes, read from its signature: the checks of ``trainer`` and its strategy.

- ``keywords(cls)``: each keyword argument with its annotation resolved (``Optional[int]``, not a string);
- ``convert(value, hint)``: a config value as the annotation takes it (seconds become a ``timedelta``), or
  ``TypeError``;
- ``describe(hint)``: the annotation in a config's words (``an integer or null``), which
  ``wrong_type(path, value, hint)`` puts in the message for a value ``convert`` refuses;
- ``field_type(hint)``: the type omegaconf checks a key by (``Any`` where ``convert`` must), and
  ``fields(cls, leave_out, defaults)`` one dataclass field per keyword so typed, for ``trainer`` and each
  callback's sub-section;
- ``not_taken(path, owner, noun, takes)``: the message for a keyword a class does not take, with "did you
  mean", for a strategy's options and an optimizer's arguments;
- ``checked(section, keys, build)``: what a class says of its arguments when built, as a config problem.

Nothing here lists a class's arguments by hand, so a new keyword of Lightning's ``Trainer`` or of a
strategy is a config key at once. This module does not import torch.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import inspect
import sys
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from lightning_mgpu.config.checks import did_you_mean

__all__ = ["checked", "convert", "describe", "field_type", "fields", "keywords", "not_taken", "wrong_type"]

_PLAIN = (bool, int, float, str)

_WORDS = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "a string",
    datetime.timedelta: "seconds",
    list: "a list",
    dict: "a mapping",
    type(None): "null",
}


@functools.cache
def keywords(cls: type) -> dict[str, inspect.Parameter]:
    """Each keyword ``cls(...)`` takes, its annotation resolved (kept as a string where it names an import
    made for type checkers only, such as ``Accelerator``, or cannot be evaluated: no config value is one).

    Example::

        keywords(lightning.pytorch.Trainer)["max_epochs"].annotation  # typing.Optional[int]
    """
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    defining = next(k for k in cls.__mro__ if "__init__" in vars(k))  # its names are in that module
    module = vars(sys.modules[defining.__module__])
    params = inspect.signature(cls).parameters.values()
    return {p.name: p.replace(annotation=_resolve(p.annotation, module)) for p in params if p.kind in named}


def _union_members(hint: Any) -> tuple[Any, ...]:
    """``(int, NoneType)`` for ``Optional[int]``; ``(hint,)`` for anything but a union."""
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)


def convert(value: Any, hint: Any) -> Any:
    """``value`` as the annotation ``hint`` takes it (seconds become a ``timedelta``), or ``TypeError``.

    Example::

        convert(600, datetime.timedelta | None)  # timedelta(seconds=600)
    """
    if hint is Any or hint is inspect.Parameter.empty:
        return value
    if len(members := _union_members(hint)) > 1:
        for member in members:
            try:
                return convert(value, member)
            except TypeError:
                pass
        raise TypeError(value)
    if typing.get_origin(hint) is typing.Literal:
        if value in typing.get_args(hint):
            return value
        raise TypeError(value)
    plain = typing.get_origin(hint) or hint
    number = type(value) in (int, float)
    if plain is datetime.timedelta and number:
        return datetime.timedelta(seconds=value)
    if plain is float and number:
        return float(value)
    if plain is type(None) and value is None:
        return value
    if isinstance(plain, type) and isinstance(value, plain) and (type(value) is not bool or plain is bool):
        return value
    raise TypeError(value)


def wrong_type(path: str, value: Any, hint: Any) -> list[str]:
    """``[]`` when ``convert`` takes ``value``, else the message naming ``path``, what ``hint`` takes and
    what it got.

    Example::

        wrong_type("max_epochs", "ten", int | None)  # ["max_epochs: expected an integer or null, got 'ten'"]
    """
    try:
        convert(value, hint)
    except TypeError:
        return [f"{path}: expected {describe(hint)}, got {value!r}"]
    return []


def not_taken(path: str, owner: str, noun: str, takes: Sequence[str]) -> str:
    """The message for a keyword ``owner`` does not take: the closest one it takes, else all of them.

    Example::

        not_taken("kwargs.betaz", "torch.optim.AdamW", "argument", ["lr", "betas"])
        # 'kwargs.betaz: torch.optim.AdamW takes no argument betaz; did you mean betas?'
    """
    key = path.rpartition(".")[2]
    hint = did_you_mean(key, takes, "did you mean {}?") or f"it takes {', '.join(takes) or 'nothing'}"
    return f"{path}: {owner} takes no {noun} {key}; {hint}"


def describe(hint: Any) -> str:
    """What a config may give for ``hint``, in words; members no config value can be are named as objects.

    Example::

        describe(typing.Union[int, float, None])  # 'an integer, a number or null'
    """
    words: list[str] = []
    objects: list[str] = []  # what only Python code can give: a ClusterEnvironment, a Strategy object, ...
    for member in _union_members(hint):
        if typing.get_origin(member) is typing.Literal:  # deterministic: true, false or 'warn'
            found = [repr(arg) for arg in typing.get_args(member)]
        else:
            found = [_WORDS.get(typing.get_origin(member) or member, "")]
            if not found[0]:
                objects.append(getattr(member, "__name__", str(member)))
        words += [word for word in found if word and word not in words]
    if objects:
        words.append(f"a {' or '.join(objects)} object (given in Python code, not in a config)")
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def field_type(hint: Any) -> Any:
    """The omegaconf type of a key: its one plain type (optional or not), else ``Any`` (``convert`` checks).

    A ``Literal`` of names is a ``str`` (``precision``: ``16`` and ``"16"`` name the same); members no
    config value can be (an ``Accelerator`` object) are left out.

    Example::

        field_type(typing.Union[str, Accelerator])  # str
    """
    members = [m for m in _union_members(hint) if m is not type(None)]
    optional = len(members) < len(_union_members(hint))
    if all(typing.get_origin(m) is typing.Literal for m in members):
        members = [str]
    elif len(members) > 1:
        members = [m for m in members if m in _PLAIN or typing.get_origin(m)]
    if len(members) != 1 or members[0] not in _PLAIN:
        return Any
    return members[0] | None if optional else members[0]


def fields(cls: type, leave_out: Iterable[str], defaults: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``make_dataclass``'s fields for the keywords of ``cls`` but ``leave_out``: typed by ``field_type``,
    with ``cls``'s defaults unless ``defaults`` gives one.

    Example::

        fields(ModelCheckpoint, ["dirpath"], {"save_last": True})[0]  # ('filename', str | None, Field(...))
    """
    return [
        (n, field_type(p.annotation), dataclasses.field(default=defaults.get(n, p.default)))
        for n, p in keywords(cls).items()
        if n not in leave_out
    ]


def checked(section: str, keys: Iterable[str], build: Callable[[], object]) -> list[str]:
    """``build()``'s error as a problem of ``section``; a message that opens with one of the ``keys``
    (``micro_batch_size must be ...``) gets the section's path in front of that key."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    try:
        build()
    except (ValueError, TypeError, MisconfigurationException) as err:
        return [f"{section}.{err}" if str(err).split(" ")[0] in keys else f"{section}: {err}"]
    return []


def _resolve(annotation: Any, module: dict[str, Any]) -> Any:
    if not isinstance(annotation, str):
        return annotation
    try:
        return typing.get_type_hints(types.SimpleNamespace(__annotations__={"a": annotation}), module)["a"]
    except Exception:  # a name imported for type checkers only (Accelerator), or one no import made
        return annotation  # no config value is one
