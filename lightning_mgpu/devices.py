"""What devices exist and what they hold: torch.cuda, NVML (nvidia-ml-py) and psutil.

- ``cuda_devices()`` lists the visible CUDA devices with their physical index (the
  one ``nvidia-smi`` shows) when ``CUDA_VISIBLE_DEVICES`` remaps them.
- ``allocator_memory(device)`` reads the caching allocator of one CUDA device.
- ``nvml_memory(device)`` reads used/total memory as ``nvidia-smi`` counts it
  (all processes and CUDA contexts), when NVML is installed.
- ``process_memory()`` reads this process's RSS and peak RSS.
- ``cpu_name()`` names the processor, for CPU runs.
- ``nvml_available()`` says whether NVML can be queried here at all.
- ``parse_bytes("12GiB")`` and ``format_bytes(n)`` convert memory sizes for people.

Nothing here initialises CUDA unless it has to read a CUDA device's allocator, so
it is safe to call before Lightning forks processes. Nothing here knows about
strategies.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import re
import resource
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "DeviceInfo",
    "GPUProcess",
    "MiB",
    "allocator_memory",
    "cpu_name",
    "cpu_summary",
    "cuda_devices",
    "format_bytes",
    "nvml_available",
    "nvml_memory",
    "parse_bytes",
    "process_memory",
    "visible_cuda_devices",
]

MiB = 1024**2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GPUProcess:
    """A process holding memory on a GPU, as NVML reports it."""

    pid: int
    used_bytes: int | None
    name: str = ""


@dataclass(frozen=True)
class DeviceInfo:
    """One visible CUDA device."""

    index: int
    """Index as torch sees it (``cuda:<index>``), after ``CUDA_VISIBLE_DEVICES``."""
    physical: str
    """Index or UUID as ``nvidia-smi`` shows it."""
    name: str
    total_bytes: int | None = None
    used_bytes: int | None = None
    """Used memory as ``nvidia-smi`` counts it; ``None`` without NVML."""
    processes: tuple[GPUProcess, ...] = field(default_factory=tuple)


def visible_cuda_devices() -> list[str] | None:
    """Entries of ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs), or ``None`` when it is unset."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    entries = [e.strip() for e in value.split(",") if e.strip()]
    # CUDA stops at the first invalid entry, such as -1
    return list(itertools.takewhile(lambda entry: not entry.startswith("-"), entries))


@functools.lru_cache(maxsize=1)
def _nvml() -> Any:
    """The initialised ``pynvml`` module, or ``None`` when NVML cannot be used here (initialised once)."""
    try:
        import pynvml
    except ImportError:
        log.debug("NVML not used: nvidia-ml-py is not installed")
        return None
    try:
        pynvml.nvmlInit()
    except Exception as err:  # no driver, no library: NVML is simply not available
        log.debug("NVML not used: nvmlInit failed (%s)", err)
        return None
    return pynvml


def nvml_available() -> bool:
    """Whether NVML (``pip install lightning-mgpu[nvml]``) is installed and finds a driver."""
    return _nvml() is not None


def _physical(index: int) -> str:
    """The entry of ``CUDA_VISIBLE_DEVICES`` (index or UUID) behind torch's ``cuda:<index>``."""
    visible = visible_cuda_devices()
    return visible[index] if visible is not None and index < len(visible) else str(index)


def _nvml_handle(index: int) -> Any | None:
    """NVML's handle of torch's ``cuda:<index>``, or ``None`` without NVML."""
    nvml, physical = _nvml(), _physical(index)
    if nvml is None:
        return None
    try:
        if physical.isdigit():
            return nvml.nvmlDeviceGetHandleByIndex(int(physical))
        return nvml.nvmlDeviceGetHandleByUUID(physical)
    except Exception:
        return None


def cuda_devices() -> list[DeviceInfo]:
    """Every CUDA device torch can see, with NVML's view of its memory where NVML is installed.

    Returns an empty list on a machine without CUDA.
    """
    if not torch.cuda.is_available():
        return []
    nvml = _nvml()
    result = []
    for index in range(torch.cuda.device_count()):
        handle = _nvml_handle(index)
        if handle is None:
            props = torch.cuda.get_device_properties(index)
            result.append(DeviceInfo(index, _physical(index), props.name, total_bytes=props.total_memory))
            continue
        mem = nvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            running = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:  # some drivers refuse the process query inside containers
            running = []
        procs = tuple(GPUProcess(p.pid, p.usedGpuMemory, _process_name(p.pid)) for p in running)
        name = nvml.nvmlDeviceGetName(handle)  # a str since nvidia-ml-py 11.515, below the floor (12)
        result.append(DeviceInfo(index, _physical(index), name, int(mem.total), int(mem.used), procs))
    return result


def _process_name(pid: int) -> str:
    try:
        import psutil

        return str(psutil.Process(pid).name())
    except Exception:  # the process may belong to another user or be gone already
        return ""


