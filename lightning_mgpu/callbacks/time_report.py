"""``DeviceTimeMonitor``'s report: plain per-rank totals in, the table, the verdict and the JSON out.

- ``RankTime``: what one rank (one process, and its devices) spent over the fit, per phase;
- ``verdict``: balanced, or the slowest rank, by how much, the phase it loses the time in and
  what to try, decided from the totals alone;
- ``table`` and ``summary_json``: what rank 0 logs and writes at the end of ``fit``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from lightning_mgpu._words import aligned

__all__ = ["RankTime", "Verdict", "summary_json", "table", "verdict"]

# a rank's own time (data + work) this much above the others' median names it
SLOWER_THRESHOLD = 0.10
# one process alone: its loader is named when it waits this share of the time for batches
DATA_SHARE_THRESHOLD = 0.25


@dataclass
class RankTime:
    """One rank's seconds over the training steps of a fit (or of a window of them), per phase.

    Mutable: the monitor adds each batch to its window in place, which a training step does not notice.
    """

    rank: int
    device: str
    """The rank's device(s): ``cpu:rank1``, ``cuda:3``, ``cuda:0,cuda:1`` (``mgpu_dp``'s replicas)."""
    steps: int = 0
    samples: int = 0
    """Rows of every batch the rank trained on (under ``mgpu_dp``: the whole batch of its replicas)."""
    data_s: float = 0.0
    """Waiting for the next batch: from the end of a step to the start of the next."""
    work_s: float = 0.0
    """Forward, backward and optimizer step, less ``wait_s``."""
    wait_s: float | None = None
    """Blocked on the other ranks (DDP's gradient all-reduce after its own backward, FSDP's gathers and
    reduce-scatters on CPU); ``None``: not measured."""

    def add_step(self, step_s: float, wait_s: float | None) -> None:
        """One more batch of ``step_s`` seconds, ``wait_s`` of them waiting (``None``: not measured)."""
        self.steps += 1
        wait_s = None if wait_s is None else min(wait_s, step_s)
        self.work_s += step_s - (wait_s or 0.0)
        if wait_s is not None:
            self.wait_s = (self.wait_s or 0.0) + wait_s

    def __add__(self, later: RankTime) -> RankTime:
        """Both spans' sums; waiting is unknown when either has it unknown (NaN in the vectors)."""
        sums = [a + b for a, b in zip(self.vector(), later.vector(), strict=True)]
        return RankTime.from_vector(self.rank, self.device, sums)

    def vector(self) -> list[float]:
        """The numbers ranks exchange; their devices travel once, at the start of a fit."""
        wait = math.nan if self.wait_s is None else self.wait_s
        return [self.steps, self.samples, self.data_s, self.work_s, wait]

    @classmethod
    def from_vector(cls, rank: int, device: str, values: list[float]) -> RankTime:
        steps, samples, data, work, wait = values
        return cls(rank, device, int(steps), int(samples), data, work, None if math.isnan(wait) else wait)

    def metrics(self, prefix: str) -> dict[str, float]:
        """Means per batch in ms, and samples per second, under ``prefix``."""
        if not self.steps:
            return {}
        per = 1e3 / self.steps
        values = {f"{prefix}/data_ms": self.data_s * per, f"{prefix}/work_ms": self.work_s * per}
        if self.wait_s is not None:
            values[f"{prefix}/wait_ms"] = self.wait_s * per
        values[f"{prefix}/samples_per_s"] = self.samples_per_s
        return values

    @property
    def own_s(self) -> float:
        """The time the rank needs by itself: its data and its work, without waiting for the others."""
        return self.data_s + self.work_s

    @property
    def total_s(self) -> float:
        return self.data_s + self.work_s + (self.wait_s or 0.0)

    def share(self, seconds: float | None) -> float | None:
        if seconds is None:
            return None
        return seconds / self.total_s if self.total_s > 0 else 0.0

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.total_s if self.total_s > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.total_s if self.total_s > 0 else 0.0


@dataclass(frozen=True)
class Verdict:
    """Balanced (``rank is None``), or the rank that holds the others back and what to try."""

    rank: int | None
    device: str = ""
    slower_by: float = 0.0
    """How much longer its own time is than the other ranks' median: 0.4 is 40 % slower."""
    phase: str = ""
    """``"data loading"`` or ``"work"``; empty when balanced."""
    advice: str = ""
    note: str = ""
    """What the verdict could not see (waiting not measured under this strategy)."""

    def line(self) -> str:
        """The one line rank 0 logs at the end of ``fit``."""
        if self.rank is None:
            text = "Time: balanced, no rank holds the others back"
            text += f"; {self.advice}" if self.advice else "."
        else:
            slower = ""
            if self.slower_by >= 1:  # "496 % slower" reads worse than "6.0x as slow"
                slower = f" is {1 + self.slower_by:.1f}x as slow as the others and"
            elif self.slower_by > 0:
                slower = f" is {100 * self.slower_by:.0f} % slower than the others and"
            text = (
                f"Time: rank {self.rank} ({self.device}){slower} loses the time in {self.phase}."
                f" Try: {self.advice}"
            )
        return f"{text} ({self.note})" if self.note else text


