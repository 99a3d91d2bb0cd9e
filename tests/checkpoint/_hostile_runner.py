"""Read every damaged folder as a user would, in a process of its own, and record what happened.

Usage: ``python -m tests.checkpoint._hostile_runner PLAN.json RESULTS.json``, where the plan lists
``{"name", "folder", "out"}`` and ``"reference"`` (the saved weights, a ``.pt`` file).

For each folder: ``lightning-mgpu export`` and ``lightning-mgpu inspect`` (the command line's own
``main``, its output captured), then ``load_state_dict`` into a model. Meanwhile an audit hook
(``sys.addaudithook``: every ``open``, ``os.listdir`` and ``os.scandir``) records the paths
touched, and a dispatch mode the largest CPU tensor any torch operation made; the address space is
limited to what the process held after a first export plus 2 GiB, so an allocation the folder's
claims would cause fails rather than taking the machine's memory. A traceback is recorded as such.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import sys
import traceback
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_mgpu import load_state_dict
from lightning_mgpu.cli.main import main
from tests.checkpoint._sharded import plain_model


class Allocations(TorchDispatchMode):
    """The largest storage of a CPU tensor that a torch operation returned while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                self.largest = max(self.largest, value.untyped_storage().nbytes())
        return out


class Touched:
    """Paths opened or listed while :attr:`active`, seen by an audit hook."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.active = False
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        if self.active and event in ("open", "os.listdir", "os.scandir") and args:
            path = args[0]
            if isinstance(path, (str, bytes, os.PathLike)):
                self.paths.append(os.path.abspath(os.fsdecode(path)))


def within(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def cli(*args: str) -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    except BaseException:  # what a user would have seen: a traceback
        return {"code": None, "stderr": err.getvalue() + traceback.format_exc(), "stdout": out.getvalue()}
    return {"code": code, "stderr": err.getvalue(), "stdout": out.getvalue()}


def load(folder: str, reference: dict[str, torch.Tensor]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = plain_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result: dict[str, Any] = {"error": None, "traceback": None}
    try:
        load_state_dict(model, folder)
    except (ValueError, OSError) as err:  # what load_state_dict documents
        result["error"] = str(err)
    except BaseException:
        result["traceback"] = traceback.format_exc()
    after = model.state_dict()
    result["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    result["loaded"] = all(torch.equal(reference[k], after[k]) for k in reference)
    return result


def written(out: Path, reference: dict[str, torch.Tensor]) -> bool | None:
    if not out.exists():
        return None
    weights = safetensors.torch.load_file(out)
    return weights.keys() == reference.keys() and all(
        torch.equal(weights[k], reference[k]) for k in reference
    )


def run(plan: dict[str, Any]) -> list[dict[str, Any]]:
    reference = torch.load(plan["reference"], weights_only=True)
    touched, allocations = Touched(), Allocations()
    # the first export and load import what every later one uses (torch._dynamo, under a dispatch
    # mode, which probes the temporary folder), and start their threads
    with allocations:
        assert cli("export", plan["warm"], plan["warm_out"])["code"] == 0
        assert load(plan["warm"], reference)["loaded"]
    limit_address_space(2 << 30)
    imports = sorted({sys.prefix, sys.base_prefix, sys.exec_prefix, str(Path(__file__).resolve().parents[2])})
    results = []
    for variant in plan["variants"]:
        folder, out = variant["folder"], Path(variant["out"])
        out.mkdir(parents=True)
        target = out / "weights.safetensors"
        touched.paths, touched.active = [], True
        with allocations:
            export = cli("export", folder, str(target))
            inspect = cli("inspect", folder)
            loaded = load(folder, reference)
        touched.active = False
        allowed = [folder, str(out), *imports, "/proc", "/dev/null"]
        results.append(
            {
                "name": variant["name"],
                "export": export,
                "inspect": inspect,
                "load": loaded,
                "written": written(target, reference),
                "left": sorted(p.name for p in out.iterdir() if p != target),
                "outside": sorted({p for p in touched.paths if not within(p, allowed)}),
                "largest": allocations.largest,
            }
        )
        allocations.largest = 0
    return results


def limit_address_space(margin: int) -> None:
    with open("/proc/self/status") as status:
        held = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (held + margin, hard))


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(json.dumps(run(json.loads(Path(sys.argv[1]).read_text()))))
