"""``lightning-mgpu plot-memory RUN_DIR``: draw per-device memory of a run to a PNG.

RUN_DIR is a CSVLogger run folder (``lightning_logs/version_0``), a folder holding
exactly one such run, or a ``metrics.csv``. The PNG goes next to the metrics as
``memory.png`` unless ``--output`` says otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run folder or metrics.csv logged by a CSVLogger")
    parser.add_argument("-o", "--output", help="PNG to write (default: memory.png next to metrics.csv)")
    parser.add_argument(
        "--field",
        help="draw this field for every device, e.g. reserved or nvml_used"
        " (default: peak_allocated on CUDA, rss for CPU ranks)",
    )


def run(args: argparse.Namespace) -> int:
    from lightning_mgpu.plot import find_metrics_csv, plot_memory

    metrics = find_metrics_csv(args.run_dir)
    out = Path(args.output) if args.output else metrics.parent / "memory.png"
    try:
        fig = plot_memory(metrics, out, field=args.field, title=f"Memory per device: {metrics.parent}")
    except ImportError as err:
        print(f"lightning-mgpu plot-memory: error: {err}", file=sys.stderr)
        return 1
    devices = sum(1 for line in fig.axes[0].get_lines() if line.get_linestyle() == "-")
    print(f"wrote {out} ({devices} device(s))")
    return 0
