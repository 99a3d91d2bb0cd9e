"""``load_state_dict``: load any checkpoint into the model you have, or say exactly why not."""

from __future__ import annotations

import logging
from collections import OrderedDict
from itertools import chain
from typing import Any

import torch
from torch import nn

from lightning_mgpu.checkpoint._dcp import ShardedFolder
from lightning_mgpu.checkpoint._match import Mapping, match_names
from lightning_mgpu.checkpoint._prefixes import WRAPPERS, find_wrappers, plain_names, split_top
from lightning_mgpu.checkpoint._report import LoadReport, Shape
from lightning_mgpu.checkpoint._source import (
    PlainWeights,
    Source,
    describe_tops,
    is_lightning_module,
    plain_state_dict,
    resolve,
)

__all__ = ["LoadError", "LoadReport", "load_state_dict"]

# the last line of a strict failure, naming the Python API: where the error reaches a user through
# another door (a config's model.weights), the caller replaces it with LoadError.problems
_STRICT_FALSE = (
    "to load what matches anyway: lightning_mgpu.load_state_dict(model, source, strict=False) loads it "
    "and returns this report"
)


class LoadError(ValueError):
    """``load_state_dict(strict=True)`` loaded nothing: ``str(err)`` lists the problems and hints.

    Attributes:
        report: The :class:`LoadReport` of what did not fit.
        problems: The message without its last line, which names the Python API's
            ``strict=False``: a command line or a config raising it adds its own way out.
    """

    def __init__(self, message: str, report: LoadReport) -> None:
        super().__init__(message)
        self.report = report
        self.problems = message.removesuffix("\n" + _STRICT_FALSE)


logger = logging.getLogger(__name__)


