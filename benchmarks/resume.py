"""What resuming by itself costs: the safety net's saves and per-step check, and a restart's time.

Usage::

    python benchmarks/resume.py                 # both parts, 2 CPU processes, a few minutes
    python benchmarks/resume.py cost --width 2048 --steps 60
    python benchmarks/resume.py restart

``cost``: one pair of processes (Lightning's launcher, gloo) trains the same MLP (``--width``:
about 3 x width^2 parameters, SGD with momentum, so a checkpoint of about 24 x width^2 bytes) in
blocks that take turns, so that the load of a shared machine hits all alike:

- ``off``: ``checkpoint_every=None``; ``off_again`` the same, to show the noise;
- ``armed``: ``checkpoint_every=timedelta(hours=1)``: the time checks of ``ResumeCheckpoint`` (a
  broadcast at steps rank 0 plans), which never save here;
- ``saving``: ``checkpoint_every=--every`` steps.

Rank 0 times every step but the first few of each block and prints the median step of each, the
per-step cost of the armed check (``armed`` - ``off``), the cost of one save (a saving step -
the median ``saving`` step), and what the default (a save every 30 minutes) costs per hour.

``restart``: ``torchrun --standalone --nproc-per-node=2 --max-restarts=1`` of a fit that saves
every 5 steps and whose rank 1 is SIGKILLed at step 12; prints the seconds from the kill to the
restarted processes' start (torchrun noticing and starting them again), and from there to their
first training step (imports, the process group, choosing and loading the checkpoint).
"""

# ruff: noqa: E402  (the clock starts before the imports, which a restart's time includes)
from __future__ import annotations

import time

STARTED = time.time()
"""When this process started, before its imports."""

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu  # noqa: F401  registers the mgpu_* strategies

WORLD = 2
BATCH = 16
SKIP = 3
"""Steps at the start of each block that are not timed (allocator warm-up)."""
MODES = ("off", "armed", "saving", "off_again")
"""``off_again`` runs ``off`` a second time: its difference to ``off`` is the noise of the measurement."""


class Regression(L.LightningModule):
    """An MLP of about 3 x width^2 parameters that records how long each step took, end to end."""

    def __init__(self, width: int, kill_at: int = -1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2 * width))
        self.kill_at = kill_at
        self.stamps: list[tuple[float, int]] = []
        self._last = 0.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
        if restarted and not self._last and self.global_rank == 0:
            Path("first_step").write_text(f"{time.time()} {STARTED}")
        if not restarted and self.global_step == self.kill_at and self.global_rank == 1:
            Path("killed").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_end(self, *args: Any) -> None:
        # after the callbacks' on_train_batch_end: the safety net's check and save are inside
        now = time.perf_counter()
        if self._last:
            self.stamps.append((now - self._last, self.global_step))
        self._last = now

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def fit(width: int, steps: int, every: Any, folder: Path, kill_at: int = -1) -> list[tuple[float, int]]:
    """One fit of ``steps`` steps on ``WORLD`` processes; (seconds, global step) of each step."""
    generator = torch.Generator().manual_seed(0)
    n = steps * BATCH * WORLD
    data = TensorDataset(
        torch.randn(n, width, generator=generator), torch.randn(n, 2 * width, generator=generator)
    )
    module = Regression(width, kill_at)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=lightning_mgpu.MGPUDDPStrategy(checkpoint_every=every),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=folder,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(data, batch_size=BATCH))
    return module.stamps if trainer.global_rank == 0 else []


def cost(args: argparse.Namespace) -> None:
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    save_steps: list[float] = []
    folder = Path(tempfile.mkdtemp(prefix="resume-bench-"))
    settings = {"off": None, "armed": timedelta(hours=1), "saving": args.every, "off_again": None}
    for round_ in range(args.rounds):
        for mode in MODES[round_ % len(MODES) :] + MODES[: round_ % len(MODES)]:
            stamps = fit(args.width, args.steps, settings[mode], folder / f"{mode}{round_}")[SKIP:]
            for seconds, step in stamps:
                saved = mode == "saving" and step % args.every == 0
                (save_steps if saved else times[mode]).append(seconds)
    if not save_steps:
        return  # rank 1
    median = {mode: statistics.median(values) for mode, values in times.items()}
    check = median["armed"] - median["off"]
    save = statistics.median(save_steps) - median["saving"]
    size = max(p.stat().st_size for p in folder.rglob("*.ckpt")) / 2**20
    per_hour = 2 * save + 3600 / median["off"] * max(check, 0.0)
    print(
        f"model: {3 * args.width**2 / 1e6:.1f}M parameters, checkpoint {size:.0f} MiB, {WORLD} CPU processes"
    )
    for mode in MODES:
        print(f"  {mode:9s} median step {median[mode] * 1000:8.2f} ms ({len(times[mode])} steps)")
    noise = median["off_again"] - median["off"]
    print(f"the armed check per step: {check * 1000:+.2f} ms ({check / median['off']:+.1%} of a step)")
    print(f"noise (off_again - off):  {noise * 1000:+.2f} ms ({noise / median['off']:+.1%} of a step)")
    print(f"one save: {save:.3f} s ({len(save_steps)} saves)")
    print(
        f"checkpoint_every='auto' (a save every 30 minutes): {per_hour:.1f} s per hour of training"
        f" ({per_hour / 3600:.2%}), of which the saves {2 * save:.1f} s"
    )


def restart(args: argparse.Namespace) -> None:
    folder = Path(tempfile.mkdtemp(prefix="resume-restart-"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    cmd += ["--max-restarts=1", str(Path(__file__).resolve()), "restart-worker", f"--width={args.width}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), *sys.path])}
    done = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True)
    (folder / "torchrun.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        sys.exit(f"the torchrun job failed ({done.returncode}):\n{done.stderr[-3000:]}")
    killed = float((folder / "killed").read_text())
    first_step, started = (float(v) for v in (folder / "first_step").read_text().split())
    print(f"restart (torchrun --max-restarts=1, {WORLD} CPU processes, width {args.width}):")
    print(f"  kill -> restarted process starts: {started - killed:6.2f} s (torchrun notices, stops, starts)")
    print(f"  start -> first training step:     {first_step - started:6.2f} s (imports, group, checkpoint)")
    print(f"  kill -> first training step:      {first_step - killed:6.2f} s (torchrun's log: {folder})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "part", nargs="?", choices=("both", "cost", "restart", "restart-worker"), default="both"
    )
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40, help="steps of each block")
    parser.add_argument("--every", type=int, default=10, help="steps between two saves in the saving blocks")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.part == "restart-worker":
        fit(args.width, 40, 5, Path.cwd(), kill_at=12)
    elif args.part == "cost":
        cost(args)
    elif args.part == "restart":
        restart(args)
    else:  # each part in processes of its own: Lightning's launcher runs this script again per rank
        options = [f"--width={args.width}", f"--steps={args.steps}", f"--every={args.every}"]
        for part in ("cost", "restart"):
            subprocess.run([sys.executable, __file__, part, *options, f"--rounds={args.rounds}"], check=True)


if __name__ == "__main__":
    main()
