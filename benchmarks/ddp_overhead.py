"""Time per training step of ``mgpu_ddp`` against Lightning's ``ddp`` and a hand-written DDP loop.

Usage::

    python benchmarks/ddp_overhead.py                    # 2 CPU processes, a few minutes
    python benchmarks/ddp_overhead.py --steps 40 --rounds 1

The same MLP (about 5.5M parameters), data, batch size and number of steps run in two
CPU processes (gloo), three ways:

- ``hand``: the loop the tutorials write: ``init_process_group``, ``DistributedSampler``,
  ``DistributedDataParallel``, forward, backward, step;
- ``ddp``: ``Trainer(strategy="ddp")``;
- ``mgpu_ddp``: ``Trainer(strategy="mgpu_ddp")``, watchdog and all.

Every way runs once per round, in a rotating order, so slow drift of a shared machine hits
all three alike. Rank 0 records the wall time of each step after the warm-up steps; the
script prints the median per way and the ratios against the targets
(``mgpu_ddp`` <= 1.02x ``ddp`` and <= 1.10x ``hand``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WAYS = ("hand", "ddp", "mgpu_ddp")
WORLD = 2
BATCH = 32
WIDTH, HIDDEN = 1024, 1536


def build_model():  # noqa: ANN201  torch is imported by the workers only
    from torch import nn

    return nn.Sequential(
        nn.Linear(WIDTH, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, WIDTH)
    )


def build_data(steps: int):  # noqa: ANN201
    import torch
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(0)
    n = steps * BATCH * WORLD
    x = torch.randn(n, WIDTH, generator=generator)
    return TensorDataset(x, torch.randn(n, WIDTH, generator=generator))


def hand_worker(steps: int, warmup: int, out: Path) -> None:
    """The hand-written loop; started once per rank with RANK/WORLD_SIZE/MASTER_* set."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORLD))  # what Lightning does
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(build_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = build_data(steps)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, shuffle=True))
    stamps = []
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        stamps.append(time.perf_counter())
    if dist.get_rank() == 0:
        out.write_text(json.dumps(step_times(stamps, warmup)))
    dist.destroy_process_group()


def lightning_worker(strategy: str, steps: int, warmup: int, out: Path) -> None:
    """Lightning with ``strategy``; its launcher starts the second rank by re-running this script."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    import lightning_mgpu  # noqa: F401  registers mgpu_ddp

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build_model()

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Stamps(L.Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def on_train_batch_end(self, *args: object) -> None:
            self.stamps.append(time.perf_counter())

    torch.manual_seed(0)
    stamps = Stamps()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=steps,
        callbacks=[stamps],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Regression(), DataLoader(build_data(steps), batch_size=BATCH, shuffle=True))
    if trainer.is_global_zero:
        out.write_text(json.dumps(step_times(stamps.stamps, warmup)))


def step_times(stamps: list[float], warmup: int) -> list[float]:
    return [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1 :], strict=False)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_way(way: str, steps: int, warmup: int, workdir: Path) -> list[float]:
    out = workdir / f"{way}.json"
    out.unlink(missing_ok=True)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK"):
        env.pop(name, None)
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    args = [sys.executable, __file__, "--worker", way, "--steps", str(steps), "--warmup", str(warmup)]
    args += ["--out", str(out)]
    ranks = [dict(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD)) for r in range(WORLD)]
    log = workdir / f"{way}.log"
    with open(log, "w") as sink:
        # the hand-written loop needs one process per rank; Lightning's launcher starts its own
        procs = [
            subprocess.Popen(args, env=dict(env, **rank), stdout=sink, stderr=subprocess.STDOUT)
            for rank in (ranks if way == "hand" else [{}])
        ]
        codes = [p.wait(timeout=900) for p in procs]
    if any(codes) or not out.exists():
        raise RuntimeError(f"{way} failed with exit codes {codes}:\n{log.read_text()[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=70, help="training steps per run (default: 70)")
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out of the timing")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each way, in rotating order")
    parser.add_argument("--worker", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "hand":
        hand_worker(args.steps, args.warmup, args.out)
        return
    if args.worker is not None:
        lightning_worker(args.worker, args.steps, args.warmup, args.out)
        return

    params = sum(p.numel() for p in build_model().parameters())
    print(f"MLP of {params / 1e6:.1f}M parameters, batch {BATCH} per process, {WORLD} CPU processes (gloo),")
    print(f"{args.steps} steps per run, first {args.warmup} not timed, {args.rounds} round(s)")
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            order = WAYS[round_index % 3 :] + WAYS[: round_index % 3]
            for way in order:
                step = run_way(way, args.steps, args.warmup, Path(tmp))
                times[way] += step
                ms = statistics.median(step) * 1e3
                print(f"  round {round_index + 1} {way:9s} median {ms:7.1f} ms/step")
    median = {way: statistics.median(values) for way, values in times.items()}
    print()
    print(f"{'way':10s} {'median ms/step':>15s} {'steps timed':>12s}")
    for way in WAYS:
        print(f"{way:10s} {median[way] * 1e3:15.1f} {len(times[way]):12d}")
    for name, base, target in (("ddp ", "ddp", 1.02), ("hand", "hand", 1.10)):
        ratio = median["mgpu_ddp"] / median[base]
        verdict = "met" if ratio <= target else "NOT met"
        print(f"mgpu_ddp / {name} = {ratio:.3f}  (target <= {target:.2f}: {verdict})")
    print(f"ddp / hand      = {median['ddp'] / median['hand']:.3f}")


if __name__ == "__main__":
    main()
