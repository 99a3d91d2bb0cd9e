"""Bad input: a clear error that says what is wrong, and nothing half-written left behind."""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import stat
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

from lightning_mgpu import export_state_dict, inspect_checkpoint, load_state_dict
from tests.checkpoint._models import assert_same, net
from tests.helpers import run_script


def only_inputs_left(folder: Path, *names: str) -> None:
    assert sorted(p.name for p in folder.iterdir()) == sorted(names), (
        "partial or temporary output left behind"
    )


def all_three(path: Path, out: Path) -> list[Exception]:
    """The error each entry point raises for ``path``."""
    errors = []
    for call in (
        lambda: export_state_dict(path, out),
        lambda: load_state_dict(net(), path),
        lambda: inspect_checkpoint(path),
    ):
        with pytest.raises((ValueError, OSError)) as err:
            call()
        errors.append(err.value)
    return errors


def test_missing_file(tmp_path: Path) -> None:
    for err in all_three(tmp_path / "nope.ckpt", tmp_path / "out.safetensors"):
        assert isinstance(err, FileNotFoundError)
        assert "no such file" in str(err)
        assert "nope.ckpt" in str(err)
    only_inputs_left(tmp_path)


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_truncated_file(tmp_path: Path, fmt: str) -> None:
    whole = tmp_path / f"whole.{fmt}"
    export_state_dict(net(), whole)
    cut = tmp_path / f"cut.{fmt}"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    whole.unlink()
    for err in all_three(cut, tmp_path / "out.safetensors"):
        assert "truncated or corrupt" in str(err), err
    only_inputs_left(tmp_path, f"cut.{fmt}")


def test_empty_and_garbage_files(tmp_path: Path) -> None:
    (tmp_path / "empty.pt").write_bytes(b"")
    assert "empty" in str(all_three(tmp_path / "empty.pt", tmp_path / "o.safetensors")[0])
    (tmp_path / "notes.ckpt").write_text("epoch 3, loss 0.1\n")
    for err in all_three(tmp_path / "notes.ckpt", tmp_path / "o.safetensors"):
        assert "is not a checkpoint" in str(err)
        assert "b'epoch 3" in str(err)
    flipped = bytearray(pickle.dumps(net().state_dict()))
    flipped[0] = 0x80
    flipped[5:40] = os.urandom(35)
    (tmp_path / "garbled.pt").write_bytes(bytes(flipped))
    assert "truncated or corrupt" in str(all_three(tmp_path / "garbled.pt", tmp_path / "o.safetensors")[1])
    only_inputs_left(tmp_path, "empty.pt", "notes.ckpt", "garbled.pt")


def test_files_that_are_not_checkpoints(tmp_path: Path) -> None:
    with zipfile.ZipFile(tmp_path / "photos.zip", "w") as archive:
        archive.writestr("a.txt", "hello")
    assert "zip archive but not a torch checkpoint" in str(
        all_three(tmp_path / "photos.zip", tmp_path / "o")[0]
    )
    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    assert "holds a list, not a dict of tensors" in str(all_three(tmp_path / "list.pt", tmp_path / "o")[0])
    torch.save({"epoch": 3, "optimizer": {"lr": 0.1}}, tmp_path / "meta.pt")
    err = all_three(tmp_path / "meta.pt", tmp_path / "o")[1]
    assert "training checkpoint dict with keys 'epoch', 'optimizer'" in str(err)
    assert "none of them is a state_dict" in str(err)
    torch.save({"model": net().state_dict(), "ema": net().state_dict()}, tmp_path / "two.pt")
    assert "several state_dicts ('model', 'ema')" in str(all_three(tmp_path / "two.pt", tmp_path / "o")[0])
    only_inputs_left(tmp_path, "photos.zip", "list.pt", "meta.pt", "two.pt")


def test_wrong_argument_types() -> None:
    with pytest.raises(TypeError, match="expected a checkpoint path, an nn.Module or a state_dict .*got int"):
        load_state_dict(net(), 3)


