"""The training script the resume tests run under torchrun and SLURM, cut and uncut.

``python fit.py STRATEGY FAULT OUT [REQUEUE_ON_FAILURE]``: 16 samples of 4 features, batches of 2
per rank on 2 ranks (4 steps an epoch), 3 epochs, shuffled; a ``ModelCheckpoint`` every 3 steps, as
a user writes it.
``FAULT`` is what the first attempt (torchrun's and SLURM's restart counts 0) suffers, rank 1 or
the saving rank SIGKILLed:

- ``none``: nothing, the uncut reference;
- ``step``: rank 1 at global step 5, in the middle of the second epoch (the step-3 checkpoint is
  the newest, from the middle of the first);
- ``save``: rank 0 in the middle of writing the step-6 checkpoint (half its bytes written in place,
  as on a file system without atomic rename) under ``mgpu_ddp``; rank 1 before writing its shard
  of the step-6 checkpoint under ``mgpu_fsdp`` (rank 0's shard written, no index);
- ``always``: rank 1 at global step 5 in every attempt;
- ``signal``: global step 5, in the middle of the second epoch, lasts on every rank until ``SIGUSR1``
  comes, as SLURM sends it before a time limit (``--signal=USR1@N``): the job saves and is requeued.

The environment may change the run's shape: ``FIT_DEVICES`` processes (2), ``FIT_BATCH`` rows per
process (2), ``FIT_MAX_STEPS`` (-1), ``FIT_EVERY`` steps between checkpoints (3; 4 puts one at each
epoch's end), ``FIT_WORKERS`` loader workers (0; ``FIT_WORKERS=2p``: 2, persistent),
``FIT_RESUME=1`` sets ``resume=True``, and ``FIT_MONITOR=1`` adds ``DeviceTimeMonitor``.

Rank 0 writes ``OUT``: the final weights and, from a callback whose state is saved in every
checkpoint, how many times each sample went through a training step that the final weights
include, per epoch.
"""

SCRIPT = r'''
import os, signal, sys, time
import torch, lightning as L
import lightning_mgpu  # registers the mgpu_* strategies
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

strategy_name, fault, out = sys.argv[1], sys.argv[2], sys.argv[3]
restarts = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
first_attempt = all(os.environ.get(name, "0") == "0" for name in restarts)
# FIT_DEVICES, FIT_BATCH, FIT_MAX_STEPS: another shape of the run; FIT_RESUME=1: resume=True
devices, batch_size = int(os.environ.get("FIT_DEVICES", "2")), int(os.environ.get("FIT_BATCH", "2"))
max_steps = int(os.environ.get("FIT_MAX_STEPS", "-1"))
every = int(os.environ.get("FIT_EVERY", "3"))
workers = os.environ.get("FIT_WORKERS", "0")
loader_options = {"num_workers": int(workers.rstrip("p")), "persistent_workers": workers.endswith("p")}
options = {"requeue_on_failure": int(sys.argv[4])} if len(sys.argv) > 4 else {}
if os.environ.get("FIT_RESUME") == "1":
    options["resume"] = True
classes = {"mgpu_ddp": lightning_mgpu.MGPUDDPStrategy, "mgpu_fsdp": lightning_mgpu.MGPUFSDPStrategy}
strategy = classes[strategy_name](**options) if options else strategy_name


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def wait_for_sigusr1(rank):
    open(f"waiting_rank{rank}", "w").close()
    came = []
    previous = signal.getsignal(signal.SIGUSR1)  # the strategy's, which defers Lightning's handling

    def note(signum, frame):
        came.append(signum)
        previous(signum, frame)

    signal.signal(signal.SIGUSR1, note)
    while not came:
        time.sleep(0.1)
    signal.signal(signal.SIGUSR1, previous)


class Indexed(Dataset):
    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(16, 4, generator=generator), torch.randn(16, 1, generator=generator)

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return i, self.x[i], self.y[i]


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        killed = fault == "always" or (fault == "step" and first_attempt)
        if killed and self.global_step == 5 and self.global_rank == 1:
            die()
        if fault == "signal" and first_attempt and self.global_step == 5:
            wait_for_sigusr1(self.global_rank)
        _, x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Visits(Callback):
    """Per epoch, how many times each sample went through a step (every rank's, kept by all)."""

    def __init__(self):
        self.visits = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        seen = trainer.strategy.all_gather(batch[0]).reshape(-1).tolist()
        epoch = self.visits.setdefault(trainer.current_epoch, [0] * 16)
        for i in seen:
            epoch[i] += 1

    def state_dict(self):
        return {"visits": self.visits}

    def load_state_dict(self, state):
        self.visits = {int(k): v for k, v in state["visits"].items()}


class HalfWrite(TorchCheckpointIO):
    """Writes in place, as a file system without atomic rename does; attempt 0 dies halfway at step 6."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        import io
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        data = buffer.getvalue()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            if first_attempt and checkpoint["global_step"] == 6:
                f.write(data[: len(data) // 2])
                f.flush()
                die()
            f.write(data)


if fault == "save" and strategy_name == "mgpu_fsdp" and first_attempt:
    write_data = dcp_filesystem.FileSystemWriter.write_data

    def dying_write_data(self, plan, planner):
        if int(os.environ["RANK"]) == 1 and "step=6" in str(self.path):
            die()
        return write_data(self, plan, planner)

    dcp_filesystem.FileSystemWriter.write_data = dying_write_data

timed = os.environ.get("FIT_MONITOR") == "1"
monitor = [lightning_mgpu.DeviceTimeMonitor(flush_every_n_steps=2)] if timed else []
plugins = [HalfWrite()] if fault == "save" and strategy_name == "mgpu_ddp" else []
visits = Visits()
trainer = L.Trainer(
    accelerator="cpu", devices=devices, strategy=strategy, max_epochs=3, max_steps=max_steps, logger=False,
    plugins=plugins,
    callbacks=[visits, ModelCheckpoint(dirpath="ckpts", every_n_train_steps=every)] + monitor,
    enable_progress_bar=False, enable_model_summary=False,
)
module = Regression()
trainer.fit(module, DataLoader(Indexed(), batch_size=batch_size, shuffle=True, **loader_options))
weights = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in module.state_dict().items()}
if trainer.global_rank == 0:
    torch.save({"weights": weights, "visits": visits.visits, "step": trainer.global_step}, out)
'''
