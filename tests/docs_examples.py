"""Run a Markdown page's Python blocks as its reader would, and check what they print.

A page is read top to bottom, like a notebook: its blocks run in order in one folder, and the
blocks that do not start processes share one interpreter session, so a block may use what an
earlier one defined or wrote. The first line of a block may say more:

- ``# model.py``: the block is also saved under that name, so that later blocks (and scripts)
  can ``from model import Net``;
- ``# train.py: run as a script ...``: the block is saved and run as ``python train.py`` in a
  process of its own, as it must be when it starts DDP processes (Lightning's launcher runs the
  script again for every rank); ``exit status 1`` in that line says the script fails on purpose.

A ```` ```text title="Output" ```` block after a Python block shows what it prints, line for line:
the block must be the whole output, but for what varies from run to run and for cuts marked on the
page. A line that is only ``...`` is a cut: it stands for any number of lines (Lightning's start-up
lines, a traceback, another rank's lines). Within a line, ``...`` stands for any text (times, paths,
addresses, memory figures, process ids), and a run of spaces for any other run of spaces, so tables
keep their alignment on the page. Before comparing, the output loses its colours, its progress bars
(a bar's updates share a line with whatever is printed next) and the file and line a warning names
before its text; each ``\r`` ends a line, and blank lines are ignored on both sides.

The page runs in one driver process (this module run as a script), which prints a marker line
after every block; ``check_page`` runs it and checks every block's part of the output.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import REPO, free_port, kill_group, run_command, script_env

FENCE = re.compile(r"^(\s*)```(\w*)(.*)$")
FILE_NAME = re.compile(r"^#\s*([\w-]+\.py)\b")
EXIT_STATUS = re.compile(r"exit status (\d+)")
SCRIPT = "run as a script"
MARKER = "@@@ block {index} exited {status} @@@"
MARKER_LINE = re.compile(r"^@@@ block (\d+) exited (-?\d+) @@@$", flags=re.M)
ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
# a tqdm bar as Lightning draws it: "Epoch 0:  25%|██▌       | 2/8 [00:00<00:00, 54.60it/s, v_num=0]"
PROGRESS_BAR = re.compile(
    r"(?:Sanity Checking|Training|Validation|Testing|Predicting|Epoch \d+)[^\r\n|]*:"  # the stage
    r"[^\r\n|]*\|[^\r\n|]*\|[^\r\n\[]*\[[^\r\n\]]*\]"  # " 25%|██▌  | 2/8 [00:00<00:00, ...]"
)
# where a warning was raised, "/site-packages/lightning_mgpu/strategies/dp/step.py:78: ", which varies
# with the install and the line numbers: the page shows the warning's text
WARNING_SOURCE = re.compile(r"^\S+\.py:\d+: ")
# an Output block's line that stands for any number of lines
ELISION = "..."
# what Lightning prints when an example forgets something a reader should copy right
FORBIDDEN = {
    "is smaller than the logging interval": "pass Trainer(log_every_n_steps=...) below the batches per epoch",
}
SCRIPT_TIMEOUT_S = 240
SESSION_TIMEOUT_S = 120


@dataclass(frozen=True)
class Block:
    """One fenced Python block of a page, and the output the page shows for it."""

    page: Path
    line: int
    code: str
    output: str | None = None

    @property
    def first_line(self) -> str:
        return self.code.lstrip().split("\n", 1)[0]

    @property
    def file_name(self) -> str | None:
        match = FILE_NAME.match(self.first_line)
        return match.group(1) if match else None

    @property
    def as_script(self) -> bool:
        return SCRIPT in self.first_line

    @property
    def exit_status(self) -> int:
        match = EXIT_STATUS.search(self.first_line)
        return int(match.group(1)) if match else 0

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def python_blocks(page: Path) -> list[Block]:
    """The page's ```` ```python ```` blocks, each with the ``title="Output"`` block that follows it."""
    blocks: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, lang, rest = opening.groups()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent) :])
            i += 1
        i += 1
        text = "\n".join(body) + "\n"
        if lang == "python":
            blocks.append(Block(page, start + 1, text))
        elif lang == "text" and 'title="Output"' in rest:
            if not blocks or blocks[-1].output is not None:
                raise ValueError(f"{page}:{start + 1}: an Output block must follow a Python block")
            last = blocks[-1]
            blocks[-1] = Block(last.page, last.line, last.code, text)
    return blocks


def _line_pattern(shown: str) -> re.Pattern[str]:
    """``...`` stands for any text, a run of spaces for any other."""
    parts = (r"\s+".join(map(re.escape, part.split())) for part in shown.split("..."))
    return re.compile(r"\s*" + ".*".join(parts) + r"\s*")