def nvml_memory(device: torch.device | int) -> tuple[int, int] | None:
    """``(used, total)`` bytes of a CUDA device as ``nvidia-smi`` counts them, or ``None`` without NVML."""
    handle = _nvml_handle(device if isinstance(device, int) else device.index or 0)
    if handle is None:
        return None
    mem = _nvml().nvmlDeviceGetMemoryInfo(handle)
    return int(mem.used), int(mem.total)


def allocator_memory(device: torch.device, reset_peak: bool = False) -> dict[str, int]:
    """Bytes the caching allocator holds on a CUDA device.

    Keys: ``allocated``, ``reserved``, ``peak_allocated`` and ``peak_reserved`` (peaks
    since the last reset). With ``reset_peak=True`` the peaks are reset after reading,
    so the next call reports the peak since this one.
    """
    if device.type != "cuda":
        raise ValueError(f"allocator_memory needs a CUDA device, got {device}")
    stats = {
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "peak_allocated": torch.cuda.max_memory_allocated(device),
        "peak_reserved": torch.cuda.max_memory_reserved(device),
    }
    if reset_peak:
        torch.cuda.reset_peak_memory_stats(device)
    return stats


@functools.lru_cache(maxsize=1)
def _proc_status(pid: int) -> int | None:
    """An open descriptor of ``/proc/<pid>/status`` (Linux), re-opened after a fork."""
    try:
        return os.open(f"/proc/{pid}/status", os.O_RDONLY)
    except OSError:
        return None


def _status_kib(data: bytes, key: bytes) -> int:
    start = data.index(key) + len(key)
    return int(data[start : data.index(b"kB", start)])


def process_memory() -> dict[str, int]:
    """This process's resident memory: ``rss`` now and ``peak_rss`` since it started, in bytes.

    On Linux both come from one read of ``/proc/self/status`` through a kept descriptor
    (``VmRSS``, ``VmHWM``): about 10 us, where ``getrusage`` can take milliseconds in a
    process whose other threads are busy (it sums every thread's CPU time).
    """
    fd = _proc_status(os.getpid()) if sys.platform.startswith("linux") else None
    if fd is not None:
        data = os.pread(fd, 8192, 0)
        rss = _status_kib(data, b"VmRSS:") * 1024
        return {"rss": rss, "peak_rss": max(rss, _status_kib(data, b"VmHWM:") * 1024)}
    import psutil

    rss = int(psutil.Process().memory_info().rss)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is KiB on Linux, bytes on macOS
    peak_bytes = peak if sys.platform == "darwin" else peak * 1024
    return {"rss": rss, "peak_rss": max(rss, peak_bytes)}


def cpu_name() -> str:
    """The processor's model name (``/proc/cpuinfo`` on Linux), or ``"CPU"`` when unknown.

    Example::

        cpu_name()  # 'AMD EPYC 7763 64-Core Processor'
    """
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() or "CPU"
    except OSError:
        pass
    import platform

    return platform.processor() or "CPU"


def cpu_summary() -> dict[str, int]:
    """Logical CPU cores and system RAM (total and used) in bytes."""
    import psutil

    vm = psutil.virtual_memory()
    return {
        "cores": os.cpu_count() or 1,
        "ram_total": int(vm.total),
        "ram_used": int(vm.total - vm.available),
    }


# B, then for each power: K/M/G/T (1024), KB/MB/GB/TB (1000), KiB/MiB/GiB/TiB (1024), lower-cased
_UNITS = {"": 1, "b": 1} | {
    unit: base**power
    for power, letter in enumerate("kmgt", start=1)
    for unit, base in ((letter, 1024), (f"{letter}b", 1000), (f"{letter}ib", 1024))
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """A memory size in bytes, from a number of bytes or a string such as ``"12GiB"``, ``"80GB"``, ``"512M"``.

    Units: ``B``, ``KB``/``MB``/``GB``/``TB`` (powers of 1000), ``KiB``/``MiB``/``GiB``/``TiB`` and the
    single letters ``K``/``M``/``G``/``T`` (powers of 1024), in any letter case.

    Raises:
        ValueError: if the value is not a positive size in one of those forms.

    Example::

        parse_bytes("12GiB")  # 12884901888
        parse_bytes(1024)     # 1024
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a memory size such as 12GiB or a number of bytes, got {value!r}")
    if isinstance(value, (int, float)):
        number, factor = float(value), 1
    else:
        match = _SIZE.match(str(value))
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"cannot read the memory size {value!r}: write a number with an optional unit,"
                " e.g. 12GiB, 80GB, 512MiB, 16G or 1000000 (bytes)"
            )
        number, factor = float(match.group(1)), _UNITS[unit]
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"a memory size must be a positive number of bytes, got {value!r}")
    return int(number * factor)


def format_bytes(n: float | None) -> str:
    """``n`` bytes for people, in the largest binary unit that keeps the number at least 1 (``"1.50 GiB"``).

    Example::

        format_bytes(3 * 1024**2)  # '3.00 MiB'
    """
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    return f"{sign}{n:.2f} TiB"
