"""Export a ~1 GiB DataParallel checkpoint three ways, side by side, and print time and peak memory.

Usage::

    python benchmarks/export.py               # 1 GiB checkpoint in a temporary folder
    python benchmarks/export.py --size-mib 256 --dir /scratch --repeat 3

Each method runs in its own process; its peak RSS comes from ``os.wait4`` (the kernel's
``ru_maxrss`` of that one child), its wall time from the parent. The Python methods also report
"work" time: the same run without interpreter start-up and ``import torch``, which every Python
method pays alike. With ``--repeat N`` each time is the fastest of N runs and the RSS the largest.

- ``lightning_mgpu``: ``export_state_dict(src, out.safetensors)``; also its ``.pt`` output, and the
  same weights read from a ``.safetensors`` source instead of the torch zip file;
- ``tutorial recipe``: ``torch.load`` + a dict comprehension removing ``module.`` + ``torch.save``;
- ``cp``: a plain copy of the file, the floor for moving those bytes; ``cp + fsync`` adds the
  flush to disk that an atomic export does.

Targets: export time <= 2x cp (the torch zip source's records are checked against their CRC-32
within that time), export peak RSS to safetensors <= 0.3x the file size from either source format,
and well below the recipe.
The export's time is its "work" time, the call as a Python user makes it; the whole process also
pays interpreter start-up and ``import torch`` (seconds on a small machine), a fixed cost no
torch-based tool avoids and ``cp`` does not have, so it is printed apart.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_TIMED = """
import json, sys, time
t0 = time.perf_counter()
{imports}
t1 = time.perf_counter()
{work}
print(json.dumps({{"import_s": t1 - t0, "work_s": time.perf_counter() - t1}}))
"""

_CP_FSYNC = (
    "import os, shutil, sys; shutil.copyfile(*sys.argv[1:]); os.fsync(os.open(sys.argv[2], os.O_RDONLY))"
)

METHODS = {
    "lightning_mgpu -> .safetensors": (
        "from lightning_mgpu import export_state_dict",
        "export_state_dict(sys.argv[1], sys.argv[2] + '.safetensors')",
    ),
    "lightning_mgpu -> .pt": (
        "from lightning_mgpu import export_state_dict",
        "export_state_dict(sys.argv[1], sys.argv[2] + '.pt')",
    ),
    "lightning_mgpu .safetensors -> .safetensors": (
        "from lightning_mgpu import export_state_dict",
        "export_state_dict(sys.argv[1].replace('.pt', '.safetensors'), sys.argv[2] + '.safetensors')",
    ),
    "tutorial recipe (.pt)": (
        "import torch",
        textwrap.dedent(
            """
            sd = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
            sd = {k.removeprefix("module."): v for k, v in sd.items()}
            torch.save(sd, sys.argv[2] + ".pt")
            """
        ),
    ),
}


_BUILD = """
import sys, torch
count = max(1, int(sys.argv[2]) // 16)  # layers of 16 MiB of float32
generator = torch.Generator().manual_seed(0)
state_dict = {}
for i in range(count):
    state_dict[f"module.layers.{i}.weight"] = torch.randn(2048, 2048, generator=generator)
    state_dict[f"module.layers.{i}.bias"] = torch.randn(2048, generator=generator)
torch.save(state_dict, sys.argv[1])
# the same weights as safetensors, the other source format an export reads
from safetensors.torch import save_file
save_file(state_dict, sys.argv[1].replace(".pt", ".safetensors"))
print(len(state_dict))
"""


def build_checkpoint(path: Path, size_mib: int) -> int:
    """A DataParallel-style state_dict written by torch.save, built in a child so this process stays small."""
    out = subprocess.run(
        [sys.executable, "-c", _BUILD, str(path), str(size_mib)], check=True, capture_output=True, text=True
    )
    return int(out.stdout.split()[-1])


def measure(cmd: list[str], env: dict[str, str], repeat: int, outputs: Path) -> dict[str, float]:
    """Fastest times and largest peak RSS over ``repeat`` runs; ``outputs*`` are deleted after each."""
    runs = []
    for _ in range(repeat):
        runs.append(measure_once(cmd, env))
        for path in outputs.parent.glob(outputs.name + "*"):
            path.unlink()
    best = {key: min(r[key] for r in runs) for key in runs[0]}
    best["rss_mib"] = max(r["rss_mib"] for r in runs)
    return best


def measure_once(cmd: list[str], env: dict[str, str]) -> dict[str, float]:
    """Wall seconds and peak RSS (MiB) of one child process, plus what it printed as JSON."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    out, err = proc.stdout.read(), proc.stderr.read()  # type: ignore[union-attr]
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed ({proc.returncode}):\n{err}")
    result = {"wall_s": wall, "rss_mib": usage.ru_maxrss / 1024}
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if last.startswith("{"):
        result.update(json.loads(last))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="checkpoint size (default: 1024)")
    parser.add_argument("--dir", default=None, help="folder for the temporary files (default: system temp)")
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs per method; the fastest counts (default: 1)"
    )
    args = parser.parse_args()

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        src = Path(tmp, "dataparallel.pt")
        tensors = build_checkpoint(src, args.size_mib)
        size_mib = src.stat().st_size / 2**20
        print(f"checkpoint: {tensors} tensors, 'module.' keys, {size_mib:.1f} MiB, torch.save zip format\n")

        out = Path(tmp, "out")
        results: dict[str, dict[str, float]] = {}
        results["cp"] = measure(["cp", str(src), str(out)], env, args.repeat, out)
        results["cp + fsync"] = measure(
            [sys.executable, "-c", _CP_FSYNC, str(src), str(out)], env, args.repeat, out
        )
        for name, (imports, work) in METHODS.items():
            code = _TIMED.format(imports=imports, work=work)
            results[name] = measure([sys.executable, "-c", code, str(src), str(out)], env, args.repeat, out)

        cp = results["cp"]["wall_s"]
        print(f"{'method':<32}{'wall s':>8}{'work s':>8}{'peak RSS MiB':>14}{'RSS/file':>10}{'wall/cp':>9}")
        for name, r in results.items():
            work = f"{r['work_s']:.2f}" if "work_s" in r else "-"
            print(
                f"{name:<32}{r['wall_s']:>8.2f}{work:>8}{r['rss_mib']:>14.0f}"
                f"{r['rss_mib'] / size_mib:>10.2f}{r['wall_s'] / cp:>9.2f}"
            )
        ours, recipe = results["lightning_mgpu -> .safetensors"], results["tutorial recipe (.pt)"]
        from_st = results["lightning_mgpu .safetensors -> .safetensors"]
        synced = results["cp + fsync"]["wall_s"]
        start_up = ours["wall_s"] - ours["work_s"]
        print(
            "\nlightning_mgpu -> .safetensors:"
            f"\n  export call / cp           = {ours['work_s'] / cp:.2f}  (target <= 2)"
            f"\n  export call / (cp + fsync) = {ours['work_s'] / synced:.2f}  (cp as durable as the export)"
            f"\n  whole process / cp         = {ours['wall_s'] / cp:.2f}  (adds {start_up:.2f} s:"
            " interpreter start and `import torch`)"
            f"\n  peak RSS / file size       = {ours['rss_mib'] / size_mib:.2f}  (target <= 0.3)"
            f"\n  from .safetensors: RSS / file size = {from_st['rss_mib'] / size_mib:.2f}  (target <= 0.3),"
            f" export call / cp = {from_st['work_s'] / cp:.2f}"
            f"\n  peak RSS / tutorial recipe = {ours['rss_mib'] / recipe['rss_mib']:.2f}  (target < 1)"
        )


if __name__ == "__main__":
    main()
