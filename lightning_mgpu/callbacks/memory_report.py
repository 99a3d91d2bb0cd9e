"""What ``DeviceMemoryMonitor`` reads, and the texts it writes: metrics, table, causes, OOM options.

Everything here is plain data in, plain data out, so every message can be checked
without a device that shows the problem.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_mgpu._words import aligned, counted
from lightning_mgpu.devices import MiB, format_bytes

# reading kind -> its fields, in the order they travel between ranks; all bytes
FIELDS: dict[str, tuple[str, ...]] = {
    "cuda": ("allocated", "reserved", "peak_allocated", "peak_reserved", "nvml_used", "total", "model_state"),
    "cpu": ("rss", "peak_rss", "model_state"),
    "replica": ("saved",),
}
# the field compared across devices for ``memory/imbalance`` and drawn by the plot
PRIMARY = {"cuda": "peak_allocated", "cpu": "peak_rss", "replica": "saved"}
# the table's columns after the device and its name: heading, field, the kind of device that shows it
# (None: shown when some device knows the field); "nvml_used" shows NVML's used / total
_COLUMNS = (
    ("Peak allocated", "peak_allocated", "cuda"),
    ("Peak reserved", "peak_reserved", "cuda"),
    ("Used / Total", "nvml_used", "cuda"),
    ("RSS", "rss", "cpu"),
    ("Peak RSS", "peak_rss", "cpu"),
    ("Saved for backward", "saved", "replica"),
    # parameters, gradients and optimizer state this rank holds: 1/N of the model's under mgpu_fsdp
    ("Model state (rank)", "model_state", None),
)
# fields whose fit-wide summary keeps the latest value rather than the maximum
_LATEST = {"total"}


@dataclass
class Reading:
    """One device's memory at one moment (bytes; NaN where unknown)."""

    device: str
    kind: str
    rank: int
    name: str
    values: dict[str, float]
    rows: float = math.nan
    """Batch rows this device processed in the last step."""

    def vector(self) -> list[float]:
        """The numbers ranks exchange, its fields then its rows: each device's name and kind travel once,
        at the start of a fit."""
        return [self.values.get(f, math.nan) for f in FIELDS[self.kind]] + [self.rows]


def from_row(firsts: list[Reading], row: list[float]) -> list[Reading]:
    """A rank's readings from its row of numbers (each reading's ``vector`` in turn), named as ``firsts``."""
    numbers = iter(row)  # keywords are read in order: each reading's fields, then its rows
    return [
        replace(first, values={f: next(numbers) for f in FIELDS[first.kind]}, rows=next(numbers))
        for first in firsts
    ]


def metrics(readings: list[Reading]) -> dict[str, float]:
    """``memory/<device>/<field>_MiB`` for every known value."""
    out = {}
    for r in readings:
        for key, value in r.values.items():
            if not math.isnan(value):
                out[f"memory/{r.device}/{key}_MiB"] = value / MiB
    return out


def imbalance(readings: list[Reading]) -> tuple[float, Reading | None]:
    """Maximum over devices of the primary value divided by the mean, and the fullest device.

    Compared are the CUDA devices, else the DP replicas, else the CPU ranks."""
    for kind in ("cuda", "replica", "cpu"):
        chosen = [r for r in readings if r.kind == kind and not math.isnan(r.values[PRIMARY[kind]])]
        if chosen:
            values = [r.values[PRIMARY[kind]] for r in chosen]
            fullest, mean = chosen[values.index(max(values))], statistics.fmean(values)
            return (max(values) / mean if mean > 0 else 1.0), fullest
    return 1.0, None


@dataclass
class Summary:
    """Fit-wide maxima per device, for the end-of-fit table and JSON."""

    devices: dict[str, Reading] = field(default_factory=dict)
    max_imbalance: float = 1.0
    logs: int = 0
    micro_batches: dict[int, int | None] = field(default_factory=dict)
    """rank -> rows per micro-batch its last batch ran in (``None``: whole); empty without micro-batches."""

    def update(self, readings: list[Reading], imbalance_now: float) -> None:
        self.logs += 1
        self.max_imbalance = max(self.max_imbalance, imbalance_now)
        for r in readings:  # a device's first reading is kept whole, NaN (unknown) where it knows nothing
            kept = self.devices.setdefault(r.device, replace(r, values=dict.fromkeys(r.values, math.nan)))
            for key, value in r.values.items():
                before = kept.values.get(key, math.nan)
                if not math.isnan(value):
                    kept.values[key] = value if key in _LATEST or math.isnan(before) else max(before, value)

    def as_json(self) -> dict[str, Any]:
        def clean(v: float) -> int | None:
            return None if math.isnan(v) else int(v)

        firsts = _first_of_each_rank(list(self.devices.values()), set(self.micro_batches))
        return {
            "devices": [
                {"device": r.device, "rank": r.rank, "name": r.name}
                | {f"{k}_bytes": clean(v) for k, v in r.values.items()}
                # on the rank's first device, as in the table; null: whole batches
                | ({"micro_batch_size": self.micro_batches[r.rank]} if i in firsts else {})
                for i, r in enumerate(self.devices.values())
            ],
            "max_imbalance": round(self.max_imbalance, 4),
            "logs": self.logs,
        }