def output_lines(actual: str) -> list[str]:
    """What a reader reads in ``actual``: no colours, no progress bars, no blank lines."""
    text = PROGRESS_BAR.sub("", ANSI_COLOUR.sub("", actual))
    lines = re.split(r"\r\n|\r|\n", text)
    return [WARNING_SOURCE.sub("", line).rstrip() for line in lines if line.strip()]


def unmatched_line(shown: str, actual: str) -> str | None:
    """The first line of ``shown`` that ``actual`` does not print where the page says; ``None`` when none.

    Every line of the output must be matched by a line of ``shown``, in order, or fall in a cut
    (a line that is only ``...``). An output that goes on after the block's last line, with no cut
    there, is reported with the first line the page leaves out.
    """
    lines = output_lines(actual)
    at = {0}  # where the output may stand after the block's lines so far
    for want in (w.rstrip() for w in shown.splitlines() if w.strip()):
        if want.strip() == ELISION:
            at = set(range(min(at), len(lines) + 1))
            continue
        pattern = _line_pattern(want)
        at = {j + 1 for j in at if j < len(lines) and pattern.fullmatch(lines[j])}
        if not at:
            return want
    if len(lines) in at:
        return None
    return f"(the block ends, the output goes on with) {lines[min(at)]}"


def _per_block(stdout: str) -> tuple[list[str], dict[int, int]]:
    """The driver's output cut at its markers: each block's output, and each finished block's status."""
    parts = MARKER_LINE.split(stdout)
    # the text before block 0's marker, then (index, status, text up to the next marker) for each block
    statuses = {int(i): int(s) for i, s in zip(parts[1::3], parts[2::3], strict=True)}
    return [parts[0], *parts[3::3]], statuses


def check_page(page: Path, tmp_path: Path, *, skip: frozenset[str] = frozenset()) -> None:
    """Run every Python block of ``page`` in ``tmp_path`` and assert what it shows.

    Script blocks whose code is in ``skip`` are not run again (another page's test runs them).
    """
    blocks = [b for b in python_blocks(page) if not (b.as_script and b.code in skip)]
    listed = [{"code": b.code, "file": b.file_name, "script": b.as_script} for b in blocks]
    spec = tmp_path / "page.json"
    spec.write_text(json.dumps(listed))
    timeout = sum(SCRIPT_TIMEOUT_S if b.as_script else SESSION_TIMEOUT_S for b in blocks)
    command = [sys.executable, __file__, str(spec)]
    result = run_command(command, cwd=tmp_path, timeout=timeout, env=script_env())
    outputs, statuses = _per_block(result.stdout)
    for index, block in enumerate(blocks):
        out = outputs[index] if index < len(outputs) else ""
        context = f"{block.where}\n--- output ---\n{out[-4000:]}{result.stderr[-2000:]}"
        assert index in statuses, f"{block.where} did not finish (driver: {result.returncode})\n{context}"
        assert statuses[index] == block.exit_status, f"{block.where} exited {statuses[index]}\n{context}"
        if block.output is not None:
            missing = unmatched_line(block.output, out)
            assert missing is None, f"{block.where} does not print, in order: {missing!r}\n{context}"
        for text, fix in FORBIDDEN.items():
            assert text not in out, f"{block.where}: Lightning warns {text!r}: {fix}\n{context}"


def _run_script_block(path: Path, index: int) -> int:
    env = dict(os.environ, MASTER_PORT=str(free_port()))
    proc = subprocess.Popen([sys.executable, path.name], cwd=path.parent, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=SCRIPT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"block {index}: {path.name} ran longer than {SCRIPT_TIMEOUT_S} s")
        return -9
    finally:
        kill_group(proc.pid)


def _drive(spec: Path) -> int:
    """Run the blocks listed in ``spec`` in order; print a marker with each one's exit status."""
    if "LOCAL_RANK" in os.environ:
        print("a session block started DDP processes: its first line must say '# run as a script'")
        return 3
    os.dup2(sys.stdout.fileno(), sys.stderr.fileno())  # one stream, in the order things happen
    folder = spec.parent
    sys.path.insert(0, str(folder))
    session: dict[str, object] = {"__name__": "__main__"}
    for index, block in enumerate(json.loads(spec.read_text())):
        path = folder / (block["file"] or f"block{index}.py")
        if block["file"] or block["script"]:
            path.write_text(block["code"])
        status = 0
        sys.stdout.flush()
        if block["script"]:
            status = _run_script_block(path, index)
        else:
            try:
                exec(compile(block["code"], str(path), "exec"), session)
            except BaseException:  # the reader would see the traceback and stop there
                traceback.print_exc()
                status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        print(f"\n{MARKER.format(index=index, status=status)}", flush=True)
        if status != 0 and not block["script"]:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(_drive(Path(sys.argv[1])))
