"""``mgpu_dp``: DataParallel for Lightning 2.x, exact and checkpoint-clean, in one process."""

from __future__ import annotations

import logging
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor
from typing_extensions import override

from lightning_mgpu._compat.lightning import StrategyRegistry, strategy_parts
from lightning_mgpu.strategies.dp.step import ReplicaStep
from lightning_mgpu.strategies.microbatch.mixin import STEP_CONTEXTS, MicroBatching

log = logging.getLogger(__name__)


class MGPUDataParallelStrategy(MicroBatching, ParallelStrategy):
    """Data parallel training in one process: every step runs on a replica of the model per device.

    For each batch the strategy splits the batch along dim 0 (tensors inside nested tuples,
    lists, dicts, namedtuples and dataclasses, and lists or tuples of one item per row that hold
    no tensor, such as string ids, where ``nn.DataParallel`` hands every replica the whole list;
    anything else is handed to every replica; a list that is not one item per row is refused,
    and ``split_batch_rows`` on the LightningModule cuts such batches, see ``MicroBatching``),
    replicates the LightningModule on each device, runs ``training_step`` (or the
    validation / test / predict step) of every replica on its chunk in parallel threads,
    and combines the results on the first device. The optimizer is your plain optimizer and
    steps the module's own parameters; there is no wrapper, so checkpoints have exactly the
    keys of a single-device run and load back under ``mgpu_dp``, ``mgpu_ddp`` or one device.

    What one step on N devices equals:

    - **The loss.** Each replica's loss is weighted by its share of the batch, so with a
      mean-reduced loss one step changes the weights as one step on a single device with
      the whole batch, also when the batch does not divide evenly (a warning says so once)
      and when it has fewer rows than there are devices (fewer replicas run).
    - **Step outputs.** Per-sample tensors (first dimension = the replica's rows) are
      concatenated; floating-point values of equal shape are averaged by batch share;
      integer values (counts) are summed in their own dtype.
    - **``self.log``.** Calls made in replicas become one call: the mean of the replicas'
      values weighted by their rows (or by the ``batch_size`` they passed), or the sum / max /
      min when ``reduce_fx`` says so.
    - **torchmetrics.** Each replica updates its own copy of every ``Metric`` of the module;
      after the step the copies are merged into the module's metric (``merge_state``), so
      ``compute()`` equals the single-device value. Logging the metric object works too.
    - **BatchNorm** follows ``torch.nn.DataParallel``: in training each replica normalises
      with the statistics of its own chunk, and the running statistics are updated from the
      first replica's chunk only. Use ``mgpu_ddp`` with ``sync_batchnorm=True`` on GPUs
      (torch's SyncBatchNorm runs on CUDA only) for whole-batch statistics.
    - **When it is exact.** The equalities above hold (to float rounding) when a step does not
      depend on how the batch is cut: no dropout, or dropout seeded per sample (each replica
      draws its own masks), no BatchNorm in training mode (below), and a loss that is a mean
      over rows rather than a statistic of the chunk (a sum or a token mean: divide it with
      ``lightning_mgpu.global_mean``).
    - **Manual optimization.** ``manual_backward``, ``opt.step()``, ``opt.zero_grad()``,
      ``sch.step()``, ``clip_gradients`` and ``toggle_optimizer`` called inside the replicas
      happen once per step on the combined loss; every replica must call them in the same
      order.

    Submodules compiled with ``torch.compile`` run uncompiled inside the replicas (a warning
    says so once): compiled code is tied to the module object it was compiled for. A whole
    LightningModule passed compiled to ``fit`` is refused by Lightning for this strategy.

    Attributes set directly on ``self`` inside a step are set on the replica and do not
    reach the module (as with ``nn.DataParallel``); use ``self.log``, metrics or the step's
    return value. With ``accelerator="cpu", devices=N`` the same split / replicate /
    parallel-apply / gather path runs with N CPU replicas in threads, which share the
    intra-op threads (``torch.get_num_threads() // N`` each) instead of oversubscribing.

    Attributes:
        replica_devices: one ``torch.device`` per replica, the first holding the module.
        last_chunk_sizes: rows of the batch each replica got in the last step (fewer
            entries than devices when the batch was smaller; ``[0]`` when it held no tensor).
        track_replica_memory: when ``True``, every step records in ``replica_saved_bytes``
            the bytes of the tensors each replica saved for backward (activations and the
            weights layers keep), counted once per storage, measured with
            ``torch.autograd.graph.saved_tensors_hooks`` in the replica's thread. Off by
            default, and free when off.
        replica_saved_bytes: one entry per replica of the last step while tracking is on.

    Args:
        accelerator: set by the Trainer.
        parallel_devices: the devices, normally set by the Trainer from ``devices=``.
        checkpoint_io: set by the Trainer.
        precision_plugin: set by the Trainer.
        track_replica_memory: see above.
        micro_batch_size: ``None`` (off), rows, or ``"auto"``: training, validation, test and predict
            batches run as micro-batches, each spread over the replicas
            (``lightning_mgpu.strategies.microbatch.MicroBatching``).

    Raises:
        ValueError: with ``num_nodes > 1`` when the Trainer is built; with
            ``sync_batchnorm=True`` or devices of different types when ``fit`` (or
            ``validate``, ``test``, ``predict``) starts, not when the Trainer is built.

    Example::

        import lightning as L
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset

        import lightning_mgpu  # registers "mgpu_dp"

        class Net(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = nn.Linear(8, 1)
            def training_step(self, batch, batch_idx):
                x, y = batch
                return nn.functional.mse_loss(self.layer(x), y)
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=16)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="mgpu_dp", max_epochs=1)
        # on GPUs 0 and 3: L.Trainer(accelerator="gpu", devices=[0, 3], strategy="mgpu_dp")
        trainer.fit(Net(), train_dataloaders=loader)
    """

    strategy_name = "mgpu_dp"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        track_replica_memory: bool = False,
        micro_batch_size: int | str | None = None,
    ) -> None:
        super().__init__(  # Lightning's ParallelStrategy: MicroBatching takes no argument
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=None,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._init_micro_batching(micro_batch_size)
        self.track_replica_memory = track_replica_memory
        self.last_chunk_sizes: list[int] = []
        self.replica_saved_bytes: list[int] = []
        self._replicated = ReplicaStep()

    @property
    def replica_devices(self) -> list[torch.device]:
        """One device per replica; the module and the combined outputs live on the first."""
        if not self.parallel_devices:
            raise RuntimeError(
                "mgpu_dp has no devices yet: pass it to a Trainer, which sets them from `devices=`"
            )
        return list(self.parallel_devices)

    @property
    @override
    def root_device(self) -> torch.device:
        return self.replica_devices[0]

    @property
    def num_nodes(self) -> int:
        return 1

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        if num_nodes != 1:
            raise ValueError(
                f"mgpu_dp runs in one process on one machine, got `num_nodes={num_nodes}`."
                " Use `strategy='mgpu_ddp'` to train on several machines."
            )

    @property
    def is_distributed(self) -> bool:
        return False

    @property
    @override
    def global_rank(self) -> int:
        return 0

    @property
    @override
    def local_rank(self) -> int:
        return 0

    @property
    @override
    def node_rank(self) -> int:
        return 0

    @property
    @override
    def world_size(self) -> int:
        return 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}

    @override
    def setup_environment(self) -> None:
        if strategy_parts(self)[3] is not None:  # the layer sync: sync_batchnorm=True
            raise ValueError(
                "`sync_batchnorm=True` needs one process per device; mgpu_dp keeps nn.DataParallel's"
                " per-replica BatchNorm. Use `strategy='mgpu_ddp'` on GPUs for synchronised BatchNorm."
            )
        kinds = {d.type for d in self.replica_devices}
        if len(kinds) > 1:
            raise ValueError(f"mgpu_dp needs devices of one type, got {self.replica_devices}")
        super().setup_environment()

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        """Identity: outputs are already combined over the replicas of this single process."""
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return tensor

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    # each step runs over the replicas; micro-batching, when set, runs it once per micro-batch
    @override
    def _unbatched_step(self, stage: str, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        step_context = getattr(self.precision_plugin, STEP_CONTEXTS[stage])
        result = self._replicated.run(
            module, stage, step_context, args, kwargs, self.replica_devices, self.track_replica_memory
        )
        self.last_chunk_sizes = result.sizes
        self.replica_saved_bytes = result.saved_bytes
        return result.output

    def note_progress(self) -> None:
        """Nothing watches a one-process run's progress (micro-batching calls this after each micro-batch)."""

    @override
    def teardown(self) -> None:
        self._replicated.close()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="DataParallel in one process: exact, logs and metrics merged, plain checkpoint keys",
            override=True,
        )