def table(
    readings: list[Reading], title: str = "", micro_batches: dict[int, int | None] | None = None
) -> str:
    """An ``nvidia-smi``-like table: one row per device, only the columns some device knows.

    ``micro_batches`` (rank -> rows per micro-batch, ``None`` for whole batches) adds the column
    "Micro-batch (rank)", filled on each rank's first device.
    """
    kinds = {r.kind for r in readings}
    known = {key for r in readings for key, value in r.values.items() if not math.isnan(value)}
    columns = [(h, key) for h, key, kind in _COLUMNS if kind in kinds or (kind is None and key in known)]
    cells = [["Device", "Name", *(h for h, _ in columns)]]
    cells += [[r.device, r.name, *(_cell(r, key) for _, key in columns)] for r in readings]
    if micro_batches:  # the rank's setting, not a device's: on its first row
        firsts = _first_of_each_rank(readings, set(micro_batches))
        cells[0].append("Micro-batch (rank)")
        for i, (row, r) in enumerate(zip(cells[1:], readings, strict=True)):
            row.append(_micro_batch_text(micro_batches[r.rank]) if i in firsts else "-")
    header, *body = [f"| {line} |" for line in aligned(cells, sep=" | ")]
    rule = "".join("+" if c == "|" else "-" for c in header)
    lines = [title] if title else []
    return "\n".join([*lines, rule, header, rule.replace("-", "="), *body, rule])


def _first_of_each_rank(readings: list[Reading], ranks: set[int]) -> set[int]:
    """Indices of the first reading (its process or first device) of each of ``ranks``."""
    seen: dict[int, int] = {}
    for i, r in enumerate(readings):
        if r.rank in ranks:
            seen.setdefault(r.rank, i)
    return set(seen.values())


def _micro_batch_text(size: int | None) -> str:
    return "whole batch" if size is None else f"{size} row{'s' * (size != 1)}"


def _cell(r: Reading, key: str) -> str:
    if key != "nvml_used":
        return format_bytes(r.values.get(key, math.nan))
    used, total = r.values.get("nvml_used", math.nan), r.values.get("total", math.nan)
    if math.isnan(used) and math.isnan(total):
        return "-"
    return f"{format_bytes(used)} / {format_bytes(total)}"


@dataclass
class Facts:
    """What the run looked like when an imbalance showed, gathered from every rank."""

    strategy: str  # "mgpu_dp", "ddp" or "single"
    root_device: str = ""
    chunk_sizes: list[int] = field(default_factory=list)
    """Rows per replica in the last step (mgpu_dp)."""
    rows_per_rank: dict[int, float] = field(default_factory=dict)
    optimizer_state_elsewhere: dict[int, dict[str, int]] = field(default_factory=dict)
    """rank -> {device: bytes of optimizer state on a device other than the rank's own}."""
    allocated_elsewhere: dict[int, dict[str, int]] = field(default_factory=dict)
    """rank -> {device: bytes its allocator holds on a CUDA device other than its own}."""
    contexts: dict[str, list[int]] = field(default_factory=dict)
    """device -> ranks with a process on it, as NVML lists them."""


