"""``lightning-mgpu plot-memory RUN_DIR``: draw per-device memory of a run to a PNG.

RUN_DIR is a CSVLogger run folder (``lightning_logs/version_0``), a folder holding
exactly one such run, or a ``metrics.csv``. The PNG goes next to the metrics as
``memory.png`` unless ``--output`` names another file (or a folder to write ``memory.png`` in).
"""

from __future__ import annotations

import argparse

from lightning_mgpu.cli._errors import user_errors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run folder or metrics.csv logged by a CSVLogger")
    parser.add_argument(
        "-o",
        "--output",
        help="PNG to write, or a folder to write memory.png in (default: memory.png next to metrics.csv)",
    )
    parser.add_argument(
        "--field",
        help="draw this field for every device, e.g. reserved or nvml_used"
        " (default: peak_allocated on CUDA, rss for CPU ranks, saved for CPU mgpu_dp replicas;"
        " each quantity in a panel of its own)",
    )


def run(args: argparse.Namespace) -> int:
    from lightning_mgpu.plot import find_metrics_csv, output_png, plot_memory

    metrics = find_metrics_csv(args.run_dir)
    target = args.output or metrics.parent
    with user_errors(ImportError):  # matplotlib missing: the message says how to install it
        fig = plot_memory(metrics, target, field=args.field, title=f"Memory per device: {metrics.parent}")
    devices = sum(1 for ax in fig.axes for line in ax.get_lines() if line.get_linestyle() == "-")
    print(f"wrote {output_png(target)} ({devices} device(s))")
    return 0
