"""The newest complete checkpoint of a run, and why each newer one is not complete.

Lightning's own ``fit(ckpt_path="last")`` takes the newest ``last*.ckpt`` (``ModelCheckpoint(save_last=True)``
only), complete or not; here every checkpoint of the run counts, and one a kill cut short is skipped.

A run's checkpoints are the ``*.ckpt`` files and sharded ``*.ckpt`` folders in its
``ModelCheckpoint`` folders, and the ``hpc_ckpt_<n>.ckpt`` files Lightning saves for SLURM in
``default_root_dir``. They are tried newest first (by the time their last part was written), and
the first complete one wins. What a kill leaves behind, and how it is told apart, without reading
more than a file's zip directory:

- a ``.ckpt`` cut while being written (Lightning moves its temporary file into place with a copy
  when the temporary folder is on another file system, and other writers write in place): its zip
  directory, written last, is missing or does not list the pickle;
- a sharded folder whose ranks did not all finish: no ``.metadata`` (torch renames it into place
  once every rank wrote its shard), or no ``meta.pt`` (Lightning's loop state, written by rank 0
  after that), or a truncated one;
- a sharded folder that a save was writing over: a ``meta.pt`` older than, or a shard newer than,
  its ``.metadata``;
- a link to a file that no longer exists.
"""

from __future__ import annotations

import dataclasses
import logging
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Choice", "Skipped", "find_checkpoints", "interruption", "newest_complete", "set_aside"]

log = logging.getLogger(__name__)

_DCP_INDEX = ".metadata"  # torch.distributed.checkpoint's
_LIGHTNING_META = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME


@dataclass(frozen=True)
class Skipped:
    """A checkpoint newer than the one chosen, and why it cannot be resumed from."""

    path: str
    reason: str
    moved_to: str | None = None
    """Where :func:`set_aside` moved it."""


@dataclass(frozen=True)
class Choice:
    """The checkpoint to resume from (``None``: none is complete) and the newer ones skipped."""

    path: str | None
    skipped: tuple[Skipped, ...] = ()
    searched: tuple[str, ...] = ()
    """The folders searched, for the message when none was found."""
    earlier_runs: tuple[str, ...] = ()
    """Complete or not, the checkpoints left out as written before the run started, newest first."""


def _zip_problem(path: Path) -> str | None:
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError) as err:
        return f"its zip directory cannot be read ({err}): it was cut while being written"
    if not any(name.endswith("data.pkl") for name in names):
        return "its zip directory lists no data.pkl: it was cut while being written"
    return None


def _folder_problem(folder: Path) -> str | None:
    index = folder / _DCP_INDEX
    if not index.is_file():
        return f"it has no {_DCP_INDEX}: the save ended before every rank had written its shard"
    meta = folder / _LIGHTNING_META
    if not meta.is_file():
        return f"it has no {_LIGHTNING_META}: the save ended before rank 0 wrote the loop state"
    problem = _zip_problem(meta)
    if problem is not None:
        return f"{_LIGHTNING_META}: {problem}"
    written = index.stat().st_mtime
    if meta.stat().st_mtime < written:
        return f"its {_LIGHTNING_META} is older than its {_DCP_INDEX}: a save over it did not finish"
    shards = [p for p in folder.iterdir() if p.suffix == ".distcp"]
    if not shards:
        return "it has no .distcp shard"
    if any(p.stat().st_mtime > written for p in shards):
        return f"a shard is newer than its {_DCP_INDEX}: a save over it did not finish"
    return None


def interruption(path: Path) -> str | None:
    """Why the checkpoint at ``path`` was cut before its save finished; ``None`` if it is complete."""
    if path.is_symlink() and not path.exists():
        return f"it links to {path.resolve()}, which does not exist"
    if path.is_dir():
        return _folder_problem(path)
    return _zip_problem(path)


def _written(path: Path) -> int | None:
    """When the checkpoint's last part was written, in ``st_mtime_ns`` (a folder: its newest file);
    ``None`` once it is gone (an older checkpoint a ``ModelCheckpoint`` replaced meanwhile)."""
    try:
        if path.is_dir():
            newest = (p.stat().st_mtime_ns for p in path.iterdir() if p.is_file())
            return max(newest, default=path.stat().st_mtime_ns)
        return path.stat().st_mtime_ns if path.exists() else path.lstat().st_mtime_ns
    except OSError:
        return None


def find_checkpoints(checkpoint_folders: Iterable[str | Path], hpc_folder: str | Path | None) -> list[Path]:
    """Every checkpoint of the run, newest first: ``*.ckpt`` in ``checkpoint_folders``,
    ``hpc_ckpt_*.ckpt`` in ``hpc_folder``."""
    found: dict[Path, int | None] = {}
    for folder, pattern in [
        *((Path(f), "*.ckpt") for f in checkpoint_folders),
        (hpc_folder, "hpc_ckpt_*.ckpt"),
    ]:
        if folder is not None and Path(folder).is_dir():
            found.update((path, _written(path)) for path in Path(folder).glob(pattern))
    written = {path: when for path, when in found.items() if when is not None}
    return sorted(written, key=lambda p: (written[p], str(p)), reverse=True)


def newest_complete(
    candidates: Sequence[Path], searched: Sequence[str] = (), since_ns: int | None = None
) -> Choice:
    """The first complete checkpoint of ``candidates`` (newest first), with the newer ones skipped.

    ``since_ns``: leave out the checkpoints last written before it (``st_mtime_ns``), an earlier run's.
    """
    older: tuple[str, ...] = ()
    if since_ns is not None:
        written = {path: _written(path) for path in candidates}
        older = tuple(str(path) for path, when in written.items() if when is not None and when < since_ns)
        candidates = [path for path, when in written.items() if when is not None and when >= since_ns]
    skipped: list[Skipped] = []
    seen: set[Path] = set()
    for path in candidates:
        target = path.resolve()
        if target in seen and path.is_symlink():
            continue  # last.ckpt linking to a checkpoint already tried
        seen.add(target)
        reason = interruption(path)
        if reason is None:
            return Choice(str(path), tuple(skipped), tuple(searched), older)
        log.debug("not resuming from %s: %s", path, reason)
        skipped.append(Skipped(str(path), reason))
    return Choice(None, tuple(skipped), tuple(searched), older)


def set_aside(skipped: Skipped) -> Skipped:
    """Rename a checkpoint a kill cut short to ``<name>.incomplete`` (or ``.incomplete-<n>``), out of the
    run's way: ``ModelCheckpoint`` would save that step again as ``<name>-v1``, beside a file that looks
    complete by its name. Renamed, not removed: whether it really is cut short is read from its layout."""
    path = Path(skipped.path)
    target, n = path.with_name(f"{path.name}.incomplete"), 1
    while target.exists() or target.is_symlink():
        n += 1
        target = path.with_name(f"{path.name}.incomplete-{n}")
    try:
        path.rename(target)
    except OSError as err:
        log.warning(
            "cannot move %s out of the way (%s): the next save of its step takes another name", path, err
        )
        return skipped
    return dataclasses.replace(skipped, moved_to=str(target))
