"""Replicas of a LightningModule and the call that runs one step inside a replica.

- ``replicate`` copies the module tree once per device. Across GPUs it is
  ``torch.nn.parallel.replicate`` (parameters broadcast in a differentiable way, buffers
  copied). When every replica is on one device (CPU replicas) every replica shares the
  module's parameters, the first replica shares its buffers and the others get copies of
  them: the same semantics without the copies that one device does not need.
  Submodules compiled with ``torch.compile`` run uncompiled in replicas (see
  ``compiled_submodules``).
- ``ReplicaCall`` runs ``training_step`` (or another step) of one replica in its thread with
  the caller's grad / inference mode and the precision plugin's autocast, which are all
  thread-local, and can count the bytes the replica saves for backward.
- ``refresh_parameters`` copies weights updated in the middle of a step into replicas
  that hold copies of them (manual optimization across GPUs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks
from torchmetrics import Metric

from lightning_mgpu._compat.torch import (
    compile_wrapper_type,
    compiled_in_place,
    compiled_original,
    replicate_for_data_parallel,
    replicated_parameters,
    run_uncompiled,
)
from lightning_mgpu.estimate.live_bytes import SavedBytes
from lightning_mgpu.strategies.split.merge_metrics import replica_path

__all__ = [
    "ReplicaCall",
    "compiled_submodules",
    "prepare_replica",
    "refresh_parameters",
    "replicate",
]


def compiled_submodules(module: nn.Module) -> list[str]:
    """Names of the submodules compiled with ``torch.compile(m)`` or ``m.compile()``.

    Compiled code is tied to the module object it was compiled for, and replicas are new
    objects every step, so replicas run these submodules uncompiled.
    """
    wrapper = compile_wrapper_type() or ()
    return [
        name for name, sub in module.named_modules() if isinstance(sub, wrapper) or compiled_in_place(sub)
    ]


def _unwrapped(module: nn.Module, wrapper: type[nn.Module] | tuple[()]) -> nn.Module:
    while isinstance(module, wrapper):
        module = compiled_original(module)
    return module


@contextlib.contextmanager
def _compile_wrappers_removed(module: nn.Module) -> Iterator[None]:
    """Put each ``torch.compile`` wrapper's module in its place while ``torch.nn.parallel.replicate`` runs.

    Replicating a wrapper (``OptimizedModule``) writes the replica's attributes through to the
    wrapped module, which corrupts the user's module, and its compiled ``forward`` would call
    the original module instead of the replica.
    """
    wrapper = compile_wrapper_type()
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        if wrapper is not None:
            for parent in list(module.modules()):
                if isinstance(parent, wrapper):
                    continue
                for key, child in list(parent._modules.items()):
                    if child is not None and isinstance(child, wrapper):
                        swapped.append((parent, key, child))
                        parent._modules[key] = _unwrapped(child, wrapper)
        yield
    finally:
        for parent, key, child in reversed(swapped):
            parent._modules[key] = child


def _replicate_on_one_device(module: nn.Module, count: int) -> list[nn.Module]:
    wrapper = compile_wrapper_type() or ()

    def copy(original: nn.Module, j: int, made: dict[int, nn.Module]) -> nn.Module:
        """Replica ``j`` of ``original``'s tree; ``made`` by id, so that a module used twice stays one."""
        if id(original) in made:
            return made[id(original)]
        replica = made[id(original)] = replicate_for_data_parallel(original)
        run_uncompiled(replica)
        # the replica's own dicts, filled in directly (Module.__setattr__ adds nothing here)
        state = replica.__dict__
        state["_parameters"] = dict(original._parameters)
        if j > 0:
            buffers = original._buffers.items()
            state["_buffers"] = {k: None if b is None else b.clone() for k, b in buffers}
        if not isinstance(original, Metric):  # metrics get their own copies (split.merge_metrics.PartMetrics)
            for key, child in original._modules.items():
                if child is not None:
                    state["_modules"][key] = copy(_unwrapped(child, wrapper), j, made)
        return replica

    return [copy(module, j, {}) for j in range(count)]


def replicate(module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """One replica of ``module`` per device; gradients of every replica flow into ``module``'s parameters."""
    if len(set(devices)) == 1:
        return _replicate_on_one_device(module, len(devices))
    from torch.nn.parallel import replicate as torch_replicate

    with _compile_wrappers_removed(module):
        replicas = torch_replicate(module, list(devices), detach=not torch.is_grad_enabled())
    for replica in replicas:
        for sub in replica.modules():
            run_uncompiled(sub)
            former = replicated_parameters(sub)
            if former:  # so that ``self.parameters()`` inside a step still sees (differentiable) parameters
                sub._parameters = {**sub._parameters, **former}
    return replicas


def prepare_replica(replica: nn.Module, device: torch.device, hooks: dict[str, Callable[..., Any]]) -> None:
    """Point a replica's ``self.device`` at its own device and install the stand-ins in ``hooks``."""
    for sub in replica.modules():
        if "_device" in sub.__dict__ and sub.__dict__["_device"] != device:
            sub.__dict__["_device"] = device
    replica.__dict__.update(hooks)


@dataclass(eq=False)
class ReplicaCall:
    """Calls ``method`` of one replica with the thread-local modes of the thread that made it.

    Args:
        replica: the replica (or the module itself when one replica runs).
        method: ``"training_step"``, ``"validation_step"``, ...
        step_context: the precision plugin's context for this kind of step.
        track_memory: whether to count the bytes saved for backward; ``saved_bytes`` holds them.
        on_exit: called with the exception (or ``None``) when the step ends.
    """

    replica: nn.Module
    method: str
    step_context: Callable[[], AbstractContextManager[Any]]
    track_memory: bool = False
    on_exit: Callable[[BaseException | None], None] | None = None
    saved_bytes: int = field(default=0, init=False)
    _grad: bool = field(default_factory=torch.is_grad_enabled, init=False)
    _inference: bool = field(default_factory=torch.is_inference_mode_enabled, init=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        counter = SavedBytes() if self.track_memory else None
        counting = nullcontext() if counter is None else saved_tensors_hooks(counter.pack, counter.unpack)
        error: BaseException | None = None
        try:
            with (
                torch.inference_mode(self._inference),
                torch.set_grad_enabled(self._grad),
                self.step_context(),
                counting,
            ):
                return getattr(self.replica, self.method)(*args, **kwargs)
        except BaseException as err:
            error = err
            raise
        finally:
            if counter is not None:
                self.saved_bytes = counter.total
            if self.on_exit is not None:
                self.on_exit(error)


@torch.no_grad()
def refresh_parameters(module: torch.nn.Module, replicas: Sequence[torch.nn.Module]) -> None:
    """After an optimizer step inside a step, copy the new weights into replicas on other devices."""
    originals = list(module.named_parameters())
    for replica in replicas:
        for name, param in originals:
            copy = _replica_tensor(replica, name)
            if copy is not None and copy.data_ptr() != param.data_ptr():
                copy.copy_(param)


def _replica_tensor(replica: torch.nn.Module, name: str) -> Tensor | None:
    owner_path, _, leaf = replica_path(name).rpartition(".")
    try:
        owner = replica.get_submodule(owner_path) if owner_path else replica
    except AttributeError:
        return None
    value = owner.__dict__.get(leaf, owner._parameters.get(leaf))
    return value if isinstance(value, Tensor) else None
