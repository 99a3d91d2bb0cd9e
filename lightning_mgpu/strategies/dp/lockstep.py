"""Manual optimization inside replicas: shared actions happen once, with every replica's part.

With ``automatic_optimization = False`` the ``training_step`` itself calls
``self.manual_backward``, ``opt.step()``, ``opt.zero_grad()``, ``sch.step()``,
``self.clip_gradients`` and ``self.toggle_optimizer``. Every replica runs that code on its
chunk, but each of these actions must happen once per step, as on one device. Inside a
replica they become rendezvous points: the replicas wait for each other, the last to
arrive performs the action once on the module (``manual_backward`` on the replicas' losses
weighted by their share of the batch, which equals the whole-batch loss), and all continue.

Replicas must therefore call these actions in the same order and the same number of
times; a replica that diverges (another action, or returning early) stops the step with
an error that names what each replica was doing, instead of hanging.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule

from lightning_mgpu.strategies.split.batch import weighted_mean

__all__ = [
    "Lockstep",
    "LockstepError",
    "ReplicaAborted",
    "manual_optimization_hooks",
]


_SAME_CALLS = (
    "Under mgpu_dp every replica must call manual_backward, optimizer and scheduler steps the same"
    " number of times, whatever its part of the batch holds."
)


class LockstepError(RuntimeError):
    """Replicas did not call the shared manual-optimization actions in the same order."""


class ReplicaAborted(RuntimeError):
    """This replica stopped because another one failed; the other one's error is the one to report."""


class Lockstep:
    """A rendezvous of ``size`` replica threads (a ``threading.Barrier``): the last to arrive acts for all.

    It also keeps how each replica's step ended (``exit``), to raise the error that matters (``raise_first``).
    """

    def __init__(self, size: int) -> None:
        self._barrier = threading.Barrier(size, action=self._act)
        self._lock = threading.Lock()
        self._arrived: dict[int, tuple[str, Any, Callable[[list[Any]], Any]]] = {}
        self._result: Any = None
        self._error: BaseException | None = None
        self._finished: set[int] = set()
        self.errors: list[BaseException | None] = [None] * size
        """How each replica's step ended: its exception, or ``None``."""

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self._error = self._error or error
        self._barrier.abort()  # the replicas waiting in ``run`` stop

    def run(self, index: int, label: str, value: Any, action: Callable[[list[Any]], Any]) -> Any:
        """Let all replicas reach ``label``, run ``action`` once on their values, return its result."""
        with self._lock:
            error, finished = self._error, sorted(self._finished)
            if error is None and not finished:
                self._arrived[index] = (label, value, action)
        if error is not None:
            raise ReplicaAborted(f"replica {index} stopped: another replica failed") from error
        if finished:
            error = LockstepError(
                f"replica {index} calls `{label}` but replica(s) {finished} already"
                f" returned from training_step. {_SAME_CALLS}"
            )
            self._fail(error)
            raise error
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise ReplicaAborted(f"replica {index} stopped while waiting in `{label}`") from self._error
        return self._result

    def _act(self) -> None:
        """In the last replica to arrive, the others waiting: the action they all called, once."""
        arrived, self._arrived = self._arrived, {}
        labels = {i: arrived[i][0] for i in sorted(arrived)}
        try:
            if len(set(labels.values())) > 1:
                raise LockstepError(
                    f"replicas called different actions at the same point of training_step: {labels}."
                    " Under mgpu_dp every replica must run the same manual-optimization calls"
                    " in the same order."
                )
            self._result = arrived[0][2]([arrived[i][1] for i in sorted(arrived)])
        except BaseException as error:  # raised in this replica; the barrier breaks for the others
            self._error = self._error or error
            raise

    def exit(self, index: int, error: BaseException | None) -> None:
        """Called when a replica's step ends, with its exception if it raised one."""
        self.errors[index] = error
        if error is not None:
            self._fail(error)
            return
        with self._lock:
            self._finished.add(index)
            waiting = {i: self._arrived[i][0] for i in sorted(self._arrived)}
        if waiting:
            self._fail(
                LockstepError(
                    f"replica {index} returned from training_step while replica(s) wait in {waiting}."
                    f" {_SAME_CALLS}"
                )
            )

    def raise_first(self) -> None:
        """Raise the error that stopped the step: a replica's own before those it caused in the others."""
        real = [e for e in self.errors if e is not None and not isinstance(e, ReplicaAborted)]
        aborted = [e for e in self.errors if e is not None]
        if real or aborted:
            raise (real or aborted)[0]