def load_state_dict(
    model: nn.Module,
    source: Any,
    *,
    strict: bool = True,
    by_order: bool = False,
    map_location: Any = "cpu",
    trust_pickle: bool = False,
    submodule: str | None = None,
    key: str | None = None,
) -> LoadReport:
    """Load ``source`` into ``model``, whatever wraps either of them.

    - ``source`` is anything :func:`export_state_dict` takes: a checkpoint path, a module, a
      LightningModule, a state_dict or a training checkpoint dict;
    - ``model`` may be plain or wrapped in DataParallel, DDP or ``torch.compile``; wrapper prefixes
      are removed from the source and put back as the model needs. A module's wrappers are found by
      type; a file's by where ``module.`` / ``_orig_mod.`` sit, and when that reading does not fit the
      model, ``module.`` components are read as the model's own attributes (``blocks.0.module.``);
    - a top-level prefix on either side (a LightningModule's ``model.``) is removed or added when
      that makes the names meet; source entries outside the matched submodule are reported as ignored;
    - with ``strict=True`` nothing is loaded unless every model entry gets a tensor of the right shape;
      an entry the source leaves out that the model ties to a loaded one (the same Parameter, as
      ``lm_head.weight`` and the embedding in Hugging Face files) counts as given, and the report
      lists it under ``tied``;
    - files are unpickled with ``weights_only=True`` (omegaconf hyperparameters allowed).

    Args:
        model: The module to load into.
        source: Where the weights come from (see above).
        strict: Raise, loading nothing, on any missing, unexpected or mis-shaped entry. With
            ``False`` the matching entries are loaded and the rest reported.
        by_order: Pair entries by position instead of by name, for weights of the same architecture
            saved under other names. Every pair's shapes are checked.
        map_location: Where a file's tensors are read to, as in ``torch.load``.
        trust_pickle: Unpickle arbitrary Python objects from a legacy file. Only for files you trust.
        submodule: Take only the source entries under this name (``"model"``, ``"student"``).
        key: The entry of a training checkpoint that holds the weights, when it holds several
            (``{"model": ..., "ema": ...}``).

    Returns:
        A :class:`LoadReport`: prefixes removed and added, missing and unexpected entries, shape
        mismatches, ignored entries and the ``by_order`` pairs.

    Raises:
        LoadError: (a ValueError) with ``strict=True``, the problems listed one per line, with a
            hint when a known prefix or the order of entries explains them.
        ValueError: the source is unreadable, corrupt or unsafe.

    Example::

        import torch
        from torch import nn
        from lightning_mgpu import load_state_dict

        trained = nn.DataParallel(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
        torch.save(trained.state_dict(), "dp.pt")  # names start with "module."
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        report = load_state_dict(model, "dp.pt")
        print(report.removed_prefixes)  # ['module.']
    """
    src = resolve(source, map_location=map_location, trust_pickle=trust_pickle, key=key)
    plain = plain_state_dict(src, submodule or "")  # the model decides a LightningModule's attribute
    source_sd, removed, ignored = plain.state_dict, plain.removed, plain.ignored
    target_sd = model.state_dict()
    target_names, target_wrappers = plain_names(target_sd, find_wrappers(model))
    actual = {name: key for key, name in target_names.items()}
    target = OrderedDict((target_names[k], v) for k, v in target_sd.items())

    report = LoadReport(source=src.description, removed_prefixes=removed, added_prefixes=target_wrappers)
    if by_order:
        pairs = _pair_by_order(src, source_sd, target, report)
    else:
        lightning = (src.lightning and not submodule, is_lightning_module(model))
        mapping = match_names(source_sd, target, lightning)
        if src.wrappers is None and mapping.names(source_sd) != set(target):
            other = _attributes_reading(src, submodule, target, lightning, removed)
            if other is not None:
                plain, mapping = other
                source_sd, removed, ignored = plain.state_dict, plain.removed, plain.ignored
                report.removed_prefixes = removed
        pairs = _pair_by_name(source_sd, target, mapping, report)
        _fill_ties(model, target_names, pairs, report)
        report.ignored = ignored + [k for k in source_sd if not mapping.covers(k)]
    if report.removed_prefixes and report.removed_prefixes == report.added_prefixes:
        # a DataParallel file into a DataParallel model: the names went in as they were
        report.unchanged_prefixes = report.removed_prefixes
        report.removed_prefixes, report.added_prefixes = [], []
    if strict and not report.ok:
        several = src.lightning and not submodule and len(split_top(source_sd)) > 1
        raise LoadError(_failure(model, report, source_sd, target, by_order, several), report)
    if src.check is not None:
        src.check.verify(src.state_dict)
    to_load = OrderedDict((actual[t], source_sd[s]) for s, t in pairs)
    if isinstance(src.mapped, ShardedFolder):  # a sharded folder's tensors are read one at a time
        src.mapped.load_into(model, to_load)
    else:
        model.load_state_dict(to_load, strict=False)
    report.loaded = len(to_load)
    return report


def _attributes_reading(
    src: Source,
    submodule: str | None,
    target: OrderedDict[str, Any],
    lightning: tuple[bool, bool],
    removed: list[str],
) -> tuple[PlainWeights, Mapping] | None:
    """A file's names misled when its ``module.`` is the model's own attribute: that reading, if it fits."""
    try:
        plain = plain_state_dict(src, submodule or "", ["_orig_mod"])
        if plain.removed == removed:
            return None
        mapping = match_names(plain.state_dict, target, lightning)
    except (KeyError, ValueError):
        return None
    return (plain, mapping) if mapping.names(plain.state_dict) == set(target) else None


def _pair_by_name(
    source: OrderedDict[str, Any], target: OrderedDict[str, Any], mapping: Mapping, report: LoadReport
) -> list[tuple[str, str]]:
    if mapping.strip:
        report.removed_prefixes.append(mapping.strip)
    if mapping.add:
        report.added_prefixes.insert(0, mapping.add)
    pairs, seen = [], set()
    for key, value in source.items():
        if not mapping.covers(key):
            continue
        name = mapping.apply(key)
        if name not in target:
            report.unexpected.append(key)
            continue
        seen.add(name)
        if _shape_mismatch(key, value, name, target[name], report):
            continue
        pairs.append((key, name))
    report.missing = [k for k in target if k not in seen and not _filled_in_by_torch(k, seen)]
    return pairs


