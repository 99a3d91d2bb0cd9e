"""Export a sharded checkpoint folder to plain weights beside torch's ``dcp_to_torch_save``: time, memory.

Usage::

    python benchmarks/export_sharded.py                 # 512 MiB of weights (+ 2x Adam state), 2 ranks
    python benchmarks/export_sharded.py --size-mib 128 --dir /scratch --repeat 3
    git worktree add /tmp/before HEAD~1 && python benchmarks/export_sharded.py --compare-with /tmp/before

The folder is what Lightning's ``ModelParallelStrategy`` saves: ``torch.distributed.checkpoint``
written by 2 gloo processes, each tensor split in two (``Shard(0)``), the weights under
``state_dict`` and an Adam-like ``optimizer_0`` (``exp_avg``, ``exp_avg_sq``) beside them, so the
folder is 3x the weights. Each method runs in its own process:

- ``lightning_mgpu``: ``export_state_dict(folder, out.safetensors)``: the weights only, one tensor
  assembled and written at a time;
- ``dcp_to_torch_save``: torch's converter, which loads the whole folder into memory, optimizer
  state included, and ``torch.save``s it;
- ``dcp.load key by key``: what an export built on torch's own reader would do: each weight loaded
  alone (``torch.distributed.checkpoint.load(..., no_dist=True)`` into a tensor of its size) and
  written. torch's ``FileSystemReader`` reads a chunk's whole archive into memory, then
  ``torch.load``s it, then copies it into place: three copies of a tensor where the hand-written
  reader (``checkpoint/_dcp_chunk.py``) reads the values straight into the one it writes from.

- ``--compare-with DIR``: ``export_state_dict`` of another copy of the package (the folder that
  holds ``lightning_mgpu``, a worktree of an earlier commit), in the same runs, so a change is
  measured against what came before on the same machine at the same time.

Printed per method: wall time; "work" time (the call alone, without start-up and ``import torch``)
and the CPU time of the call, every thread's (less disturbed than wall time on a busy machine);
peak RSS of the whole process (``os.wait4``'s ``ru_maxrss``); and the peak growth during the call
(``VmHWM`` after the call minus ``VmRSS`` before it, the peak reset with ``/proc/self/clear_refs``),
each as a ratio of the folder's size. The methods take turns, ``--repeat`` rounds, the fastest time
of each counting. Target: peak RSS <= 0.3x the folder.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.export import measure_once  # noqa: E402 - the same per-process timing and RSS

_BUILD = """
import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

