"""``mgpu_ddp``: Lightning's DDP with the defaults and safety nets that multi-GPU users expect."""

from __future__ import annotations

import itertools
import os
import socket
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.data import _is_dataloader_shuffled
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_mgpu.devices import cpu_name, visible_cuda_devices
from lightning_mgpu.strategies.ddp import checks
from lightning_mgpu.strategies.ddp.errors import (
    UNUSED_PATTERN,
    add_to_message,
    is_communication_error,
    unused_parameters_message,
)
from lightning_mgpu.strategies.ddp.launcher import _WatchedSubprocessScriptLauncher
from lightning_mgpu.strategies.ddp.summary import format_summary, launcher_name
from lightning_mgpu.strategies.ddp.watchdog.verdicts import RankInfo
from lightning_mgpu.strategies.ddp.watchdog.watchdog import DEAD_AFTER, INTERVAL, watchdog

if TYPE_CHECKING:
    import lightning.pytorch as pl

_RUNS = itertools.count()


def _loop_progress(trainer: pl.Trainer) -> int:
    """Sum of Lightning's epoch and batch counters over its loops: they move between our hooks."""
    total = 0
    try:
        fit = trainer.fit_loop
        loops = (fit, fit.epoch_loop, fit.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop)
        for loop in (*loops, trainer.predict_loop):
            for name in ("epoch_progress", "batch_progress"):
                counts = getattr(getattr(loop, name, None), "total", None)
                for field in ("ready", "started", "processed", "completed"):
                    total += getattr(counts, field, 0)
    except Exception:  # read from another thread while the trainer changes: best effort
        pass
    return total


