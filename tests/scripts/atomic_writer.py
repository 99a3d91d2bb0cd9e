"""Start an atomic write, say so, then wait to be killed in the middle of it.

Usage: ``python atomic_writer.py`` in the folder to write ``w.safetensors`` into
(tests/checkpoint/test_interrupted_writes.py). Prints ``writing`` once the temporary file holds
part of the data, then sleeps for a minute: the test sends the signal meanwhile.
"""

from __future__ import annotations

import time

from lightning_mgpu._atomic import atomic_write

if __name__ == "__main__":
    with atomic_write("w.safetensors") as f:
        f.write(b"half of an export")
        f.flush()
        print("writing", flush=True)
        time.sleep(60)