def likely_causes(fullest: Reading, ratio: float, facts: Facts) -> list[str]:
    """Plain-language causes of ``fullest`` holding ``ratio`` times the mean, most likely first."""
    dev = fullest.device
    causes = []
    if facts.strategy == "mgpu_dp" and dev == facts.root_device:
        causes.append(
            f"mgpu_dp gathers every replica's outputs and computes the loss on {dev}, which also holds the"
            f" gradients and the optimizer state; strategy='mgpu_ddp' gives each device only its own share"
        )
    if facts.strategy == "mgpu_dp" and facts.chunk_sizes and max(facts.chunk_sizes) != min(facts.chunk_sizes):
        causes.append(
            f"uneven splits: the replicas got {facts.chunk_sizes} rows in the last step; use a batch size"
            f" divisible by {len(facts.chunk_sizes)}"
        )
    rows = [v for v in facts.rows_per_rank.values() if not math.isnan(v)]
    if facts.strategy == "ddp" and rows and max(rows) != min(rows):
        per_rank = ", ".join(f"rank {r}: {v:.0f}" for r, v in sorted(facts.rows_per_rank.items()))
        causes.append(f"uneven splits: ranks got different batches in the last step ({per_rank})")
    for rank, where in sorted(facts.optimizer_state_elsewhere.items()):
        if dev in where:
            causes.append(
                f"optimizer state on {dev}: rank {rank} keeps {format_bytes(where[dev])} of optimizer state"
                " there, not on its own device (load optimizer state with map_location=the rank's device)"
            )
    strays = sorted(r for r in facts.contexts.get(dev, []) if r != fullest.rank)
    elsewhere = sorted(r for r, where in facts.allocated_elsewhere.items() if dev in where)
    if strays or elsewhere:
        ranks = ", ".join(str(r) for r in sorted(set(strays) | set(elsewhere)))
        causes.append(
            f"a stray CUDA context on {dev}: rank(s) {ranks} also use {dev}; call"
            " torch.cuda.set_device(rank's device) before any CUDA work and pass map_location to torch.load"
        )
    if not causes:
        causes.append(
            f"none of the usual causes (DP gathering, optimizer state or stray CUDA contexts on one device,"
            f" uneven splits) shows in this run: look for tensors kept on {dev} only, e.g. caches or"
            " metrics built under `if self.global_rank == 0:`"
        )
    return causes


def imbalance_warning(fullest: Reading, ratio: float, threshold: float, causes: list[str]) -> str:
    lines = [
        f"Memory is unbalanced: {fullest.device} holds {ratio:.2f}x the mean peak of the devices"
        f" (memory/imbalance > {threshold}). Likely cause(s):"
    ]
    lines += [f"  - {c}" for c in causes]
    return "\n".join(lines)


@dataclass
class OOMContext:
    """What the run knew when it ran out of memory."""

    failed_device: str
    rank: int
    step: int
    strategy: str  # "mgpu_dp", "ddp" or "single"
    devices_used: int
    devices_available: int
    accelerator: str  # "cuda" or "cpu"
    batch_per_device: int | None
    largest_ok: int | None
    accumulate: int
    precision: str


def oom_guidance(error: BaseException, ctx: OOMContext, readings: list[Reading]) -> str:
    """The message printed when a step runs out of memory: the failed device, every device, options."""
    lines = [
        f"Out of memory on {ctx.failed_device} (rank {ctx.rank}) at step {ctx.step}:"
        f" {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".rstrip(),
        table(readings, title="What each device held (latest readings):") if readings else "",
        "Options, from this run:",
    ]
    b, ok = ctx.batch_per_device, ctx.largest_ok
    if b is not None:
        ok_text = f"the largest that finished a step so far is {ok}" if ok else "no step has finished yet"
        target = ok if ok and ok < b else max(1, b // 2)
        lines.append(
            f"  - batch: {counted(b, 'row')} per device now; {ok_text};"
            f" try {counted(target, 'row')} per device."
        )
        steps = math.ceil(b * ctx.accumulate / target)
        loader = target * ctx.devices_used if ctx.strategy == "mgpu_dp" else target
        lines.append(
            f"  - keep the global batch with gradient accumulation: DataLoader batch_size={loader} and"
            f" Trainer(accumulate_grad_batches={steps}) (now {ctx.accumulate})."
        )
    if ctx.strategy == "mgpu_dp":
        lines.append(
            "  - strategy='mgpu_ddp' instead of mgpu_dp: each device then computes its own loss, and no"
            " device gathers the outputs, gradients and optimizer state of all."
        )
    if ctx.devices_available > ctx.devices_used:
        lines.append(
            f"  - more devices: {ctx.devices_used} of {ctx.devices_available} are used; devices="
            f"{ctx.devices_available} spreads the same global batch thinner."
        )
    elif ctx.accelerator == "cpu":
        lines.append("  - more memory: this machine's RAM is shared by every CPU process of the run.")
    else:
        lines.append("  - more devices: every visible device is used; add a machine (num_nodes) for more.")
    if ctx.precision in ("32-true", "32", "64-true", "64"):
        lines.append(
            f"  - precision: {ctx.precision} now; precision='bf16-mixed' (or '16-mixed' where bf16 is not"
            " supported) roughly halves activation memory."
        )
    else:
        lines.append(f"  - precision: already {ctx.precision}.")
    lines.append("  - before training: lightning_mgpu.estimate_memory(model, batch, ...) predicts what fits.")
    return "\n".join(line for line in lines if line)
