"""``mgpu_fsdp``: each process holds 1/N of the model state (FSDP2), sharded without a ``configure_model``.

Built on Lightning's ``ModelParallelStrategy``, whose ``setup`` refuses a LightningModule without
``configure_model``: ``MGPUFSDPStrategy.setup`` runs Lightning's own steps, with Lightning's own helpers,
after sharding the model itself.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from lightning_mgpu._compat.lightning import (
    PATH,
    StrategyRegistry,
    attached_trainer,
    forward_redirection,
    materialize_distributed_module,
    optimizers_to_device,
    set_device_mesh,
    set_fsdp_only_mesh,
)
from lightning_mgpu._sharding.plan import ShardingPlan, plan_sharding, validate_block_classes
from lightning_mgpu.devices import format_bytes
from lightning_mgpu.estimate.model_state import measure_model_state
from lightning_mgpu.strategies.fsdp.collectives import SyncPoints, Watched, watch_buffers
from lightning_mgpu.strategies.fsdp.gloo_average import average_gradients_exactly
from lightning_mgpu.strategies.fsdp.mesh import shared_mesh
from lightning_mgpu.strategies.fsdp.need import check_model_fits
from lightning_mgpu.strategies.fsdp.saving import saving_over_own
from lightning_mgpu.strategies.fsdp.sharding import (
    ShardingOptions,
    apply_plan,
    broadcast_from_rank0,
    check_for_run,
    describe,
    is_sharded,
    mixed_precision_policy,
)
from lightning_mgpu.strategies.microbatch.mixin import STEP_CONTEXTS, MicroBatching
from lightning_mgpu.strategies.process_group.services import STALL_TIMEOUT, ProcessGroupServices

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["MGPUFSDPStrategy"]

log = logging.getLogger(__name__)

_PLAN_ATTRIBUTE = "_mgpu_fsdp_plan"
"""Set on a model sharded by a plan, so that later stages and Trainers keep it."""


def _user_class(module: nn.Module) -> str:
    """The model's own class name; ``fully_shard`` swaps in a subclass named ``FSDP<name>``."""
    cls = next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))
    return cls.__name__


