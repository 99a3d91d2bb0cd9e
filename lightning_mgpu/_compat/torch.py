"""What torch features need beyond the floor, and torch's private names the package uses.

Feature checks: each feature that needs more than the declared floor, checked when it is used, in one line.

The package installs over any torch from the floor in ``pyproject.toml`` up, so that an environment's
own torch (a cluster image, a CUDA build) is kept. A feature that needs more than the floor is listed
here once, with the release that first has it and how to tell (an attribute, not a version string, so
that nightly and vendor builds are judged by what they hold). Where it is used, ``require`` refuses it
on an older torch with one line naming that release and what to do instead; nothing runs half-way.

- ``FSDP_ON_CPU``: ``mgpu_fsdp`` on CPU processes. FSDP2 records events on the current stream, which
  ``torch.cpu.Stream`` can do from torch 2.7 (on 2.6 torch raises ``AttributeError: 'Stream' object has no
  attribute 'record_event'``).
- ``FSDP_FORCE_SUM``: ``mgpu_fsdp`` where gloo's reduce-scatter sums when asked to average (torch 2.7 and
  2.8, pytorch/pytorch#162338): FSDP is made to sum and divide itself, with
  ``FSDPModule.set_force_sum_reduction_for_comms`` (torch 2.8); ``strategies/fsdp/gloo_average.py``.
- ``FSDP_RESET_ITER_STATE``: ``micro_batch_size="auto"`` under ``mgpu_fsdp``, which resets a pass abandoned
  after an out-of-memory with ``FSDPModule.reset_iter_state`` (torch 2.13).

Private names (below the checks): each with why, checked on torch 2.6 (the floor) to 2.13. The
distributed ones import their module when first used, so that reading a checkpoint file
(``checkpoint/``) does not load FSDP and ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel._functions import Gather, Scatter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = [
    "FEATURES",
    "FSDP_FORCE_SUM",
    "FSDP_ON_CPU",
    "FSDP_RESET_ITER_STATE",
    "ORIG_MOD",
    "Gather",
    "Scatter",
    "TorchDispatchMode",
    "TorchFeature",
    "activation_checkpoint",
    "compile_wrapper_type",
    "compiled_in_place",
    "compiled_original",
    "ddp_ignored_names",
    "flatten_dense_tensors",
    "fsdp_comms",
    "fsdp_param_groups",
    "hooks_set_aside",
    "privateuse1_backend_name",
    "replicate_for_data_parallel",
    "replicated_parameters",
    "require",
    "run_uncompiled",
    "storage_info_type",
    "tree_flatten",
    "unflatten_dense_tensors",
    "unsharded_param",
]


@dataclass(frozen=True)
class TorchFeature:
    """A feature that needs a newer torch than the floor.

    Args:
        name: The feature as a user asks for it, e.g. ``"micro_batch_size='auto' under mgpu_fsdp"``.
        since: The first torch release that has what it needs, e.g. ``"2.13"``.
        needs: What that release added, e.g. ``"FSDPModule.reset_iter_state"``.
        instead: What to do on an older torch besides upgrading, e.g. ``"use a fixed micro_batch_size"``.
        present: Whether this torch has it (looked up, not read from the version string).
    """

    name: str
    since: str
    needs: str
    instead: str
    present: Callable[[], bool]

    def message(self) -> str:
        """The one line that refuses the feature on this torch."""
        return (
            f"{self.name} needs torch>={self.since} ({self.needs}), and this is torch {torch.__version__}:"
            f" upgrade torch, or {self.instead}"
        )


def _cpu_stream_records_events() -> bool:
    return hasattr(torch.cpu.Stream, "record_event")


def _fsdp_forces_sum() -> bool:
    from torch.distributed.fsdp import FSDPModule

    return hasattr(FSDPModule, "set_force_sum_reduction_for_comms")


def _fsdp_resets_iter_state() -> bool:
    from torch.distributed.fsdp import FSDPModule

    return hasattr(FSDPModule, "reset_iter_state")


FSDP_ON_CPU = TorchFeature(
    name="mgpu_fsdp on CPU",
    since="2.7",
    needs="torch.cpu.Stream.record_event, which FSDP2 calls",
    instead="train on GPUs (accelerator='gpu'), or use strategy='mgpu_ddp' on CPU",
    present=_cpu_stream_records_events,
)
FSDP_FORCE_SUM = TorchFeature(
    name="mgpu_fsdp over gloo on this torch, whose reduce-scatter sums when asked to average"
    " (pytorch/pytorch#162338)",
    since="2.8",
    needs="FSDPModule.set_force_sum_reduction_for_comms, to sum and divide instead",
    instead="train on GPUs with NCCL, or use strategy='mgpu_ddp'",
    present=_fsdp_forces_sum,
)
FSDP_RESET_ITER_STATE = TorchFeature(
    name="micro_batch_size='auto' under mgpu_fsdp",
    since="2.13",
    needs="FSDPModule.reset_iter_state",
    instead="use a fixed micro_batch_size",
    present=_fsdp_resets_iter_state,
)

FEATURES = (FSDP_ON_CPU, FSDP_FORCE_SUM, FSDP_RESET_ITER_STATE)
"""Every feature above, for the test that each is present exactly from the release it names."""


def require(feature: TorchFeature) -> None:
    """Refuse ``feature`` on a torch that lacks it.

    Raises:
        RuntimeError: This torch lacks the feature; the message names the release that has it.
    """
    if not feature.present():
        raise RuntimeError(feature.message())


# --- private names, torch 2.6-2.13 -------------------------------------------------------------------
# ``tree_flatten`` (torch.utils._pytree): the leaves of a batch of any nesting; the public
# ``torch.utils.pytree`` is not in every release from the floor.
# ``TorchDispatchMode`` (torch.utils._python_dispatch): sees every tensor an estimate's step allocates.
# ``_flatten_dense_tensors`` / ``_unflatten_dense_tensors`` (torch._utils): one all-reduce for a group
# of gradients, as DistributedDataParallel's own bucketing does.
# ``Scatter`` / ``Gather`` (torch.nn.parallel._functions): nn.DataParallel's autograd-aware copies
# between devices, so a split batch's gradients flow back as under nn.DataParallel.
flatten_dense_tensors = _flatten_dense_tensors
unflatten_dense_tensors = _unflatten_dense_tensors


def activation_checkpoint(module: nn.Module) -> None:
    """Checkpoint ``module``'s activations in a way that composes with FSDP2's ``fully_shard``
    (``torch.distributed._composable.checkpoint``, as torchtitan applies it); the public
    ``torch.utils.checkpoint`` wraps a function, not a module."""
    from torch.distributed._composable import checkpoint

    checkpoint(module)


def storage_info_type() -> type:
    """``torch.distributed.checkpoint.filesystem._StorageInfo``: where a sharded checkpoint's chunk lies
    in its file, a type the ``.metadata`` pickle holds."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo


ORIG_MOD = "_orig_mod"
"""The child name ``torch.compile``'s wrapper gives the module it compiled (in names and state dicts)."""


def compile_wrapper_type() -> type[nn.Module] | None:
    """``torch.compile``'s wrapper class, ``None`` before dynamo was loaded (no wrapper can exist then)."""
    frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper: type[nn.Module] | None = getattr(frame, "OptimizedModule", None)
    return wrapper


def compiled_original(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper compiled."""
    original: nn.Module = getattr(module, ORIG_MOD)
    return original


def compiled_in_place(module: nn.Module) -> bool:
    """Whether ``module.compile()`` compiled the module itself (no wrapper)."""
    return module.__dict__.get("_compiled_call_impl") is not None


def run_uncompiled(module: nn.Module) -> None:
    """A replica runs its own ``forward``: ``m.compile()`` stores code compiled for the original module."""
    if module.__dict__.get("_compiled_call_impl") is not None:
        module.__dict__["_compiled_call_impl"] = None


def replicated_parameters(replica: nn.Module) -> dict[str, Any]:
    """The parameters ``torch.nn.parallel.replicate`` gave a replica as plain tensors (the differentiable
    copies it keeps in ``_former_parameters``), by name; empty for a module it did not replicate."""
    return dict(getattr(replica, "_former_parameters", None) or {})


def replicate_for_data_parallel(module: nn.Module) -> nn.Module:
    """nn.DataParallel's shallow replica of one module (``torch.nn.parallel.replicate`` does the same)."""
    replica: nn.Module = module._replicate_for_data_parallel()
    return replica


def privateuse1_backend_name() -> str:
    """The name a third-party device (``PrivateUse1``) registered, ``"privateuseone"`` if none."""
    return torch._C._get_privateuse1_backend_name()


def ddp_ignored_names(model: nn.Module) -> set[str]:
    """Parameters and buffers ``DistributedDataParallel`` was told to ignore
    (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``)."""
    return set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))