def verdict(ranks: list[RankTime], accelerator: str = "cpu") -> Verdict:
    """Name the rank that holds the others back, the phase it loses the time in and what to try.

    - Every rank waits for the slowest at each collective (DDP's gradient all-reduce, FSDP's
      gathers), so each rank's own time
      (data + work, without the waiting) is compared with the other ranks' median;
    - a rank more than 10 % above it is named, with the phase (data loading or work) where its
      excess is larger; otherwise the run is balanced;
    - one process alone is named when it waits more than a quarter of its time for batches;
    - where waiting is not measured (``wait_s is None``) work includes it, so only data loading
      can single out a rank, and the verdict says so.
    """
    if not ranks:
        return Verdict(rank=None, note="no training step ran")
    unmeasured = len(ranks) > 1 and any(r.wait_s is None for r in ranks)
    note = (
        "waiting for the other ranks is not measured under this strategy; work includes it"
        if unmeasured
        else ""
    )
    if len(ranks) == 1:
        only = ranks[0]
        if (only.share(only.data_s) or 0.0) > DATA_SHARE_THRESHOLD:
            return Verdict(
                only.rank, only.device, 0.0, "data loading", _advice("data loading", only, accelerator)
            )
        return Verdict(rank=None)
    key = (lambda r: r.data_s) if unmeasured else (lambda r: r.own_s)
    slowest = max(ranks, key=key)
    others = [r for r in ranks if r is not slowest]
    base = statistics.median(key(r) for r in others)
    slower_by = key(slowest) / base - 1 if base > 0 else 0.0
    if unmeasured:  # data time alone: compare it with the whole step, not with a tiny loader time
        total = statistics.median(r.total_s for r in ranks)
        slower_by = (slowest.data_s - base) / total if total > 0 else 0.0
    if slower_by <= SLOWER_THRESHOLD:
        waits = [r.share(r.wait_s) or 0.0 for r in ranks]
        advice = ""
        if max(waits) > 0.3:
            advice = (
                f"{100 * max(waits):.0f} % of a step is spent in the collectives themselves: fewer, larger"
                " steps (a larger batch or accumulate_grad_batches) spend less of the time in them."
            )
        return Verdict(rank=None, advice=advice, note=note)
    if unmeasured:
        phase = "data loading"
    else:
        extra_data = slowest.data_s - statistics.median(r.data_s for r in others)
        extra_work = slowest.work_s - statistics.median(r.work_s for r in others)
        phase = "data loading" if extra_data >= extra_work else "work"
    return Verdict(slowest.rank, slowest.device, slower_by, phase, _advice(phase, slowest, accelerator), note)


def _advice(phase: str, rank: RankTime, accelerator: str) -> str:
    if phase == "data loading":
        return (
            "give the DataLoader more workers (num_workers=, persistent_workers=True), pin_memory=True on"
            f" GPUs, and check what its Dataset does for the samples rank {rank.rank} gets (slow files,"
            " larger items, a per-rank shard)."
        )
    if accelerator == "cuda":
        return (
            f"look at {rank.device} (nvidia-smi: clocks, temperature, power, other processes on it) and at"
            " the rows it gets per step; micro_batch_size= or a smaller batch on a smaller card evens it out."
        )
    return (
        f"look at what else runs on rank {rank.rank}'s CPU cores (other processes, torch.set_num_threads),"
        " at the rows it gets per step, and at anything its training_step does on that rank only."
    )


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def table(ranks: list[RankTime], title: str = "Time per rank over the fit:") -> str:
    """One row per rank: device, steps/s, data %, work %, waiting %, samples/s; then the run's samples/s."""
    header = ["Rank", "Device", "Steps/s", "Data", "Work", "Waiting", "Samples/s"]
    rows = [header] + [
        [
            str(r.rank),
            r.device,
            f"{r.steps_per_s:.2f}",
            _percent(r.share(r.data_s)),
            _percent(r.share(r.work_s)),
            _percent(r.share(r.wait_s)),
            f"{r.samples_per_s:.1f}",
        ]
        for r in ranks
    ]
    lines = ([title] if title else []) + aligned(rows, sep="  ", right_from=2)
    for r in ranks:
        replicas = r.device.count(",") + 1
        if replicas > 1:
            lines.append(
                f"Rank {r.rank} runs {replicas} mgpu_dp replicas in one process: they run each batch together"
                " (forward in threads, one backward and optimizer step) and finish together, so they are one"
                " row; a slow replica shows as its work."
            )
    lines.append(f"Run: {run_samples_per_s(ranks):.1f} samples/s")
    return "\n".join(lines)


def run_samples_per_s(ranks: list[RankTime]) -> float:
    """Every rank's samples over the longest rank's time: what the run trains per second."""
    longest = max((r.total_s for r in ranks), default=0.0)
    return sum(r.samples for r in ranks) / longest if longest > 0 else 0.0


def summary_json(ranks: list[RankTime], found: Verdict) -> dict[str, Any]:
    """``time_summary.json``: every rank's totals and shares, the run's samples/s and the verdict."""
    return {
        "ranks": [
            {
                **asdict(r),
                "steps_per_s": r.steps_per_s,
                "samples_per_s": r.samples_per_s,
                "data_share": r.share(r.data_s),
                "work_share": r.share(r.work_s),
                "wait_share": r.share(r.wait_s),
            }
            for r in ranks
        ],
        "samples_per_s": run_samples_per_s(ranks),
        "verdict": {**asdict(found), "line": found.line()},
    }
