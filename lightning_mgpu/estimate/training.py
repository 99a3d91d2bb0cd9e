"""One warm-up and two measured training steps on copies of a module's tensors.

The copies live on ``meta`` (nothing is computed) or CPU; the module is called through
``torch.func.functional_call`` so its own parameters, buffers and gradients stay as
they were. The order of work is Lightning's automatic optimization: forward (the last
step's gradients still alive), ``zero_grad(set_to_none=True)``, backward, optimizer step.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.func import functional_call
from torch.utils.weak import WeakIdKeyDictionary

from lightning_mgpu.estimate.batch import batch_rows, resized, tensors
from lightning_mgpu.estimate.live_bytes import LiveBytes, SavedBytes, storage_bytes, storage_of

__all__ = ["Line", "MeasuredStep", "measure_steps"]


@dataclass(frozen=True)
class Line:
    """``fixed + slope * batch`` bytes, through two measurements."""

    fixed: float
    slope: float

    @property
    def pair(self) -> tuple[float, float]:
        return (self.fixed, self.slope)

    @classmethod
    def through(cls, b1: int, v1: float, b2: int, v2: float) -> Line:
        slope = max(0.0, (v1 - v2) / (b1 - b2))
        return cls(v1 - slope * b1, slope)


@dataclass(frozen=True)
class MeasuredStep:
    """What one measured training step held, and how it scales with the batch."""

    device: str
    optimizer: str
    sample_batch_size: int
    parameter_bytes: int
    buffer_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    batch: Line
    saved: Line
    outputs: Line
    forward_backward: Line
    optimizer_step: Line
    notes: tuple[str, ...]


class _Call(nn.Module):
    """Lets ``functional_call`` run any step function, not only ``forward``."""

    def __init__(self, module: nn.Module, step: Callable[[nn.Module, Any], Any]) -> None:
        super().__init__()
        self.module = module
        self._step = step

    def forward(self, batch: Any) -> Any:
        return self._step(self.module, batch)


def _training_step(module: nn.Module, batch: Any) -> Any:
    return module.training_step(batch, 0)  # type: ignore[operator]


def _forward(module: nn.Module, batch: Any) -> Any:
    return module(batch)


def _resolve_step(module: nn.Module, step_fn: Callable[[nn.Module, Any], Any] | None) -> Any:
    if step_fn is not None:
        return step_fn
    if hasattr(module, "training_step"):
        if getattr(module, "automatic_optimization", True) is False:
            raise ValueError(
                f"{type(module).__name__} uses manual optimization, so its training_step does not return a"
                " loss: pass step_fn=lambda module, batch: <loss> to estimate_memory"
            )
        return _training_step
    return _forward


def _find_optimizers(conf: Any) -> list[torch.optim.Optimizer]:
    if isinstance(conf, torch.optim.Optimizer):
        return [conf]
    items = conf.values() if isinstance(conf, Mapping) else conf if isinstance(conf, (list, tuple)) else []
    found: list[torch.optim.Optimizer] = []
    for item in items:
        found.extend(o for o in _find_optimizers(item) if all(o is not f for f in found))
    return found


def _resolve_optimizers(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, notes: list[str]
) -> list[torch.optim.Optimizer]:
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        return [optimizer]
    configure = getattr(module, "configure_optimizers", None)
    conf = None
    if configure is not None:
        try:
            with _quiet_lightning():
                conf = configure()
        except Exception as err:
            raise ValueError(
                f"{type(module).__name__}.configure_optimizers() failed outside a Trainer"
                f" ({type(err).__name__}: {err}); pass optimizer=... to estimate_memory"
            ) from err
    found = _find_optimizers(conf)
    if not found:
        notes.append("no optimizer: optimizer state is not counted (pass optimizer=...)")
    return found


def _copy_optimizer(opt: torch.optim.Optimizer, leaf_of: dict[int, torch.Tensor]) -> torch.optim.Optimizer:
    def measuring(options: dict[str, Any]) -> dict[str, Any]:
        options = dict(options)
        if options.get("fused"):  # fused kernels update in place without temporaries
            options.update(fused=False, foreach=False)
        elif "foreach" in options and options["foreach"] is None:
            options["foreach"] = True  # the default on CUDA, whose temporaries are what we predict
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


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*self\.trainer.*")
        warnings.filterwarnings("ignore", message=r".*configure_optimizers.*")
        yield


def _unique_bytes(tensors: list[torch.Tensor], min_dim: int = 0) -> int:
    seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
    total = 0
    for t in tensors:
        st = storage_of(t)
        if t.dim() < min_dim or (st is not None and st in seen):
            continue
        if st is not None:
            seen[st] = True
        total += storage_bytes(t)
    return total


def _loss_of(out: Any) -> torch.Tensor:
    if isinstance(out, Mapping) and "loss" in out:
        out = out["loss"]
    if not isinstance(out, torch.Tensor):
        raise ValueError(
            f"the training step returned {type(out).__name__}: return the loss tensor (or a dict with"
            " 'loss'), or pass step_fn=lambda module, batch: <loss> to estimate_memory"
        )
    if not out.requires_grad:
        raise ValueError("the training step's loss does not require grad: nothing would be trained")
    return out if out.numel() == 1 else out.sum()


def _step(
    call: Callable[[Any], Any],
    batch: Any,
    optimizers: list[torch.optim.Optimizer],
    leaves: list[torch.Tensor],
    tracker: LiveBytes,
    static: list[torch.Tensor],
) -> dict[str, int]:
    saved = SavedBytes(static + tensors(batch))
    with tracker.phase() as forward_backward:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            out = call(batch)
        loss = _loss_of(out)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        for leaf in leaves:
            leaf.grad = None
        loss.backward()
        del loss
    with tracker.phase() as step:
        for opt in optimizers:
            opt.step()
    return {
        "forward_backward": forward_backward["peak"],
        "optimizer_step": step["peak"],
        "saved": saved.total,
        "outputs": _unique_bytes(tensors(out), min_dim=1),
        "batch": _unique_bytes(tensors(batch)),
    }


@dataclass
class _Copies:
    """The module's tensors copied to the measuring device, and a call running the step on them."""

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    leaf_of: dict[int, torch.Tensor]
    call: Callable[[Any], Any]

    @property
    def static(self) -> list[torch.Tensor]:
        return [*self.params.values(), *self.buffers.values()]


