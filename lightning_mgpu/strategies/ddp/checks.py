"""The process-group backend for a device, and the checks made inside ``Trainer(...)``.

- ``default_backend``: NCCL on CUDA when this torch build has it, gloo on CPU and on CUDA
  builds without NCCL (Windows), the device type's default backend otherwise.
- ``check_devices``: fails before any process starts when a chosen CUDA device does not
  exist or is chosen twice, or when an explicit backend cannot run here; the message
  lists the devices that exist.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_mgpu.devices import cuda_devices, visible_cuda_devices

__all__ = ["available_backends", "check_devices", "default_backend", "describe_devices"]

_KNOWN_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")


def default_backend(device: torch.device) -> str:
    """The backend ``mgpu_ddp`` uses for ``device`` when none was given."""
    if device.type == "cuda":
        return "nccl" if dist.is_nccl_available() else "gloo"
    return dist.Backend.default_device_backend_map.get(device.type, "gloo")


def available_backends() -> list[str]:
    """Backends this torch build can create."""
    check = getattr(dist, "is_backend_available", None)
    if check is not None:
        return [b for b in _KNOWN_BACKENDS if check(b)]
    flags = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available, "mpi": dist.is_mpi_available}
    return [name for name, available in flags.items() if available()]


def describe_devices() -> str:
    """The CUDA devices this process can see, with names and physical indices."""
    found = cuda_devices()
    visible = visible_cuda_devices()
    note = f" (CUDA_VISIBLE_DEVICES={','.join(visible)} renumbers them from 0)" if visible is not None else ""
    if not found:
        return f"no CUDA device is visible{note}; accelerator='cpu' runs one process per devices=N"
    listed = ", ".join(f"cuda:{d.index} {d.name} (physical GPU {d.physical})" for d in found)
    return f"{len(found)} CUDA device(s) visible{note}: {listed}"


def check_devices(devices: Sequence[torch.device], backend: str | None) -> None:
    """Raise ``ValueError`` for a device choice or backend that cannot run on this machine.

    Raises:
        ValueError: A CUDA index that does not exist or appears twice, an unknown or
            unavailable backend, or NCCL for devices that are not CUDA devices.
    """
    cuda = [d for d in devices if d.type == "cuda"]
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
    others = sorted({d.type for d in devices if d.type != "cuda"})
    if backend.lower() == "nccl" and others:
        raise ValueError(
            f"process_group_backend='nccl' needs CUDA devices, but this run uses {', '.join(others)} devices."
            f" Pass accelerator='gpu' ({describe_devices()}) or process_group_backend='gloo',"
            " or leave it unset to get NCCL on CUDA devices and gloo elsewhere."
        )
