"""How much a sharded folder's export grows this process's peak memory, in bytes.

Usage: ``python export_peak.py FOLDER WARM OUT`` (tests/checkpoint/test_sharded.py). Exports
``WARM`` first (imports and first-call set-up, not counted), then ``FOLDER`` to ``OUT``, and prints
the peak resident memory (``VmHWM``) reached during the second export, less what was resident before.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning_mgpu import export_state_dict


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


if __name__ == "__main__":
    folder, warm, out = (Path(a) for a in sys.argv[1:])
    export_state_dict(warm, out.with_name("warm.safetensors"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from here: imports peaked higher than they ended
    before = status("VmRSS")
    export_state_dict(folder, out)
    print(status("VmHWM") - before)
