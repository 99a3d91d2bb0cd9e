"""Inspect sharded folders of many tiny entries: how time and memory grow with their number.

Usage::

    python benchmarks/inspect_sharded.py                          # 10,000 and 100,000 entries
    python benchmarks/inspect_sharded.py --entries 2000 --kinds extra_state
    git worktree add /tmp/before HEAD~1 && python benchmarks/inspect_sharded.py --compare-with /tmp/before

Folders saved by ``torch.distributed.checkpoint`` in one process, of two kinds:

- ``tensors``: ``{"state_dict": {"layers.N.weight": a 2-value tensor}}``;
- ``extra_state``: ``{"layers.N._extra_state": N}``, objects a module keeps beside its weights
  (100,000 of them make an 11 MB ``.metadata``).

``lightning-mgpu inspect`` (the command line's ``main``) runs in a process of its own on folders of N
and of 10 x N entries, ``--repeat`` times each, the fastest counting. Printed: the time of the call
(after start-up and imports), its CPU time, and how much the peak RSS grew during it (``VmHWM``
after it minus ``VmRSS`` before, the peak reset with ``/proc/self/clear_refs``), per entry, and the
10 x N / N ratio of each: 10 is linear. With ``--compare-with``, another copy of the package (the
folder holding ``lightning_mgpu``) is measured in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_BUILD = """
import sys, warnings, torch, torch.distributed.checkpoint as dcp
warnings.simplefilter("ignore")  # no process group: torch says it saves from a single process
kind, count, folder = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if kind == "tensors":
    state = {"state_dict": {f"layers.{i}.weight": torch.full((2,), float(i)) for i in range(count)}}
else:
    state = {f"layers.{i}._extra_state": i for i in range(count)}
dcp.save(state, checkpoint_id=folder)
"""

_INSPECT = """
import contextlib, io, json, resource, sys, time
sys.path.insert(0, sys.argv[1])  # before the working folder, where -c looks first
import torch.distributed.checkpoint
from lightning_mgpu.cli.main import main

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before, start, used = status("VmRSS"), time.perf_counter(), cpu()
with contextlib.redirect_stdout(io.StringIO()):
    code = main(["inspect", sys.argv[2]])
assert code == 0, code
growth = (status("VmHWM") - before) / 2**20
print(json.dumps({"s": time.perf_counter() - start, "cpu": cpu() - used, "mib": growth}))
"""


def build(kind: str, count: int, folder: Path) -> None:
    subprocess.run([sys.executable, "-c", _BUILD, kind, str(count), str(folder)], check=True)


def inspect(package: Path, folder: Path) -> dict[str, float]:
    """The call's seconds, CPU seconds and peak RSS growth (MiB), in a process of its own."""
    out = subprocess.run(
        [sys.executable, "-c", _INSPECT, str(package), str(folder)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entries", type=int, default=10_000, help="N; folders of N and 10 x N entries")
    parser.add_argument(
        "--kinds", nargs="+", default=["tensors", "extra_state"], choices=["tensors", "extra_state"]
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs of each; the fastest counts (default: 3)")
    parser.add_argument("--dir", default=None, help="folder for the temporary files (default: system temp)")
    parser.add_argument("--compare-with", metavar="DIR", default=None, help="another lightning_mgpu's folder")
    args = parser.parse_args()

    packages = {"now": REPO}
    if args.compare_with:
        packages["before"] = Path(args.compare_with).resolve()
    counts = [args.entries, 10 * args.entries]
    print(
        f"{'kind':<12}{'package':<8}{'entries':>9}{'call s':>8}{'cpu s':>8}{'RSS +MiB':>10}{'us/entry':>10}"
    )
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for kind in args.kinds:
            for count in counts:
                build(kind, count, Path(tmp, f"{kind}{count}"))
            runs: dict[tuple[str, int], list[dict[str, float]]] = {}
            for _ in range(args.repeat):  # the packages take turns, so a slower moment slows each alike
                for count in counts:
                    for name, package in packages.items():
                        runs.setdefault((name, count), []).append(
                            inspect(package, Path(tmp, f"{kind}{count}"))
                        )
            for name in packages:
                best = {
                    count: {k: min(r[k] for r in runs[name, count]) for k in ("s", "cpu")} for count in counts
                }
                for count in counts:
                    mib = max(r["mib"] for r in runs[name, count])
                    best[count]["mib"] = mib
                    b = best[count]
                    print(
                        f"{kind:<12}{name:<8}{count:>9,}{b['s']:>8.2f}{b['cpu']:>8.2f}{mib:>10.0f}"
                        f"{b['s'] / count * 1e6:>10.1f}"
                    )
                small, large = best[counts[0]], best[counts[1]]
                print(
                    f"{'':<20}10 x the entries: {large['s'] / small['s']:.1f} x the time, "
                    f"{large['mib'] / max(small['mib'], 1e-9):.1f} x the memory (10 is linear)"
                )


if __name__ == "__main__":
    main()