def _copies(
    module: nn.Module,
    sample_batch: Any,
    step: Callable[[nn.Module, Any], Any],
    device: torch.device,
    param_dtype: torch.dtype | None,
    autocast_dtype: torch.dtype | None,
) -> tuple[_Copies, Any]:
    """The copies, and a copy of ``sample_batch`` (the caller holds it, so it can free it)."""

    def copy(t: torch.Tensor) -> torch.Tensor:
        dtype = param_dtype if param_dtype is not None and t.is_floating_point() else t.dtype
        return t.detach().to(device=device, dtype=dtype, copy=True).requires_grad_(t.requires_grad)

    named = dict(module.named_parameters())
    params = {name: copy(p) for name, p in named.items()}
    buffers = {name: copy(b) for name, b in module.named_buffers()}
    wrapper = _Call(module, step)
    tensors = {f"module.{k}": v for k, v in {**params, **buffers}.items()}
    autocast: Any = contextlib.nullcontext()
    if autocast_dtype is not None:
        autocast = torch.autocast(device.type, dtype=autocast_dtype)

    def call(batch: Any) -> Any:
        with autocast:
            return functional_call(wrapper, tensors, (batch,))

    leaf_of = {id(p): params[name] for name, p in named.items()}
    return _Copies(params, buffers, leaf_of, call), apply_to_collection(sample_batch, torch.Tensor, copy)


def _sizes(sample_batch: Any) -> tuple[int, int]:
    b1 = batch_rows(sample_batch)
    if b1 is None:
        raise ValueError("the sample batch holds no tensor: give one batch as the DataLoader yields it")
    return b1, b1 // 2 if b1 >= 2 else 2


def measure_steps(
    module: nn.Module,
    sample_batch: Any,
    *,
    device: torch.device,
    optimizer: torch.optim.Optimizer | None,
    step_fn: Callable[[nn.Module, Any], Any] | None,
    param_dtype: torch.dtype | None,
    autocast_dtype: torch.dtype | None,
) -> MeasuredStep:
    """Warm up once, then measure steps at the sample's batch size and at half (or double) of it."""
    notes: list[str] = []
    step = _resolve_step(module, step_fn)
    b1, b2 = _sizes(sample_batch)
    originals = _resolve_optimizers(module, optimizer, notes)
    copies, batch1 = _copies(module, sample_batch, step, device, param_dtype, autocast_dtype)
    params, static, call = copies.params, copies.static, copies.call
    optimizers = [_copy_optimizer(o, copies.leaf_of) for o in originals]
    tracker = LiveBytes(device)
    tracker.track_all(static + tensors(batch1))
    was_training = module.training
    module.train()
    try:
        with torch.random.fork_rng(devices=[]), _quiet_lightning(), tracker:
            trainable = [p for p in params.values() if p.requires_grad]
            # the warm-up creates the gradients and the optimizer state, as Lightning's first step does
            _step(call, batch1, optimizers, trainable, tracker, static)
            m1 = _step(call, batch1, optimizers, trainable, tracker, static)
            batch2 = resized(batch1, b1, b2)
            del batch1
            m2 = _step(call, batch2, optimizers, trainable, tracker, static)
    finally:
        module.train(was_training)
    state = [t for o in optimizers for s in o.state.values() for t in tensors(s) if t.device == device]
    return MeasuredStep(
        device=device.type,
        optimizer=", ".join(type(o).__name__ for o in originals) or "none",
        sample_batch_size=b1,
        parameter_bytes=_unique_bytes(list(params.values())),
        buffer_bytes=_unique_bytes(list(copies.buffers.values())),
        gradient_bytes=_unique_bytes([p.grad for p in params.values() if p.grad is not None]),
        # scalar step counters are left out: they usually live on the CPU
        optimizer_state_bytes=_unique_bytes(state, min_dim=1),
        **{key: Line.through(b1, m1[key], b2, m2[key]) for key in ("batch", "saved", "outputs")},
        forward_backward=Line.through(b1, m1["forward_backward"], b2, m2["forward_backward"]),
        optimizer_step=Line.through(b1, m1["optimizer_step"], b2, m2["optimizer_step"]),
        notes=tuple(notes),
    )