class MGPUFSDPStrategy(MicroBatching, ProcessGroupServices, ModelParallelStrategy):
    """Fully sharded data parallel training (torch's FSDP2): each process keeps 1/N of the model state.

    Each process holds a shard of every parameter, of its gradient and of the optimizer
    state, and gathers one block's parameters at a time for its forward and backward. Built
    on Lightning's ``ModelParallelStrategy`` (its launcher, device mesh and sharded
    checkpoints), with everything ``mgpu_ddp`` adds: the start-up summary (here with the
    sharding plan and the bytes of model state per process), the user's ``shuffle`` kept,
    the watchdog, the backend by device and the device checks before any process starts.

    - **Automatic sharding**: a LightningModule without ``configure_model`` needs nothing:
      each repeated block (the same-class entries of an ``nn.ModuleList`` / ``nn.Sequential``,
      transformer blocks, ResNet blocks, user-defined stages; the policy in full is in
      ``lightning_mgpu/_sharding/plan.py``) is sharded, then the root. ``block_classes``
      names the blocks instead. A ``configure_model`` that calls ``fully_shard`` itself is
      left as it is; one that only builds layers is sharded afterwards.
    - **Mixed precision from the Trainer**: ``precision="bf16-mixed"`` gathers the parameters
      in bfloat16 and reduces gradients in float32, the shards and the optimizer step staying
      in float32; ``"bf16-true"`` / ``"16-true"`` keep the whole model in that dtype.
    - **Same start as DDP**: rank 0's weights are broadcast before sharding, so ranks that
      built the model from different seeds train one model.
    - **Refused early on GPUs**: a model whose parameter and gradient shards plus its largest
      unit exceed a device's memory fails before anything moves, with the numbers and the
      fewest devices that would hold it (``fsdp/need.py``).

    Args:
        block_classes: The classes (or class names) of the blocks to shard one by one, e.g.
            ``[Block]`` or ``["Block"]``; ``None`` uses the automatic policy.
        reshard_after_forward: ``True`` frees each block's gathered parameters after its
            forward (least memory); ``False`` keeps them until its backward (less
            communication); an int reshards over that many processes (a divisor of the
            process count, between 1 and it).
        cpu_offload: Keep the parameter shards, gradients and optimizer state in CPU memory
            and copy each block to the GPU when it runs (for GPUs only).
        activation_checkpointing: Recompute each block's activations in the backward
            instead of keeping them from the forward.
        save_distributed_checkpoint: ``True`` saves a folder with one file per process
            (``torch.distributed.checkpoint``); ``False`` gathers one full file on rank 0.
        process_group_backend: ``"nccl"``, ``"gloo"``, ...; by default NCCL on CUDA, gloo on CPU.
        timeout: Timeout of the process group's collectives.
        stall_timeout: Seconds without progress on every rank after which the run stops
            (see ``MGPUDDPStrategy``); ``None`` turns stall detection off.
        resume: As for ``MGPUDDPStrategy``: a restarted ``fit`` resumes by itself.
        checkpoint_every: As for ``MGPUDDPStrategy``: a resumable checkpoint every N steps or minutes.
        requeue_on_failure: As for ``MGPUDDPStrategy``: requeue a SLURM job after a failed task.
        micro_batch_size: ``None`` (off), a number of rows, or ``"auto"``: each training batch
            runs as micro-batches with one optimizer step (validation, test and predict batches
            too, forward only), ``"auto"`` running the batch again in
            smaller ones after an out-of-memory (``lightning_mgpu.strategies.microbatch.MicroBatching``).
            Every rank runs the same number of micro-batches, because each one gathers the
            parameters collectively: a rank that needs more splits every rank's batch as finely.
            Gradients are reduce-scattered after each micro-batch's backward (they stay sharded:
            no whole copy builds up). Under ``"auto"`` each rank announces each of FSDP's collectives
            before it enters it (one small all-reduce nothing waits for, until a step of that kind ran
            clean) (``fsdp/collectives.py``), so an out-of-memory on one rank, in
            forward, backward or FSDP's own buffers, leaves no rank waiting. One inside a collective
            itself stops every rank within seconds (``CollectiveOutOfMemoryError``).

    Raises:
        TypeError: If ``block_classes``, ``reshard_after_forward``, ``cpu_offload`` or
            ``activation_checkpointing`` has the wrong type.
        RuntimeError: Inside ``Trainer(...)``: CPU devices on torch 2.6, where FSDP2 cannot run on CPU.
            In ``setup``: gloo on torch 2.7, whose reduce-scatter sums when asked to average
            (``fsdp/gloo_average.py``; corrected on 2.8, right from 2.9).
        ValueError: Inside ``Trainer(...)``: ``cpu_offload`` on CPU devices, a
            ``reshard_after_forward`` count that does not divide the processes, or a precision
            FSDP2 cannot run. In ``setup``, before training: a model without parameters,
            ``block_classes`` that match nothing, sharding options beside a ``configure_model``
            that shards itself, ``activation_checkpointing`` without blocks, a model no GPU of
            this count can hold. At the first step under ``micro_batch_size="auto"``: a model sharded
            only in parts by its ``configure_model``, or a unit of several parameter groups.

    Example::

        # run as a script (python train.py): every process re-runs the script
        import lightning as L
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset

        import lightning_mgpu  # registers "mgpu_fsdp"

        class Net(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.layers = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
            def training_step(self, batch, batch_idx):
                x, y = batch
                return nn.functional.mse_loss(self.layers(x), y)
            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=1e-3)

        loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=16)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="mgpu_fsdp", max_epochs=1)
        # on GPUs: strategy=MGPUFSDPStrategy(activation_checkpointing=True), precision="bf16-mixed"
        trainer.fit(Net(), train_dataloaders=loader)
    """

    strategy_name = "mgpu_fsdp"
    _watched: Watched | None = None

    def __init__(
        self,
        block_classes: Any = None,
        *,
        reshard_after_forward: bool | int = True,
        cpu_offload: bool = False,
        activation_checkpointing: bool = False,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        stall_timeout: float | None = STALL_TIMEOUT,
        micro_batch_size: int | str | None = None,
        resume: bool | None = None,
        checkpoint_every: int | timedelta | str | None = "auto",
        requeue_on_failure: int = 0,
    ) -> None:
        self.block_classes = validate_block_classes(block_classes)
        self.options = ShardingOptions(reshard_after_forward, cpu_offload, activation_checkpointing)
        # the options for the automatic sharding, which a configure_model that shards itself cannot take
        self._given = (["block_classes"] if block_classes is not None else []) + self.options.changed()
        super().__init__(  # Lightning's ModelParallelStrategy: the mixins before it take no argument
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._init_services(
            stall_timeout=stall_timeout,
            resume=resume,
            checkpoint_every=checkpoint_every,
            requeue_on_failure=requeue_on_failure,
        )
        self._init_micro_batching(micro_batch_size)
        self._sync_points: SyncPoints | None = None
        self._saved_checkpoints: set[str] = set()
        self.plan: ShardingPlan | None = None
        """The plan applied by the last ``setup``; ``None`` before, and when ``configure_model`` shards."""

    # ------------------------------------------------------------ checks
    @override
    def _configure_launcher(self) -> None:
        # runs inside Trainer(...), before any process starts
        precision = getattr(self.precision_plugin, "precision", "32-true")
        check_for_run(
            self.options, self.parallel_devices or [], self.num_nodes * self.num_processes, precision
        )
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        set_fsdp_only_mesh(self)  # one data-parallel dimension over every process
        super().setup_environment()
        # Lightning builds a new mesh, with new process groups, for every fit: the process keeps one
        set_device_mesh(self, shared_mesh(self.device_mesh))

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._check_micro_batching(trainer)
        # Lightning's ModelParallelStrategy.setup, which needs a configure_model, in its order after sharding
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._shard_model(trainer)
        # gloo on torch 2.7/2.8 sums where FSDP asks for an average (pytorch/pytorch#162338)
        average_gradients_exactly(self.model, self.device_mesh["data_parallel"].get_group())
        # FSDP's own buffers say which one ran out (fsdp/collectives.py); DeviceTimeMonitor reads their time
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

    @property
    def collective_seconds(self) -> float | None:
        """Host seconds this rank spent inside FSDP's all-gathers and reduce-scatters since ``setup``.

        ``None`` before ``setup``, or when some unit's collectives could not be watched
        (``collectives.watch_buffers``): a sum that misses some would read as less waiting than there was.
        """
        if self._watched is None or self._watched.unwatched or not self._watched.collectives:
            return None
        return sum(collective.seconds for collective in self._watched.collectives)

    # ----------------------------------------------------------- sharding
    def _shard_model(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        assert module is not None
        applied = getattr(module, _PLAN_ATTRIBUTE, None)
        if applied is not None:  # a later fit/validate/test/predict of this model, maybe by another Trainer
            self.plan = applied
            return
        if is_sharded(module):
            if self._given:
                raise ValueError(
                    f"{self.strategy_name}: {_user_class(module)}.configure_model calls fully_shard itself,"
                    f" so {', '.join(self._given)} (for the automatic sharding) cannot apply. Pass these"
                    f" options to your own fully_shard calls, or remove them from {type(self).__name__}(...)."
                )
            self.plan = None
            log.info("%s: the model's configure_model sharded it; its sharding is kept", self.strategy_name)
            return
        plan = plan_sharding(module, self.block_classes)
        if self.options.activation_checkpointing and not plan.blocks:
            raise ValueError(
                f"{self.strategy_name}: activation_checkpointing=True checkpoints the model's blocks, but no"
                f" repeated block was found in {type(module).__name__}. Name the block classes with"
                " block_classes=[...], or remove activation_checkpointing=True."
            )
        precision = getattr(self.precision_plugin, "precision", "32-true")
        if precision.endswith("-true"):
            # the shards take the model's dtype: convert first (Lightning's convert_module is then a no-op)
            self.precision_plugin.convert_module(module)  # in place: nn.Module.to
        if self.root_device.type == "cuda":
            offloaded = self.options.cpu_offload
            check_model_fits(module, plan, precision, self.world_size, self.root_device, offloaded)
        broadcast_from_rank0(module, self.root_device)
        mesh = self.device_mesh["data_parallel"]
        pin = self.root_device.type == "cuda"
        apply_plan(module, plan, mesh, self.options, mixed_precision_policy(precision), pin_memory=pin)
        self.plan = plan
        setattr(module, _PLAN_ATTRIBUTE, plan)
        log.info(
            "%s: %s by the %s", self.strategy_name, plan.describe(limit=len(plan.blocks)), plan.chosen_by
        )

    @override
    def model_to_device(self) -> None:
        if self.options.cpu_offload and self.plan is not None:
            return  # fully_shard put the buffers on the device and keeps the parameter shards in CPU memory
        super().model_to_device()

    # ------------------------------------------------------------- steps
    @override
    def _unbatched_step(self, stage: str, *args: Any, **kwargs: Any) -> Any:
        """Run the LightningModule's ``stage`` step through its ``__call__`` when the module itself is a unit.

        FSDP2 gathers a unit's parameters in hooks around its ``forward``, and Lightning calls
        ``training_step`` directly, so the root unit (the LightningModule: embeddings, heads,
        whatever no block holds) would never be gathered. Lightning's forward redirection
        calls the step from inside the module's ``forward``, where the hooks run.
        """
        module = self.lightning_module
        if not isinstance(module, FSDPModule) or self.model is not module:
            return super()._unbatched_step(stage, *args, **kwargs)
        with getattr(self.precision_plugin, STEP_CONTEXTS[stage])():
            return forward_redirection(self)(module, module, stage, *args, **kwargs)

    @property
    @override
    def collective_passes(self) -> SyncPoints:
        """What micro-batching needs of a sharded model: ranks in step, announcements under ``"auto"``."""
        if self._sync_points is None or self._sync_points.root is not self.model:
            if self._sync_points is not None:
                self._sync_points.remove()
            assert self.model is not None
            self._sync_points = SyncPoints(self.model)
        return self._sync_points

    # ------------------------------------------------------------ saving
    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PATH, storage_options: Any | None = None
    ) -> None:
        module = self.lightning_module
        resumed = (
            module.trainer.ckpt_path if module is not None and attached_trainer(module) is not None else None
        )
        with saving_over_own(filepath, self._saved_checkpoints, resumed):  # quiet over this run's own
            super().save_checkpoint(checkpoint, filepath, storage_options)

    # ------------------------------------------------------------ summary
    @override
    def _summary_extra_lines(self) -> list[str]:
        if self.model is None:
            return []
        precision = getattr(self.precision_plugin, "precision", "32-true")
        how = (
            "by the model's own configure_model"
            if self.plan is None
            else describe(self.plan, self.options, precision)
        )
        state = measure_model_state(self.model, self.optimizers)
        share = state.local.parameters / state.whole.parameters if state.whole.parameters else 1.0
        return [
            f"sharding: {how}",
            f"model state per process: parameters {format_bytes(state.local.parameters)} of"
            f" {format_bytes(state.whole.parameters)} ({share:.0%}) on rank {self.global_rank}; gradients and"
            " optimizer state are sharded alike",
        ]

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="FSDP2: each process holds 1/N of the model state; blocks sharded automatically",
            override=True,
        )
