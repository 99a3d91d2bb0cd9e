"""How many bytes of model state this rank holds, and how many the whole model has.

Model state is the parameters, their gradients and the optimizer's state, all of it (step counts
too): what the rank holds now, where ``optimizer_state.count_optimizer_state`` predicts what a step
will create. Under ``fully_shard`` each of them is a ``DTensor`` whose local shard is what this rank
keeps; a plain tensor is held whole. Measured from the tensors themselves, so the numbers show
whether sharding happened, on CPU runs as on GPUs. The start-up summary of ``mgpu_fsdp``,
``DeviceMemoryMonitor`` and the out-of-memory message of an optimizer step read it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from lightning_mgpu.estimate.batch import tensors

__all__ = ["ModelState", "ModelStateMeter", "StateBytes", "measure_model_state"]


@dataclass(frozen=True)
class StateBytes:
    """Bytes of parameters, gradients and optimizer state."""

    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


@dataclass(frozen=True)
class ModelState:
    """This rank's share of the model state beside the whole model's.

    Attributes:
        local: Bytes this rank holds (the local shards of sharded tensors, plain tensors whole).
        whole: Bytes of the whole model state (the global size of sharded tensors).
    """

    local: StateBytes
    whole: StateBytes

    @property
    def share(self) -> float:
        """``local.total / whole.total``: about ``1 / world size`` when everything is sharded."""
        return self.local.total / self.whole.total if self.whole.total else 1.0


def _local_and_whole(tensors: Iterable[torch.Tensor]) -> tuple[int, int]:
    local = whole = 0
    seen: set[int] = set()
    for t in tensors:
        if id(t) in seen:  # tied weights are held once
            continue
        seen.add(id(t))
        size = t.element_size()
        whole += t.numel() * size
        # a DTensor (a sharded tensor) keeps its local shard here
        local += (t.to_local().numel() if hasattr(t, "to_local") else t.numel()) * size
    return local, whole


def measure_model_state(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> ModelState:
    """This rank's bytes of parameters, gradients and optimizer state, and the whole model's.

    Args:
        module: The model, sharded or not.
        optimizers: Its optimizers (their state exists after the first step).

    Example::

        from torch import nn
        measure_model_state(nn.Linear(4, 2)).local.parameters  # 40: 10 float32 numbers
    """
    params = list(module.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = [t for optimizer in optimizers for state in optimizer.state.values() for t in tensors(state)]
    sizes = [_local_and_whole(tensors) for tensors in (params, grads, states)]
    return ModelState(StateBytes(*(local for local, _ in sizes)), StateBytes(*(whole for _, whole in sizes)))


class ModelStateMeter:
    """``measure_model_state`` for a reading every step: measured again only when its tensors may differ.

    Between two steps the model state keeps its size unless a tensor appears or goes: a gradient set
    or dropped, optimizer state created (the first step), a parameter added or frozen. The meter
    keeps the module's parameter list and measures again when the gradients present, the number of
    states per optimizer or the parameter list differ from the last measurement; the parameters are
    listed again every :attr:`RELIST` calls (a module changed in place). Its numbers are those of
    ``measure_model_state`` at every call.
    """

    RELIST = 64

    def __init__(self) -> None:
        self._module: nn.Module | None = None
        self._params: list[nn.Parameter] = []
        self._calls = 0
        self._key: tuple[tuple[object, ...], ...] | None = None
        self._state: ModelState | None = None

    def __call__(self, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> ModelState:
        optimizers = list(optimizers)
        relisted = False
        if module is not self._module or self._calls % self.RELIST == 0:
            params = list(module.parameters())
            relisted = module is not self._module or [id(p) for p in params] != [id(p) for p in self._params]
            self._module, self._params = module, params
        self._calls += 1
        key = (
            tuple(p.grad is not None for p in self._params),  # a gradient has its parameter's size
            tuple((id(o), len(o.state), sum(len(s) for s in o.state.values())) for o in optimizers),
        )
        if relisted or key != self._key or self._state is None:
            self._state, self._key = measure_model_state(module, optimizers), key
        return self._state
