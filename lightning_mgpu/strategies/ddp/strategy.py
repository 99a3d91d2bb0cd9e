"""``mgpu_ddp``: Lightning's DDP with the defaults and safety nets that multi-GPU users expect."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_mgpu._compat.lightning import StrategyRegistry
from lightning_mgpu.strategies.ddp.unused import UNUSED_PATTERN, unused_parameters_message
from lightning_mgpu.strategies.microbatch.mixin import MicroBatching
from lightning_mgpu.strategies.process_group.errors import add_to_message
from lightning_mgpu.strategies.process_group.services import STALL_TIMEOUT, ProcessGroupServices

if TYPE_CHECKING:
    from lightning.pytorch.accelerators import Accelerator


class MGPUDDPStrategy(MicroBatching, ProcessGroupServices, DDPStrategy):
    """Distributed data parallel training, one process per device, on one or several machines.

    Takes every argument of Lightning's ``DDPStrategy`` (``process_group_backend``, ``timeout``,
    ``start_method``, and through ``**kwargs`` those of ``DistributedDataParallel``:
    ``find_unused_parameters``, ``static_graph``, ...) and adds ``stall_timeout`` and
    ``micro_batch_size``. What it does beyond ``DDPStrategy``:

    - NCCL on CUDA devices, gloo on CPU and wherever NCCL is missing; an explicit
      ``process_group_backend`` wins.
    - A start-up summary printed once by rank 0: nodes, processes per node, devices with
      their names, backend, launcher (Lightning's, torchrun or SLURM), batch sizes.
    - The training ``DataLoader``'s ``shuffle`` is kept: Lightning's ``ddp`` always
      shuffles, so ``shuffle=False`` here sees the same global batches as one device.
    - No silent death and no endless hang: when a rank dies (exception, ``os._exit``,
      SIGKILL), stalls for ``stall_timeout`` seconds while the others wait, or gets
      SIGTERM, every rank stops within seconds; the error names the rank and its exit
      code or signal, and a stuck rank prints its Python stack.
    - DDP's "Expected to have finished reduction" error names the parameters that got no
      gradient and gives both fixes.
    - Device choices are checked before any process starts, with the devices that exist.
    - A run cut anywhere goes on as if it had not been: restarted by torchrun's
      ``--max-restarts`` or SLURM's requeue, a ``fit`` without ``ckpt_path`` resumes from the
      newest complete checkpoint, at the next sample of the epoch (``resume``), and such runs
      save a resumable checkpoint every 30 minutes (``checkpoint_every``).

    Args:
        accelerator: As for ``DDPStrategy``; the Trainer sets it.
        parallel_devices: As for ``DDPStrategy``; the Trainer sets it from ``devices``.
        cluster_environment: As for ``DDPStrategy`` (torchrun, SLURM, ... are detected).
        checkpoint_io: As for ``DDPStrategy``.
        precision_plugin: As for ``DDPStrategy``; the Trainer sets it from ``precision``.
        ddp_comm_state: As for ``DDPStrategy``: the state of a DDP communication hook.
        ddp_comm_hook: As for ``DDPStrategy``: a DDP communication hook (gradient compression).
        ddp_comm_wrapper: As for ``DDPStrategy``: a wrapper for ``ddp_comm_hook``.
        model_averaging_period: As for ``DDPStrategy`` (post-local SGD).
        process_group_backend: ``"nccl"``, ``"gloo"``, ...; ``None`` picks NCCL on CUDA, gloo elsewhere.
        timeout: How long a collective may wait for the other ranks before torch gives up.
        start_method: How Lightning starts the ranks: ``"popen"`` (the script runs again per rank,
            watched by the watchdog), ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        stall_timeout: Seconds without progress on every rank (while some ranks wait in a
            collective for the others) after which the run stops. Set it above your slowest
            step, validation batch and checkpoint save. ``None`` turns stall detection off.
        resume: Whether a ``fit`` without ``ckpt_path`` resumes from the run's newest complete
            checkpoint: ``None`` only on a restart (torchrun's ``--max-restarts``, a requeued
            SLURM job), ``True`` always, ``False`` never.
        checkpoint_every: A resumable checkpoint every that many steps (``int``) or that often
            (``timedelta``) in ``<default_root_dir>/resume``; ``"auto"``: every 30 minutes where
            the run can be restarted; ``None``: never.
        requeue_on_failure: Under SLURM, requeue the job after a failed task (a rank killed, an
            error), at most this many times in the job's life, and only after an attempt that
            trained (0: never).
        micro_batch_size: ``None`` (off), a number of rows, or ``"auto"``: each training batch
            runs as micro-batches with one optimizer step (validation, test and predict batches
            too, forward only); under ``"auto"`` an out-of-memory on any rank reruns the batch in
            smaller ones instead of ending the run (see
            ``lightning_mgpu.strategies.microbatch.MicroBatching``).
        **kwargs: Keyword arguments that ``DDPStrategy`` passes on to
            ``torch.nn.parallel.DistributedDataParallel`` (``find_unused_parameters``, ...).

    Raises:
        ValueError: If ``stall_timeout`` is not a positive number or ``None``, or
            ``micro_batch_size`` is not a positive int, ``"auto"`` or ``None``.

    Example::

        # run as a script (python train.py), not at a prompt: every process re-runs the script
        import lightning as L
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset

        from lightning_mgpu import MGPUDDPStrategy  # also registers "mgpu_ddp"

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
        strategy = MGPUDDPStrategy(stall_timeout=120)  # or strategy="mgpu_ddp" (300 s)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1)
        # on GPUs 0 and 3: L.Trainer(accelerator="gpu", devices=[0, 3], strategy="mgpu_ddp")
        trainer.fit(Net(), train_dataloaders=loader)
    """

    strategy_name = "mgpu_ddp"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        ddp_comm_state: object | None = None,
        ddp_comm_hook: Callable[..., Any] | None = None,
        ddp_comm_wrapper: Callable[..., Any] | None = None,
        model_averaging_period: int | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        *,
        stall_timeout: float | None = STALL_TIMEOUT,
        micro_batch_size: int | str | None = None,
        resume: bool | None = None,
        checkpoint_every: int | timedelta | str | None = "auto",
        requeue_on_failure: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(  # Lightning's DDPStrategy: the mixins before it take no argument
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            ddp_comm_state=ddp_comm_state,
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_wrapper=ddp_comm_wrapper,
            model_averaging_period=model_averaging_period,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        self._init_services(
            stall_timeout=stall_timeout,
            resume=resume,
            checkpoint_every=checkpoint_every,
            requeue_on_failure=requeue_on_failure,
        )
        self._init_micro_batching(micro_batch_size)

    # ---------------------------------------------------------- failures
    # DDP raises its unused-parameter error in the forward of the next step, or under manual
    # optimization in the next manual_backward; it is explained there, in the rank, where the
    # model is still wrapped. Under start_method="spawn" the launching process only sees the
    # error after the rank ended, through torch.multiprocessing, with the rank's traceback.
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._unused_parameters_explained():
            return super().training_step(*args, **kwargs)

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        with self._unused_parameters_explained():
            super().pre_backward(closure_loss)

    @contextlib.contextmanager
    def _unused_parameters_explained(self) -> Iterator[None]:
        try:
            yield
        except RuntimeError as error:
            self._explain_unused_parameters(error)
            raise

    def _explain_unused_parameters(self, exception: BaseException) -> None:
        if UNUSED_PATTERN not in str(exception):
            return
        module = self.lightning_module
        manual = module is not None and not module.automatic_optimization
        text = unused_parameters_message(str(exception), self.model, self.strategy_name, manual)
        # DDP's own error is replaced; one that carries it inside (a spawned rank's traceback) keeps it
        add_to_message(exception, text, replace=str(exception).lstrip().startswith(UNUSED_PATTERN))

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._explain_unused_parameters(exception)  # raised outside the hooks above
        super().on_exception(exception)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="DDP that keeps the user's shuffle, names dead or stalled ranks and never hangs",
            override=True,
        )
        strategy_registry.register(
            f"{cls.strategy_name}_find_unused_parameters_true",
            cls,
            description="mgpu_ddp with find_unused_parameters=True",
            find_unused_parameters=True,
            override=True,
        )