@dataclass(eq=False, repr=False)
class _Shared:
    """An optimizer or scheduler inside a replica: its shared actions (``once``) happen once for all."""

    _inner: Any
    _lockstep: Lockstep
    _index: int
    _label: str

    def _once(self, action: str, run: Callable[[], Any]) -> None:
        self._lockstep.run(self._index, f"{self._label}.{action}", None, lambda _: run())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@dataclass(eq=False, repr=False)
class _SharedOptimizer(_Shared):
    """What ``self.optimizers()`` returns inside a replica: ``step``/``zero_grad`` happen once for all."""

    _module: LightningModule
    _after_step: Callable[[], None]

    def __post_init__(self) -> None:
        if isinstance(getattr(self._inner, "optimizer", self._inner), torch.optim.LBFGS):
            raise ValueError(
                "mgpu_dp cannot run LBFGS with manual optimization: it re-evaluates the closure inside"
                " step(). Use automatic optimization (the default) for LBFGS."
            )

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        # single-evaluation optimizers call the closure once before stepping: do it in the replica
        result = closure() if closure is not None else None

        def step() -> None:
            self._inner.step(**kwargs)
            self._after_step()

        self._once("step", step)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._once("zero_grad", functools.partial(self._inner.zero_grad, set_to_none=set_to_none))

    @contextmanager
    def toggle_model(self, sync_grad: bool = True) -> Generator[None, None, None]:
        self._once("toggle_optimizer", functools.partial(self._module.toggle_optimizer, self._inner))
        try:
            yield
        finally:
            self._once("untoggle_optimizer", functools.partial(self._module.untoggle_optimizer, self._inner))


class _SharedScheduler(_Shared):
    """What ``self.lr_schedulers()`` returns inside a replica: ``step`` happens once for all."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        self._once("step", functools.partial(self._inner.step, *args, **kwargs))


def _unwrap(optimizer: Any) -> Any:
    return optimizer._inner if isinstance(optimizer, _SharedOptimizer) else optimizer


def manual_optimization_hooks(
    module: LightningModule,
    lockstep: Lockstep,
    index: int,
    sizes: Sequence[int],
    after_step: Callable[[], None],
) -> dict[str, Callable[..., Any]]:
    """Stand-ins for the manual-optimization methods of replica ``index``.

    Args:
        module: the LightningModule the shared actions run on.
        lockstep: the rendezvous shared by the replicas of this step.
        index: this replica's position.
        sizes: rows of every replica's chunk, to weight their losses.
        after_step: run after each optimizer step (refreshes parameter copies on other devices).
    """

    def manual_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        def backward(losses: list[torch.Tensor]) -> None:
            module.manual_backward(weighted_mean(losses, sizes, module.device), *args, **kwargs)

        lockstep.run(index, "manual_backward", loss, backward)

    def each(given: Any, shared: Callable[..., _Shared], label: str, *extra: Any) -> Any:
        """``given`` (one, a list, or ``None``) as ``shared`` stand-ins, each labelled for errors."""
        if isinstance(given, list):
            return [shared(item, lockstep, index, f"{label}[{i}]", *extra) for i, item in enumerate(given)]
        return None if given is None else shared(given, lockstep, index, label, *extra)

    def wrap_optimizers(use_pl_optimizer: bool = True) -> Any:
        return each(module.optimizers(use_pl_optimizer), _SharedOptimizer, "optimizer", module, after_step)

    def wrap_schedulers() -> Any:
        return each(module.lr_schedulers(), _SharedScheduler, "lr_scheduler")

    def once(name: str) -> Callable[..., None]:
        """``module.<name>(optimizer, ...)`` run once for all replicas, on the optimizer itself."""
        action = getattr(module, name)

        def call(optimizer: Any, *args: Any, **kwargs: Any) -> None:
            lockstep.run(index, name, None, lambda _: action(_unwrap(optimizer), *args, **kwargs))

        return call

    shared = ("clip_gradients", "toggle_optimizer", "untoggle_optimizer")
    return {
        "manual_backward": manual_backward,
        "optimizers": wrap_optimizers,
        "lr_schedulers": wrap_schedulers,
        **{name: once(name) for name in shared},
    }
