"""One device mesh per process group, so that a fit leaves no process group behind.

Lightning's ``ModelParallelStrategy.setup_environment`` builds a new ``DeviceMesh`` for every fit, and
with it new process groups (``init_device_mesh``): under ``mgpu_fsdp`` a one-rank group on each rank for
the ``tensor_parallel`` dimension, of size 1, and where CUDA exists and the backend is gloo a copy of the
world for ``data_parallel``. Nothing destroyed them: every fit left four more open files on each rank.

They cannot simply be destroyed at teardown: a model sharded by a fit keeps that fit's mesh in its
``DTensor`` parameters, and a later fit, test or state dict of it runs collectives there. So every fit over
the same process group gets the first fit's mesh (:func:`shared_mesh`), and the groups of the mesh just
built are destroyed before anything used them.
"""

from __future__ import annotations

import logging

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["shared_mesh"]

log = logging.getLogger(__name__)

_SHARED: DeviceMesh | None = None


def _alive(mesh: DeviceMesh) -> bool:
    """Whether every group of ``mesh`` still belongs to the current process group (none destroyed)."""
    try:
        for group in mesh.get_all_groups():
            dist.get_rank(group)
    except (ValueError, RuntimeError):
        return False
    return True


def _layout(mesh: DeviceMesh) -> tuple[object, ...]:
    return mesh.device_type, mesh.mesh_dim_names, mesh.mesh.tolist()


def shared_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh this process's fits share, in place of ``mesh``, which Lightning just built.

    - the first mesh built over a process group is kept and returned as it is;
    - a later one with the same device type, dimension names and ranks gets the kept one back, and its
      own process groups (not the default group, nor one the kept mesh holds) are destroyed at once;
    - a different one, or any once the kept mesh's groups were destroyed (a new default group), is
      kept in its place.
    """
    global _SHARED
    shared = _SHARED
    if shared is None or shared is mesh or _layout(shared) != _layout(mesh) or not _alive(shared):
        _SHARED = mesh
        return mesh
    kept = {id(group) for group in shared.get_all_groups()} | {id(dist.GroupMember.WORLD)}
    extra = [group for group in mesh.get_all_groups() if id(group) not in kept]
    for group in extra:
        dist.destroy_process_group(group)
    log.debug(
        "the device mesh of an earlier fit is reused; %d process group(s) built for this one destroyed",
        len(extra),
    )
    return shared
