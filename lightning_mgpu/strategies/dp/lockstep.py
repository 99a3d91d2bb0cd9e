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
from typing import Any

import torch
from lightning.pytorch import LightningModule

from lightning_mgpu.strategies.split.batch import weighted_mean

__all__ = [
    "Lockstep",
    "LockstepError",
    "ReplicaAborted",
    "manual_optimization_hooks",
    "raise_first",
    "record_exit",
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
    """A rendezvous of ``size`` replica threads; the last to arrive runs the shared action."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._cond = threading.Condition()
        self._arrived: dict[int, tuple[str, Any]] = {}
        self._generation = 0
        self._result: Any = None
        self._error: BaseException | None = None
        self._finished: set[int] = set()

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._cond.notify_all()

    def run(self, index: int, label: str, value: Any, action: Callable[[list[Any]], Any]) -> Any:
        """Let all replicas reach ``label``, run ``action`` once on their values, return its result."""
        with self._cond:
            if self._error is not None:
                raise ReplicaAborted(f"replica {index} stopped: another replica failed") from self._error
            if self._finished:
                error = LockstepError(
                    f"replica {index} calls `{label}` but replica(s) {sorted(self._finished)} already"
                    f" returned from training_step. {_SAME_CALLS}"
                )
                self._fail(error)
                raise error
            self._arrived[index] = (label, value)
            if len(self._arrived) == self._size:
                labels = {i: lab for i, (lab, _) in self._arrived.items()}
                if len(set(labels.values())) > 1:
                    error = LockstepError(
                        f"replicas called different actions at the same point of training_step: {labels}."
                        " Under mgpu_dp every replica must run the same manual-optimization calls"
                        " in the same order."
                    )
                    self._fail(error)
                    raise error
                values = [self._arrived[i][1] for i in range(self._size)]
                self._arrived = {}
                try:
                    self._result = action(values)
                except BaseException as err:
                    self._fail(err)
                    raise
                self._generation += 1
                self._cond.notify_all()
                return self._result
            generation = self._generation
            while self._generation == generation and self._error is None:
                self._cond.wait()
            if self._generation == generation:
                raise ReplicaAborted(f"replica {index} stopped while waiting in `{label}`") from self._error
            return self._result

    def exit(self, index: int, error: BaseException | None) -> None:
        """Called when a replica's step ends, with its exception if it raised one."""
        with self._cond:
            if error is not None:
                self._fail(error)
                return
            self._finished.add(index)
            if self._arrived:
                waiting = {i: lab for i, (lab, _) in self._arrived.items()}
                self._fail(
                    LockstepError(
                        f"replica {index} returned from training_step while replica(s) wait in {waiting}."
                        f" {_SAME_CALLS}"
                    )
                )


class _Shared:
    """An optimizer or scheduler inside a replica: its shared actions (``once``) happen once for all."""

    def __init__(self, inner: Any, lockstep: Lockstep, index: int, label: str) -> None:
        self._inner = inner
        self._lockstep = lockstep
        self._index = index
        self._label = label

    def _once(self, action: str, run: Callable[[], Any]) -> None:
        self._lockstep.run(self._index, f"{self._label}.{action}", None, lambda _: run())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _SharedOptimizer(_Shared):
    """What ``self.optimizers()`` returns inside a replica: ``step``/``zero_grad`` happen once for all."""

    def __init__(
        self,
        module: LightningModule,
        optimizer: Any,
        lockstep: Lockstep,
        index: int,
        label: str,
        after_step: Callable[[], None],
    ) -> None:
        if isinstance(getattr(optimizer, "optimizer", optimizer), torch.optim.LBFGS):
            raise ValueError(
                "mgpu_dp cannot run LBFGS with manual optimization: it re-evaluates the closure inside"
                " step(). Use automatic optimization (the default) for LBFGS."
            )
        super().__init__(optimizer, lockstep, index, label)
        self._module = module
        self._after_step = after_step

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
        module = self._module
        once = functools.partial(self._lockstep.run, self._index)
        once("toggle_optimizer", None, lambda _: module.toggle_optimizer(self._inner))
        try:
            yield
        finally:
            once("untoggle_optimizer", None, lambda _: module.untoggle_optimizer(self._inner))


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

    def wrap_optimizers(use_pl_optimizer: bool = True) -> Any:
        opts = module.optimizers(use_pl_optimizer)
        if isinstance(opts, list):
            return [
                _SharedOptimizer(module, o, lockstep, index, f"optimizer[{i}]", after_step)
                for i, o in enumerate(opts)
            ]
        return _SharedOptimizer(module, opts, lockstep, index, "optimizer", after_step)

    def wrap_schedulers() -> Any:
        schedulers = module.lr_schedulers()
        if schedulers is None:
            return None
        if isinstance(schedulers, list):
            return [
                _SharedScheduler(s, lockstep, index, f"lr_scheduler[{i}]") for i, s in enumerate(schedulers)
            ]
        return _SharedScheduler(schedulers, lockstep, index, "lr_scheduler")

    def once(label: str, action: Callable[..., Any], optimizer: Any, *args: Any, **kwargs: Any) -> None:
        lockstep.run(index, label, None, lambda _: action(_unwrap(optimizer), *args, **kwargs))

    def clip_gradients(optimizer: Any, *args: Any, **kwargs: Any) -> None:
        once("clip_gradients", module.clip_gradients, optimizer, *args, **kwargs)

    def toggle_optimizer(optimizer: Any) -> None:
        once("toggle_optimizer", module.toggle_optimizer, optimizer)

    def untoggle_optimizer(optimizer: Any) -> None:
        once("untoggle_optimizer", module.untoggle_optimizer, optimizer)

    return {
        "manual_backward": manual_backward,
        "optimizers": wrap_optimizers,
        "lr_schedulers": wrap_schedulers,
        "clip_gradients": clip_gradients,
        "toggle_optimizer": toggle_optimizer,
        "untoggle_optimizer": untoggle_optimizer,
    }


def record_exit(
    errors: list[BaseException | None], index: int, lockstep: Lockstep | None, error: BaseException | None
) -> None:
    """Note how replica ``index`` ended, and tell the other replicas of the step."""
    errors[index] = error
    if lockstep is not None:
        lockstep.exit(index, error)


def raise_first(errors: list[BaseException | None]) -> None:
    """Raise the error that stopped the step: a replica's own error before those it caused in the others."""
    real = [e for e in errors if e is not None and not isinstance(e, ReplicaAborted)]
    if real:
        raise real[0]
    aborted = [e for e in errors if e is not None]
    if aborted:
        raise aborted[0]