def rank_main(rank, folder, layers, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    weights, state = {}, {}
    for i in range(layers):  # 16 MiB of float32 per layer, the same values on both ranks
        full = torch.randn(2048, 2048, generator=torch.Generator().manual_seed(i))
        name = f"model.layers.{i}.weight"
        weights[name] = distribute_tensor(full, mesh, [Shard(0)])
        moments = (("exp_avg", 0.1), ("exp_avg_sq", 0.01))
        state[name] = {k: distribute_tensor(full * s, mesh, [Shard(0)]) for k, s in moments}
    dcp.save({"state_dict": weights, "optimizer_0": {"state": state}}, checkpoint_id=folder)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(rank_main, args=(sys.argv[1], int(sys.argv[2]), sys.argv[3]), nprocs=2)
"""

_TIMED = """
import json, resource, sys, time
t0 = time.perf_counter()
{imports}
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread's
    return usage.ru_utime + usage.ru_stime
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM starts again from the RSS after imports
before = status("VmRSS")
t1, c1 = time.perf_counter(), cpu()
{work}
work_s, cpu_s = time.perf_counter() - t1, cpu() - c1
growth = (status("VmHWM") - before) / 2**20
print(json.dumps({{"import_s": t1 - t0, "work_s": work_s, "cpu_s": cpu_s, "growth_mib": growth}}))
"""

METHODS = {
    "lightning_mgpu export": (
        # torch.distributed.checkpoint (~0.9 s to import) is imported before the clock, as for torch's method
        "import torch.distributed.checkpoint, safetensors\nfrom lightning_mgpu import export_state_dict",
        "export_state_dict(sys.argv[1], sys.argv[2] + '.safetensors')",
    ),
    "torch dcp_to_torch_save": (
        "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save",
        "dcp_to_torch_save(sys.argv[1], sys.argv[2] + '.pt')",
    ),
    # what an export built on torch's own reader would do: each weight loaded alone into a tensor
    # of its size, then written (raw bytes: the writer is not what is measured here)
    "torch dcp.load key by key": (
        "import torch, torch.distributed.checkpoint as dcp\n"
        "from torch.distributed.checkpoint import FileSystemReader",
        "index = FileSystemReader(sys.argv[1]).read_metadata()  # our own folder: safe to unpickle\n"
        "with open(sys.argv[2] + '.raw', 'wb') as f:\n"
        "    for key, entry in index.state_dict_metadata.items():\n"
        "        if key.startswith('state_dict.'):\n"
        "            tensor = torch.empty(entry.size, dtype=entry.properties.dtype)\n"
        "            dcp.load({key: tensor}, storage_reader=FileSystemReader(sys.argv[1]), no_dist=True)\n"
        "            f.write(tensor.numpy().data)\n"
        "            del tensor",
    ),
}


def build_folder(folder: Path, size_mib: int, env: dict[str, str]) -> None:
    """The sharded folder, written by 2 gloo processes so that each tensor has a chunk in each rank's file."""
    script = folder.parent / "build.py"
    script.write_text(_BUILD)
    port = str(29500 + os.getpid() % 1000)
    layers = str(max(1, size_mib // 16))
    subprocess.run([sys.executable, str(script), str(folder), layers, port], check=True, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=512, help="weights in MiB (default: 512)")
    parser.add_argument("--dir", default=None, help="folder for the temporary files (default: system temp)")
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs per method; fastest time counts (default: 1)"
    )
    parser.add_argument(
        "--compare-with",
        metavar="DIR",
        default=None,
        help="a folder holding another lightning_mgpu (an earlier commit's worktree) to measure beside",
    )
    args = parser.parse_args()

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp, "last.ckpt")
        started = time.perf_counter()
        build_folder(folder, args.size_mib, env)
        size = sum(p.stat().st_size for p in folder.iterdir()) / 2**20
        files = sorted(p.name for p in folder.iterdir())
        print(
            f"folder: {size:.0f} MiB ({args.size_mib} MiB of weights + Adam state), "
            f"files {', '.join(files)}, "
            f"built in {time.perf_counter() - started:.1f} s\n"
        )
        out = Path(tmp, "out")
        methods = dict(METHODS)
        if args.compare_with:  # first on the path: before the working folder, where -c looks first
            imports, work = METHODS["lightning_mgpu export"]
            first = f"sys.path.insert(0, {str(Path(args.compare_with).resolve())!r})\n"
            methods[COMPARED] = (first + imports, work)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in methods}
        for _ in range(args.repeat):  # the methods take turns, so a slower moment slows each alike
            for name, (imports, work) in methods.items():
                code = _TIMED.format(imports=imports, work=work)
                runs[name].append(measure_once([sys.executable, "-c", code, str(folder), str(out)], env))
                for path in out.parent.glob(out.name + "*"):
                    path.unlink()
        results = {name: _best(r) for name, r in runs.items()}

        print(
            f"{'method':<32}{'wall s':>8}{'work s':>8}{'cpu s':>8}{'peak RSS MiB':>14}"
            f"{'RSS/folder':>12}{'growth MiB':>12}"
        )
        for name, r in results.items():
            print(
                f"{name:<32}{r['wall_s']:>8.2f}{r['work_s']:>8.2f}{r['cpu_s']:>8.2f}{r['rss_mib']:>14.0f}"
                f"{r['rss_mib'] / size:>12.2f}{r['growth_mib']:>12.0f}"
            )
        ours, torch_ = results["lightning_mgpu export"], results["torch dcp_to_torch_save"]
        print(
            "\nlightning_mgpu export:"
            f"\n  peak RSS / folder size               = {ours['rss_mib'] / size:.2f}  (target <= 0.3)"
            f"\n  peak growth in the call / folder size = {ours['growth_mib'] / size:.3f}"
            f"  (largest tensor: 16 MiB = {16 / size:.3f})"
            f"\n  peak RSS / dcp_to_torch_save's        = {ours['rss_mib'] / torch_['rss_mib']:.2f}"
            f"\n  work time / dcp_to_torch_save's       = {ours['work_s'] / torch_['work_s']:.2f}"
            f"  (it writes the weights only, {args.size_mib} MiB; torch writes all {size:.0f} MiB)"
        )
        if COMPARED in results:
            before = results[COMPARED]
            spread = {name: max(r["work_s"] for r in runs[name]) / results[name]["work_s"] for name in runs}
            print(
                f"\nagainst {args.compare_with} (fastest of {args.repeat} runs each):"
                f"\n  work time / before's  = {ours['work_s'] / before['work_s']:.3f}"
                f"\n  CPU time / before's   = {ours['cpu_s'] / before['cpu_s']:.3f}"
                f"\n  peak RSS / before's   = {ours['rss_mib'] / before['rss_mib']:.3f}"
                f"\n  slowest / fastest run = {spread['lightning_mgpu export']:.2f} here, "
                f"{spread[COMPARED]:.2f} before (the noise)"
            )


COMPARED = "lightning_mgpu export (before)"


def _best(runs: list[dict[str, float]]) -> dict[str, float]:
    """The fastest times and the largest peak RSS of several runs."""
    best = {key: min(r[key] for r in runs) for key in runs[0]}
    best["rss_mib"] = max(r["rss_mib"] for r in runs)
    return best


if __name__ == "__main__":
    main()