def _fill_ties(
    model: nn.Module, plain: dict[str, str], pairs: list[tuple[str, str]], report: LoadReport
) -> None:
    """Move missing entries the model ties to a loaded one (the same Parameter) to ``report.tied``.

    Files written by Hugging Face ``save_pretrained`` leave out tied output weights
    (``lm_head.weight``), because loading the embedding fills them.
    """
    groups: dict[int, list[str]] = {}
    named = chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        groups.setdefault(id(tensor), []).append(plain.get(name, name))
    loaded = {name for _, name in pairs}
    for group in groups.values():
        source = next((name for name in group if name in loaded), None)
        if source is None or len(group) < 2:
            continue
        for name in group:
            if name in report.missing:
                report.missing.remove(name)
                report.tied.append((name, source))
                logger.debug("%s: not in the source, tied to the loaded %s", name, source)


def _filled_in_by_torch(name: str, loaded: set[str]) -> bool:
    # BatchNorm weights saved before torch 0.4.1 have no `num_batches_tracked`; BatchNorm's own
    # loading keeps the module's count when the running statistics come without it
    stem, _, leaf = name.rpartition("num_batches_tracked")
    return not leaf and stem + "running_mean" in loaded


def _pair_by_order(
    src: Source, source: OrderedDict[str, Any], target: OrderedDict[str, Any], report: LoadReport
) -> list[tuple[str, str]]:
    if not src.ordered:
        why = (
            "each rank saves its own part, in its own order"
            if isinstance(src.mapped, ShardedFolder)
            else "a safetensors file written by another tool"
        )
        raise ValueError(
            f"{src.description} does not record the order of its tensors ({why}), so by_order cannot pair"
            " them; pair by name, or export a checkpoint that records the order with"
            " lightning_mgpu.export_state_dict"
        )
    sources, targets = list(source.items()), list(target.items())
    report.unexpected = [k for k, _ in sources[len(targets) :]]
    report.missing = [k for k, _ in targets[len(sources) :]]
    pairs = []
    for (key, value), (name, expected) in zip(sources, targets, strict=False):
        if not _shape_mismatch(key, value, name, expected, report):
            pairs.append((key, name))
    report.pairs = pairs
    return pairs


def _shape_mismatch(key: str, value: Any, name: str, expected: Any, report: LoadReport) -> bool:
    if not (isinstance(value, torch.Tensor) and isinstance(expected, torch.Tensor)):
        return False
    if value.shape == expected.shape:
        return False
    report.mismatched.append((key, name, Shape(value.shape), Shape(expected.shape)))
    return True


def _failure(
    model: nn.Module,
    report: LoadReport,
    source: OrderedDict[str, Any],
    target: OrderedDict[str, Any],
    by_order: bool,
    several: bool,
) -> str:
    """The strict failure's message: the problems, a hint for each known cause, the way out."""
    hints = []
    for wrapper, who in WRAPPERS.items():
        through = [k for k in report.unexpected if k.startswith(f"{wrapper}.")]
        if through:
            hints.append(
                f"{len(through)} source entries start with '{wrapper}.' ({who}) but others do not, so that "
                f"prefix was not removed: e.g. {through[0]!r}; remove it from those entries, or export the "
                "wrapped model's inner module"
            )
    if several:
        hints.append(
            f"the source holds several top-level entries: {describe_tops(source)}; "
            "pass submodule=NAME to load one of them"
        )
    if not by_order and len(source) == len(target) and (report.missing or report.unexpected):
        same = all(
            getattr(s, "shape", None) == getattr(t, "shape", None)
            for s, t in zip(source.values(), target.values(), strict=True)
        )
        if same:
            hints.append(
                "the names differ but the shapes match one by one in order: "
                "by_order=True pairs entries by position"
            )
    lines = [f"cannot load {report.source} into {type(model).__name__} with strict=True:"]
    lines += [*report.problem_lines(), *(f"hint: {hint}" for hint in hints), _STRICT_FALSE]
    return "\n".join(lines)
