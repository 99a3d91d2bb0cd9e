"""The process-group backend for a device, and the checks made inside ``Trainer(...)``.

- ``default_backend``: NCCL on CUDA when this torch build has it, gloo on CPU and on CUDA
  builds without NCCL (Windows), the device type's default backend otherwise.
- ``check_devices``: fails before any process starts when a chosen CUDA device does not
  exist or is chosen twice, when an explicit backend cannot run here, or when
  ``sync_batchnorm=True`` meets devices that torch's ``SyncBatchNorm`` refuses (CPU); the
  message lists the devices that exist. Entries that are not ``torch.device`` (a custom
  accelerator's own objects) are checked only where torch reads them as a device.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_mgpu._compat.torch import privateuse1_backend_name
from lightning_mgpu.devices import cuda_devices, visible_cuda_devices

__all__ = ["available_backends", "check_devices", "default_backend", "describe_devices"]

log = logging.getLogger(__name__)

_KNOWN_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")


def _as_device(entry: object) -> torch.device | None:
    """``entry`` as a ``torch.device`` where torch reads it as one (a device or a device string)."""
    if isinstance(entry, torch.device):
        return entry
    if isinstance(entry, str):
        try:
            return torch.device(entry)
        except RuntimeError:
            return None
    return None


def default_backend(device: object) -> str:
    """The backend ``mgpu_ddp`` uses for ``device`` when none was given (gloo for what is not a device)."""
    parsed = _as_device(device)
    if parsed is None:
        backend, why = "gloo", f"{device!r} is not a torch device"
    elif parsed.type == "cuda":
        nccl = dist.is_nccl_available()
        backend = "nccl" if nccl else "gloo"
        why = "a CUDA device" if nccl else "a CUDA device, but this torch build has no NCCL"
    else:
        backend = dist.Backend.default_device_backend_map.get(parsed.type, "gloo")
        why = f"torch's default for {parsed.type} devices"
    log.debug("backend %s for %s: %s", backend, device, why)
    return backend


def available_backends() -> list[str]:
    """Backends this torch build can create."""
    return [backend for backend in _KNOWN_BACKENDS if dist.is_backend_available(backend)]


def describe_devices() -> str:
    """The CUDA devices this process can see, with names and physical indices."""
    found = cuda_devices()
    visible = visible_cuda_devices()
    note = f" (CUDA_VISIBLE_DEVICES={','.join(visible)} renumbers them from 0)" if visible is not None else ""
    if not found:
        return f"no CUDA device is visible{note}; accelerator='cpu' runs one process per devices=N"
    listed = ", ".join(f"cuda:{d.index} {d.name} (physical GPU {d.physical})" for d in found)
    return f"{len(found)} CUDA device(s) visible{note}: {listed}"


def check_devices(devices: Sequence[object], backend: str | None, sync_batchnorm: bool = False) -> None:
    """Raise ``ValueError`` for a device choice or backend that cannot run on this machine.

    Args:
        devices: The strategy's ``parallel_devices``; entries torch does not read as a device
            are left to the accelerator that made them.
        backend: The explicit ``process_group_backend``, or ``None``.
        sync_batchnorm: Whether ``Trainer(sync_batchnorm=True)`` asked for ``SyncBatchNorm``.

    Raises:
        ValueError: A CUDA index that does not exist or appears twice, an unknown or
            unavailable backend, NCCL for devices that are not CUDA devices, or
            ``sync_batchnorm=True`` on devices ``SyncBatchNorm`` cannot synchronise.
    """
    parsed = [d for d in map(_as_device, devices) if d is not None]
    if sync_batchnorm:  # the device types torch.nn.SyncBatchNorm synchronises (see its forward)
        synchronised = {"cuda", "hpu", "xpu", privateuse1_backend_name()}
        refused = sorted({d.type for d in parsed} - synchronised)
        if refused:
            raise ValueError(
                f"sync_batchnorm=True needs GPUs: torch's SyncBatchNorm cannot synchronise tensors on"
                f" {', '.join(refused)} devices. Train on GPUs (accelerator='gpu'), or drop"
                " sync_batchnorm=True (each process then normalises over its own batch)."
            )
    cuda = [d for d in parsed if d.type == "cuda"]
    if cuda:
        count = torch.cuda.device_count()
        missing = [str(d) for d in cuda if (d.index or 0) >= count]
        if missing:
            raise ValueError(f"devices {', '.join(missing)} do not exist: {describe_devices()}")
        indices = [d.index or 0 for d in cuda]
        if len(set(indices)) != len(indices):
            chosen = [str(d) for d in cuda]
            raise ValueError(f"each device may appear once, got {chosen}: {describe_devices()}")
    if backend is None or ":" in backend:  # "cpu:gloo,cuda:nccl" names a backend per device type
        return
    available = available_backends()
    if backend.lower() not in available:
        raise ValueError(
            f"process_group_backend={backend!r} is not available in this torch build; available here:"
            f" {', '.join(available) or 'none'}. Leave it unset to get NCCL on CUDA devices and gloo"
            " elsewhere."
        )
    others = sorted({d.type for d in parsed if d.type != "cuda"})
    if backend.lower() == "nccl" and others:
        raise ValueError(
            f"process_group_backend='nccl' needs CUDA devices, but this run uses {', '.join(others)} devices."
            f" Pass accelerator='gpu' ({describe_devices()}) or process_group_backend='gloo',"
            " or leave it unset to get NCCL on CUDA devices and gloo elsewhere."
        )