class _Payload:
    """Unpickling this runs ``pathlib.Path(marker).touch()``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_pickle_payload_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "code_ran"
    bad = tmp_path / "innocent.ckpt"
    extra = {"payload": _Payload(marker), "args": argparse.Namespace(lr=0.1)}
    torch.save({"state_dict": net().state_dict(), "extra": extra}, bad)
    for err in all_three(bad, tmp_path / "out.safetensors"):
        assert "could run code" in str(err)
        assert "trust_pickle=True" in str(err)
        # every refused global is named, not only the first; paths are allowed, getattr is not
        assert "(argparse.Namespace, builtins.getattr)" in str(err)
    assert not marker.exists()
    legacy = tmp_path / "legacy.pt"
    torch.save({"x": _Payload(marker)}, legacy, _use_new_zipfile_serialization=False)
    assert "could run code" in str(all_three(legacy, tmp_path / "out.safetensors")[0])
    assert not marker.exists()
    only_inputs_left(tmp_path, "innocent.ckpt", "legacy.pt")


def test_ambiguous_prefixes(tmp_path: Path) -> None:
    pair = nn.ModuleDict({"a": net(), "b": net()})
    with pytest.raises(ValueError, match="fit the model in several ways"):
        load_state_dict(net(), pair)
    only_inputs_left(tmp_path)


def test_shape_mismatch_names_the_entry_and_loads_nothing() -> None:
    target = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 5))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=r"3.weight: source \[2, 6\], model \[5, 6\]"):
        load_state_dict(target, net())
    for key, value in target.state_dict().items():
        assert torch.equal(value, before[key])


def test_unwritable_destinations(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "folder").mkdir()
    cases = {
        tmp_path / "file" / "out.safetensors": (NotADirectoryError, "is a file, not a folder"),
        tmp_path / "folder": (IsADirectoryError, "it is a folder"),
        tmp_path / "missing" / "out.pt": (FileNotFoundError, "does not exist"),
    }
    for out, (kind, message) in cases.items():
        with pytest.raises(kind, match=message):
            export_state_dict(net(), out)
    only_inputs_left(tmp_path, "file", "folder")
    assert list((tmp_path / "folder").iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into read-only folders")
def test_read_only_folder(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(PermissionError, match="no permission to create files"):
            export_state_dict(net(), folder / "out.safetensors")
    finally:
        folder.chmod(0o700)


def test_disk_full_mid_write_keeps_the_old_file(tmp_path: Path) -> None:
    # RLIMIT_FSIZE makes the kernel refuse writes past 64 KiB, like a full disk, in a child process
    old = tmp_path / "weights.safetensors"
    old.write_bytes(b"previous export")
    result = run_script(
        """
        import resource, signal, sys, torch
        from lightning_mgpu import export_state_dict
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        for out in ("weights.safetensors", "weights.pt"):
            try:
                export_state_dict({"big": torch.zeros(1024, 1024)}, out)
            except OSError as err:
                print("refused", err.errno, err)
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.output
    assert "refused 27 cannot write weights.safetensors: File too large" in result.stdout  # EFBIG
    assert "refused 27 cannot write weights.pt: File too large" in result.stdout
    assert old.read_bytes() == b"previous export"
    only_inputs_left(tmp_path, "weights.safetensors", "script.py")