def fsdp_param_groups(unit: FSDPModule) -> list[Any]:
    """An FSDP2 unit's parameter groups (``FSDPParamGroup``), whose all-gather and reduce-scatter
    buffers are watched and whose gathered gradients are dropped after an out-of-memory; FSDP2 has no
    public getter (torch 2.6-2.13)."""
    groups: list[Any] = getattr(unit._get_fsdp_state(), "_fsdp_param_groups", None) or []
    return groups


# what nn.Module keeps its hooks in (no public way to set them aside); FSDP2 registers its gathers and
# reduce-scatters there
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


@contextlib.contextmanager
def hooks_set_aside(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Every hook of ``modules`` set aside while open (an estimate's step on meta tensors through FSDP
    units runs no collective), put back after (torch 2.6-2.13)."""
    saved = [(m, name, getattr(m, name)) for m in modules for name in _HOOKS if hasattr(m, name)]
    for module, name, hooks in saved:
        setattr(module, name, type(hooks)())
    try:
        yield
    finally:
        for module, name, hooks in saved:
            setattr(module, name, hooks)


def fsdp_comms(group: Any) -> list[tuple[Any, Any]]:
    """An ``FSDPParamGroup``'s own all-gather and reduce-scatter, each with its process group (``None``
    before the first pass), to be wrapped and given back through ``set_custom_all_gather`` /
    ``set_custom_reduce_scatter``, which have no getter; empty where this torch names them otherwise (the
    unit is then left unwatched; read on torch 2.13)."""
    comms = []
    for comm, process_group in (
        ("_all_gather_comm", "_all_gather_process_group"),
        ("_reduce_scatter_comm", "_reduce_scatter_process_group"),
    ):
        if getattr(group, comm, None) is None:
            return []
        try:
            known = getattr(group, process_group)
        except Exception:  # a property that needs the first pass: the group is read at the first call
            known = None
        comms.append((getattr(group, comm), known))
    return comms


def unsharded_param(param: Any) -> torch.Tensor | None:
    """An ``FSDPParam``'s gathered parameter, ``None`` while it is sharded (torch 2.6-2.13)."""
    unsharded: torch.Tensor | None = getattr(param, "_unsharded_param", None)
    return unsharded


def records_left_unread() -> contextlib.AbstractContextManager[Any]:
    """Around ``torch.load(..., map_location="meta")``: the file's tensor records are not read.

    On torch 2.13 a meta ``map_location`` alone skips them (``torch.serialization._is_meta_location``);
    torch 2.6 and 2.8 read (and inflate) every record first and take that path only under a fake tensor
    mode, so a compressed record claiming 800 MiB was inflated (RSS +798 MiB on 2.6) before its claim
    was checked. No upstream issue: newer torch changed it on its own."""
    import torch.serialization as serialization

    if hasattr(serialization, "_is_meta_location"):
        return contextlib.nullcontext()
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()
