"""``ShardingModelParallel``: Lightning's ``ModelParallelStrategy`` whose ``setup`` shards the model itself.

The base of ``mgpu_fsdp``: Lightning's ``setup`` refuses a LightningModule without ``configure_model``;
this one runs Lightning's own steps, with Lightning's own helpers, after the subclass's ``_shard_model``.
Its ``setup_environment`` gives every fit of the process the same device mesh (``mesh.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_mgpu._compat.lightning import (
    materialize_distributed_module,
    optimizers_to_device,
    set_device_mesh,
)
from lightning_mgpu.strategies.fsdp.buffers import Watched, watch_buffers
from lightning_mgpu.strategies.fsdp.gloo_average import average_gradients_exactly
from lightning_mgpu.strategies.fsdp.mesh import shared_mesh

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ShardingModelParallel"]


class ShardingModelParallel(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` whose ``setup`` shards the model (``_shard_model``) itself.

    Lightning's ``setup`` refuses a LightningModule without ``configure_model``; this one runs
    the same steps, with Lightning's own helpers, after ``_shard_model``.
    """

    _watched: Watched | None = None

    def _shard_model(self, trainer: pl.Trainer) -> None:
        raise NotImplementedError

    @property
    def collective_seconds(self) -> float | None:
        """Host seconds this rank spent inside FSDP's all-gathers and reduce-scatters since ``setup``.

        ``None`` before ``setup``, or when some unit's collectives could not be watched
        (``buffers.watch_buffers``): a sum that misses some would read as less waiting than there was.
        """
        if self._watched is None or self._watched.unwatched or not self._watched.collectives:
            return None
        return sum(collective.seconds for collective in self._watched.collectives)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        # Lightning builds a new mesh, with new process groups, for every fit: the process keeps one
        set_device_mesh(self, shared_mesh(self.device_mesh))

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._shard_model(trainer)
        # gloo on torch 2.7/2.8 sums where FSDP asks for an average (pytorch/pytorch#162338)
        average_gradients_exactly(self.model, self.device_mesh["data_parallel"].get_group())
        # FSDP's own buffers say which one ran out (fsdp/buffers.py); DeviceTimeMonitor reads the time in them
        self._watched = watch_buffers(self.model)
        materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)