def test_a_source_that_cannot_be_read_while_writing_is_named_not_the_target(tmp_path: Path) -> None:
    # chmod 000 stops no root; running out of file descriptors (RLIMIT_NOFILE) stops anyone: the
    # export's own file gets one, the 12 shard files it then opens one by one cannot all
    result = run_script(
        """
        import os, resource, torch
        import torch.distributed.checkpoint as dcp
        from lightning_mgpu import export_state_dict
        values = {f"w{i}": torch.full((4,), float(i)) for i in range(12)}
        dcp.save(values, storage_writer=dcp.FileSystemWriter("ckpt", single_file_per_rank=False))
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (64 + max(map(int, os.listdir("/proc/self/fd"))), hard))
        held = []
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        for _ in range(3):  # what reading the index needs, the export's own file, and one shard
            os.close(held.pop())
        try:
            export_state_dict("ckpt", "out.safetensors")
        except OSError as err:
            print("refused", err.errno, err)
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.output
    assert "refused 24 cannot read ckpt/__0_" in result.stdout  # EMFILE
    assert "Too many open files" in result.stdout
    assert "out.safetensors" not in result.stdout
    only_inputs_left(tmp_path, "ckpt", "script.py")


def test_allowlist_for_hyperparameters_leaves_the_users_own_entries(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from tests.checkpoint._models import lightning_checkpoint

    path = tmp_path / "cfg.ckpt"
    lightning_checkpoint(path, cfg=OmegaConf.create({"lr": 0.1}))
    assert dict not in torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([dict])  # a user's own entry, which must survive
    try:
        assert load_state_dict(net(), path).ok
        allowed = torch.serialization.get_safe_globals()
        assert dict in allowed
        assert not any(getattr(g, "__module__", "").startswith("omegaconf") for g in allowed)
    finally:
        others = [g for g in torch.serialization.get_safe_globals() if g is not dict]
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(others)


def test_devices_pipes_and_sockets_are_refused_before_writing(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tmp_path / "sock"))
        for name, kind in (("fifo", "a named pipe"), ("sock", "a socket")):
            with pytest.raises(
                OSError, match=f"cannot write .*{name}: it is {kind}.*give the name of a file"
            ):
                export_state_dict(net(), tmp_path / name)
        # a link to a device is refused too, not followed into replacing the device
        (tmp_path / "to_fifo.safetensors").symlink_to("fifo")
        with pytest.raises(OSError, match="to_fifo.safetensors: it is a named pipe"):
            export_state_dict(net(), tmp_path / "to_fifo.safetensors")
        assert stat.S_ISFIFO((tmp_path / "fifo").stat().st_mode)
        assert stat.S_ISSOCK((tmp_path / "sock").lstat().st_mode)
        only_inputs_left(tmp_path, "fifo", "sock", "to_fifo.safetensors")


def test_a_symlink_destination_stays_a_link_to_the_new_file(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "w.safetensors"
    target.write_bytes(b"previous export")
    link = tmp_path / "link.safetensors"
    link.symlink_to(Path("real") / "w.safetensors")
    model = net(seed=5)
    report = export_state_dict(model, link)
    assert link.is_symlink()
    assert os.readlink(link) == os.path.join("real", "w.safetensors")
    assert report.bytes == target.stat().st_size
    assert_same(model.state_dict(), safetensors.torch.load_file(target))
    only_inputs_left(tmp_path, "real", "link.safetensors")
    only_inputs_left(tmp_path / "real", "w.safetensors")
    # a link whose target does not exist yet: the target is created
    (tmp_path / "new.pt").symlink_to(Path("real") / "new.pt")
    export_state_dict(model, tmp_path / "new.pt")
    assert (tmp_path / "new.pt").is_symlink()
    assert_same(model.state_dict(), torch.load(tmp_path / "real" / "new.pt", weights_only=True))


def test_a_read_only_destination(tmp_path: Path) -> None:
    out = tmp_path / "w.safetensors"
    out.write_bytes(b"previous export")
    out.chmod(0o444)
    if os.geteuid() != 0:
        with pytest.raises(PermissionError, match=r"w.safetensors: it is read-only \(mode 444\); make it"):
            export_state_dict(net(), out)
        assert out.read_bytes() == b"previous export"
    else:  # root may replace it, as cp may, but the new file is not read-only
        export_state_dict(net(), out)
        umask = os.umask(0)
        os.umask(umask)
        assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask
        assert safetensors.torch.load_file(out)
    only_inputs_left(tmp_path, "w.safetensors")


def test_files_named_against_their_content_are_read_by_content(tmp_path: Path) -> None:
    # torch.load alone hands any *.safetensors name to safetensors, which fails on a torch file
    model = net(seed=2)
    torch.save(model.state_dict(), tmp_path / "zip.safetensors")
    torch.save(model.state_dict(), tmp_path / "legacy.safetensors", _use_new_zipfile_serialization=False)
    export_state_dict(model, tmp_path / "real_safetensors.pt", format="safetensors")
    for name in ("zip.safetensors", "legacy.safetensors", "real_safetensors.pt"):
        target = net(seed=9)
        assert load_state_dict(target, tmp_path / name).ok, name
        assert_same(model.state_dict(), target.state_dict())
        assert "9 tensors" in str(export_state_dict(tmp_path / name, tmp_path / "out.safetensors"))
    (tmp_path / "corrupt.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    for err in all_three(tmp_path / "corrupt.safetensors", tmp_path / "out.pt"):
        assert "corrupt.safetensors is truncated or corrupt" in str(err)


def test_trusted_file_whose_class_cannot_be_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mytrain.py").write_text("class Cfg:\n    lr = 0.1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import mytrain  # type: ignore[import-not-found]

    path = tmp_path / "fit.ckpt"
    torch.save({"state_dict": net().state_dict(), "hyper_parameters": {"cfg": mytrain.Cfg()}}, path)
    monkeypatch.delitem(sys.modules, "mytrain")
    (tmp_path / "mytrain.py").unlink()
    with pytest.raises(ValueError, match=r"refers to mytrain.Cfg, which cannot be imported here \(No module"):
        load_state_dict(net(), path, trust_pickle=True)
    (tmp_path / "mytrain.py").write_text("class Config:\n    pass\n")
    with pytest.raises(ValueError, match="mytrain has no Cfg here: use the version of mytrain that saved"):
        load_state_dict(net(), path, trust_pickle=True)
