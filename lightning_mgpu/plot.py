"""Draw per-device memory over the steps of a run, and each rank's time over the fit.

``plot_memory``: per-device memory over the steps, from the metrics ``DeviceMemoryMonitor`` logged.

Reads ``memory/<device>/<field>_MiB`` columns from a CSVLogger ``metrics.csv`` (or rows
given directly), draws one line per device and each device's limit (``total_MiB``)
dashed in the same colour when it is known. Each quantity gets a panel of its own, so a
process's hundreds of MiB of RSS do not flatten the KiB that ``mgpu_dp``'s CPU replicas save
for backward. Needs matplotlib (``pip install
'lightning-mgpu[plot]'``); it is imported only here, and pyplot is never touched, so
plotting changes no global matplotlib state.

``plot_time``: one bar per rank, split into data loading, work and waiting for the other ranks,
from ``DeviceTimeMonitor``'s ``time_summary.json``.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_mgpu._atomic import atomic_write

__all__ = ["find_metrics_csv", "output_png", "plot_memory", "plot_time", "read_memory_metrics"]

_KEY = re.compile(r"^memory/([^/]+)/([a-z_]+)_MiB$")
# what to draw for each kind of device, in order of preference, and its panel's title
_DEFAULT_FIELDS = ("peak_allocated", "rss", "saved")
_TITLES = {
    "peak_allocated": "peak allocated (CUDA allocator)",
    "rss": "resident memory of each process (RSS)",
    "saved": "saved for backward by each mgpu_dp replica",
}

log = logging.getLogger(__name__)

_Series = dict[str, dict[str, list[tuple[int, float]]]]  # device -> field -> [(step, MiB), ...]


def find_metrics_csv(path: str | os.PathLike[str]) -> Path:
    """The ``metrics.csv`` of a run: ``path`` itself, ``path/metrics.csv``, or the only one below ``path``.

    Raises:
        FileNotFoundError: if there is none.
        ValueError: if there are several (the message lists them).
    """
    p = Path(path)
    if p.is_file():
        return p
    if not p.exists():
        raise FileNotFoundError(f"no such run folder or metrics file: {p}")
    if (p / "metrics.csv").is_file():
        return p / "metrics.csv"
    found = sorted(p.rglob("metrics.csv"))
    if not found:
        raise FileNotFoundError(f"no metrics.csv under {p}: train with a CSVLogger and DeviceMemoryMonitor")
    if len(found) > 1:
        listed = "\n  ".join(str(f.parent) for f in found)
        raise ValueError(f"{p} holds several runs; pass one of:\n  {listed}")
    return found[0]


def read_memory_metrics(
    source: str | os.PathLike[str] | Sequence[Mapping[str, Any]],
) -> _Series:
    """``{device: {field: [(step, MiB), ...]}}`` from a run folder, a metrics.csv or a list of rows."""
    if isinstance(source, (str, os.PathLike)):
        with open(find_metrics_csv(source), newline="") as f:
            rows: Sequence[Mapping[str, Any]] = list(csv.DictReader(f))
    else:
        rows = source
    series: _Series = {}
    for i, row in enumerate(rows):
        step_text = row.get("step")
        step = int(float(step_text)) if step_text not in (None, "") else i
        for key, text in row.items():
            match = _KEY.match(str(key))
            if match is None or text in (None, ""):
                continue
            value = float(text)
            if not math.isnan(value):
                series.setdefault(match.group(1), {}).setdefault(match.group(2), []).append((step, value))
    return series


def plot_memory(
    run_dir_or_metrics: str | os.PathLike[str] | Sequence[Mapping[str, Any]],
    out_png: str | os.PathLike[str],
    *,
    field: str | None = None,
    title: str | None = None,
) -> Any:
    """Draw each device's memory over the steps into a PNG; returns the matplotlib ``Figure``.

    - one solid line per device: peak allocated on CUDA devices, RSS of CPU ranks, bytes
      saved for backward of CPU ``mgpu_dp`` replicas (or ``field`` for all devices);
    - one panel per quantity, one above the other over the same steps, each on its own scale
      (KiB when all its values are below 1 MiB);
    - the device's limit (``total_MiB``) as a dashed line of the same colour, when logged.

    Args:
        run_dir_or_metrics: a run folder (holding ``metrics.csv`` somewhere below), a
            ``metrics.csv`` path, or rows as dicts with ``step`` and ``memory/...`` keys.
        out_png: where to write the PNG; an existing folder gets ``memory.png`` inside it.
        field: draw this field (e.g. ``"reserved"``, ``"nvml_used"``) instead of the default.
        title: the plot's title.

    Raises:
        ImportError: if matplotlib is not installed.
        ValueError: if the source holds no ``memory/*`` metrics (or not the requested field).

    Example::

        from lightning_mgpu import plot_memory

        fig = plot_memory("lightning_logs/version_0", "memory.png")
    """
    figure = _figures("plot_memory")
    series = read_memory_metrics(run_dir_or_metrics)
    if not series:
        raise ValueError(
            f"no memory/* metrics in {run_dir_or_metrics!s:.200}:"
            " train with DeviceMemoryMonitor and a CSVLogger"
        )
    wanted = (field,) if field else _DEFAULT_FIELDS
    drawn: dict[str, list[str]] = {}  # field -> the devices drawn with it
    for device in sorted(series):
        name = next((f for f in wanted if f in series[device]), None)
        if name is not None:
            drawn.setdefault(name, []).append(device)
    if not drawn:
        present = ", ".join(sorted({f for fields in series.values() for f in fields}))
        raise ValueError(f"no device logged memory/<device>/{field}_MiB; fields present: {present}")
    panels = {name: drawn[name] for name in wanted if name in drawn}  # in the order of _DEFAULT_FIELDS
    log.debug("plot panels: %s", "; ".join(f"{name}: {', '.join(d)}" for name, d in panels.items()))
    fig = figure(1.5 + 3.5 * len(panels))
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (name, devices) in zip(axes, panels.items(), strict=True):
        _draw_panel(ax, series, name, devices)
    axes[-1].set_xlabel("step")
    fig.suptitle(title or "Memory per device")
    return _saved(fig, output_png(out_png))


def output_png(out_png: str | os.PathLike[str], name: str = "memory.png") -> Path:
    """Where a plot is written: ``out_png``, or ``out_png/<name>`` when it is an existing folder.

    Example::

        output_png("runs/digits-1")  # Path('runs/digits-1/memory.png') if that folder exists
    """
    out = Path(out_png)
    return out / name if out.is_dir() else out


def _figures(caller: str) -> Callable[[float], Any]:
    """What makes a 9-inch-wide matplotlib ``Figure`` of a given height (pyplot stays untouched), or the
    error saying how to install matplotlib: asked first, before the data, so that the fix comes first."""
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(f"{caller} needs matplotlib: pip install 'lightning-mgpu[plot]'") from err
    return lambda height: Figure(figsize=(9, height), layout="constrained")


def _saved(fig: Any, out: Path) -> Any:
    """``fig``, written as a PNG at ``out`` whole or not at all; its folder created."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(out) as file:
        fig.savefig(file, format="png", dpi=100)
    return fig


def _draw_panel(ax: Any, series: _Series, name: str, devices: list[str]) -> None:
    """One quantity for each of ``devices``, with limits dashed; KiB when every value is below 1 MiB."""
    drawn = [v for d in devices for _, v in series[d][name]]
    unit, scale = ("KiB", 1024.0) if drawn and max(drawn) < 1 else ("MiB", 1.0)
    for device in devices:
        points = series[device][name]
        (line,) = ax.plot(
            [s for s, _ in points], [v * scale for _, v in points], linestyle="-", label=f"{device} {name}"
        )
        if "total" in series[device]:
            limit = max(v for _, v in series[device]["total"]) * scale
            ax.axhline(limit, color=line.get_color(), linestyle="--", label=f"{device} limit")
    # memory from zero, so a small change does not look like a large one
    ax.set_ylim(0, max([1e-9, *(float(y) for line in ax.get_lines() for y in line.get_ydata())]) * 1.08)
    ax.xaxis.get_major_locator().set_params(integer=True)  # steps
    ax.set_title(_TITLES.get(name, name.replace("_", " ")), fontsize="medium")
    ax.set_ylabel(unit)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")


# what each bar segment shows, and its colour
_PHASES = (
    ("data_s", "data loading", "tab:orange"),
    ("work_s", "work", "tab:blue"),
    ("wait_s", "waiting", "0.75"),
)


def plot_time(summary: str | os.PathLike[str] | Mapping[str, Any], out_png: str | os.PathLike[str]) -> Any:
    """Draw every rank's data loading, work and waiting as one stacked bar; returns the Figure.

    Args:
        summary: a ``time_summary.json`` path, a run folder holding one, or its content as a dict.
        out_png: where to write the PNG; an existing folder gets ``time.png`` inside it.

    Raises:
        ImportError: if matplotlib is not installed.
        FileNotFoundError: if there is no ``time_summary.json`` where ``summary`` points.
        ValueError: if the summary holds no rank.

    Example::

        from lightning_mgpu import plot_time

        fig = plot_time("runs/digits-1/time_summary.json", "time.png")
    """
    figure = _figures("plot_time")
    data = summary if isinstance(summary, Mapping) else _read_time_summary(Path(summary))
    ranks = list(data.get("ranks") or [])
    if not ranks:
        raise ValueError("the time summary holds no rank: no training batch ran under DeviceTimeMonitor")
    fig = figure(1.6 + 0.45 * len(ranks))
    ax = fig.subplots()
    labels = [f"rank {r['rank']} ({r['device']})" for r in ranks]
    left = [0.0] * len(ranks)
    for key, name, colour in _PHASES:
        widths = [float(r.get(key) or 0.0) for r in ranks]
        if any(r.get(key) is not None for r in ranks):
            ax.barh(labels, widths, left=left, color=colour, label=name)
            left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()  # rank 0 on top, as in the table
    ax.set_xlabel("seconds over the fit")
    ax.legend(loc="lower right", fontsize="small")
    ax.grid(True, axis="x", alpha=0.3)
    verdict = str((data.get("verdict") or {}).get("line", ""))
    fig.suptitle(verdict.split(" Try:")[0], fontsize="medium", wrap=True)
    return _saved(fig, output_png(out_png, "time.png"))


def _read_time_summary(path: Path) -> Mapping[str, Any]:
    file = path / "time_summary.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no time summary at {file}: train with DeviceTimeMonitor (it writes one)")
    loaded: Mapping[str, Any] = json.loads(file.read_text())
    return loaded