class MGPUDDPStrategy(DDPStrategy):
    """Distributed data parallel training, one process per device, on one or several machines.

    Takes every argument of Lightning's ``DDPStrategy`` (``find_unused_parameters``,
    ``process_group_backend``, ``timeout``, ``static_graph``, ...) and adds:

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

    Args:
        *args: Positional arguments of ``DDPStrategy``.
        stall_timeout: Seconds without progress on every rank (while some ranks wait in a
            collective for the others) after which the run stops. Set it above your slowest
            step, validation batch and checkpoint save. ``None`` turns stall detection off.
        **kwargs: Keyword arguments of ``DDPStrategy``, including the ones it passes on to
            ``torch.nn.parallel.DistributedDataParallel``.

    Raises:
        ValueError: If ``stall_timeout`` is not a positive number or ``None``.

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

    def __init__(self, *args: Any, stall_timeout: float | None = 300.0, **kwargs: Any) -> None:
        number = isinstance(stall_timeout, (int, float)) and not isinstance(stall_timeout, bool)
        if stall_timeout is not None and (not number or stall_timeout <= 0):
            raise ValueError(
                f"stall_timeout must be a positive number of seconds or None (no stall detection),"
                f" got {stall_timeout!r}"
            )
        super().__init__(*args, **kwargs)
        self.stall_timeout = None if stall_timeout is None else float(stall_timeout)
        self._progress = 0
        self._watching = False
        self._summary_printed = False
        self._batch_size: int | None = None

    # ------------------------------------------------------------ set-up
    @override
    def _configure_launcher(self) -> None:
        # runs inside Trainer(...), before any process starts
        checks.check_devices(self.parallel_devices or [], self._process_group_backend)
        if self._start_method == "popen":
            assert self.cluster_environment is not None
            self._launcher = _WatchedSubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            super()._configure_launcher()

    @override
    def _get_process_group_backend(self) -> str:
        if self._process_group_backend:
            return self._process_group_backend
        return checks.default_backend(self.root_device)

    @override
    def setup_environment(self) -> None:
        # under the spawn/fork launchers the ranks are only set later, in setup_distributed
        self.set_world_ranks()
        self._watching = self.world_size > 1
        if self._watching:
            watchdog().start(self.global_rank, self.local_rank)
        super().setup_environment()
        if self._watching:
            self._attach_watchdog()

    def _attach_watchdog(self) -> None:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        try:
            client = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=timedelta(seconds=DEAD_AFTER),
                wait_for_workers=False,
            )
        except (KeyError, ValueError, RuntimeError) as err:
            rank_zero_warn(
                f"{self.strategy_name}: cannot reach the run's store ({err}); dead or stalled ranks on other"
                " machines will not be detected, only those on this machine"
            )
            return
        # a fresh key space per run: a later fit/test, or a torchrun restart, starts clean
        store = dist.PrefixStore(f"lightning_mgpu/{restart}/{next(_RUNS)}/", client)
        watchdog().attach(store, self.world_size, self._rank_info(), self._progress_count, self.stall_timeout)

    def _rank_info(self) -> RankInfo:
        device = self.root_device
        if device.type == "cuda":
            index = device.index or 0
            name = torch.cuda.get_device_name(index)
            visible = visible_cuda_devices()
            if visible is not None and index < len(visible):
                name += f" (physical GPU {visible[index]})"
        elif device.type == "cpu":
            name = cpu_name()
        else:
            name = device.type.upper()
        return RankInfo(
            rank=self.global_rank,
            pid=os.getpid(),
            parent_pid=os.getppid(),
            host=socket.gethostname(),
            node_rank=self.node_rank,
            local_rank=self.local_rank,
            device=str(device),
            device_name=name,
        )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._keep_user_shuffle(trainer)
        super().setup(trainer)

    def _keep_user_shuffle(self, trainer: pl.Trainer) -> None:
        """Let the training sampler shuffle only when the user's ``DataLoader`` did.

        Lightning builds the ``DistributedSampler`` in ``_DataConnector._prepare_dataloader``
        and passes ``shuffle=True`` for every training loader. The original loader is only
        visible there, so this trainer's connector gets the shuffle its loader had.
        """
        connector = trainer._data_connector
        original = getattr(type(connector), "_prepare_dataloader", None)
        if original is None:
            rank_zero_warn(
                f"{self.strategy_name}: this Lightning version has no `_prepare_dataloader`; the training"
                " sampler shuffles even if the DataLoader did not"
            )
            return
        if "_prepare_dataloader" in vars(connector):
            return  # installed by an earlier fit/validate/test of this trainer

        def prepare(dataloader: object, shuffle: bool, mode: RunningStage) -> object:
            if isinstance(dataloader, DataLoader) and mode in (RunningStage.TRAINING, trainer.state.stage):
                sampler = dataloader.batch_sampler
                self._batch_size = dataloader.batch_size or getattr(sampler, "batch_size", None)
            if mode == RunningStage.TRAINING and isinstance(dataloader, DataLoader):
                shuffle = _is_dataloader_shuffled(dataloader)
            return original(connector, dataloader, shuffle=shuffle, mode=mode)

        connector._prepare_dataloader = prepare  # type: ignore[method-assign]

    def _trainer(self) -> pl.Trainer | None:
        # the module's ``trainer`` property raises while it is not attached
        return getattr(self.lightning_module, "_trainer", None)

    # --------------------------------------------------------- summary
    def _print_summary(self) -> None:
        if self._summary_printed or self.global_rank != 0:
            return
        self._summary_printed = True
        infos = watchdog().infos() if self._watching else {}
        if not infos:
            infos = {self.global_rank: self._rank_info()}
        trainer = self._trainer()
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        text = format_summary(
            name=self.strategy_name,
            infos=infos,
            num_nodes=self.num_nodes,
            processes_per_node=self.num_processes,
            backend=self._process_group_backend or self._get_process_group_backend(),
            launcher=launcher_name(self.cluster_environment),
            batch_size=self._batch_size,
            accumulate=trainer.accumulate_grad_batches if fitting and trainer is not None else 1,
        )
        rank_zero_info(text)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._print_summary()

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        trainer = self._trainer()
        if trainer is not None and trainer.state.fn == TrainerFn.VALIDATING:
            self._print_summary()

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._print_summary()

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._print_summary()

    # ------------------------------------------------ progress for the watchdog
    def _progress_count(self) -> int:
        """This rank's progress for the watchdog: Lightning's own epoch and batch counters (read
        from the watchdog thread, never written) plus the backward passes and collectives that
        go through the strategy, which tell a rank waiting there from one stuck before it."""
        trainer = self._trainer()
        return self._progress + (_loop_progress(trainer) if trainer is not None else 0)

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        # the gradient all-reduce waits inside backward
        self._progress += 1
        super().pre_backward(closure_loss)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._progress += 1
        super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._progress += 1
        return super().broadcast(obj, src)

    @override
    def reduce(self, *args: Any, **kwargs: Any) -> Any:
        self._progress += 1
        return super().reduce(*args, **kwargs)

    @override
    def all_gather(self, *args: Any, **kwargs: Any) -> Any:
        self._progress += 1
        return super().all_gather(*args, **kwargs)

    # ---------------------------------------------------------- failures
    @override
    def on_exception(self, exception: BaseException) -> None:
        if UNUSED_PATTERN in str(exception):
            text = unused_parameters_message(str(exception), self.model, self.strategy_name)
            add_to_message(exception, text, replace=True)
        if not self._watching:
            return
        dog = watchdog()
        dog.quiet_sigterm()
        if is_communication_error(exception):
            # a peer went away: wait for the watchdog to learn which one and how
            verdict = dog.wait_for_verdict(DEAD_AFTER + 2 * INTERVAL)
            if verdict is not None and verdict.origin != self.global_rank:
                add_to_message(exception, f"[rank {self.global_rank}] stopped because {verdict.message}.")
                return
        first_line = (str(exception).strip().splitlines() or [""])[0]
        where = f"pid {os.getpid()} on {socket.gethostname()}"
        error = f"{type(exception).__name__}: {first_line}"
        dog.report_own_error(f"rank {self.global_rank} ({where}) failed with {error}")

    @override
    def teardown(self) -> None:
        if self._watching:
            watchdog().detach()
            self._watching = False
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
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
