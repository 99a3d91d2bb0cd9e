"""``lightning-mgpu export`` and ``lightning-mgpu inspect``."""

from __future__ import annotations

import dataclasses
import enum
import os
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from omegaconf import OmegaConf
from torch import nn

from lightning_mgpu import load_state_dict
from lightning_mgpu.cli.main import main
from tests.checkpoint._models import LitNet, LitTwo, assert_same, lightning_checkpoint, loader, net, trainer
from tests.helpers import run_command, run_script, script_env

_SCRIPT = Path(sys.executable).with_name("lightning-mgpu")
CONSOLE = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "lightning_mgpu"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("cli") / "fit.ckpt"
    # hyperparameters from a config: the file refers to omegaconf classes
    module = lightning_checkpoint(path, cfg=OmegaConf.create({"lr": 0.1, "sizes": [4, 6, 2]}))
    return path, {k: v.clone() for k, v in module.model.state_dict().items()}


def test_export_plain_and_dataparallel(
    ckpt: tuple[Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path, expected = ckpt
    assert main(["export", str(path), str(tmp_path / "plain.safetensors")]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'plain.safetensors'} (safetensors, 9 tensors, 69 values" in out
    assert "removed prefixes: model. (attribute)" in out
    model = net(seed=4)
    model.load_state_dict(safetensors.torch.load_file(tmp_path / "plain.safetensors"))
    assert_same(expected, model.state_dict())

    assert main(["export", str(path), str(tmp_path / "dp.bin"), "--dataparallel", "--format", "pt"]) == 0
    dp = nn.DataParallel(net(seed=4))
    dp.load_state_dict(torch.load(tmp_path / "dp.bin", weights_only=True))
    assert_same(expected, dp.module.state_dict())


def test_export_submodule_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    module = LitTwo()
    torch.save(
        {"pytorch-lightning_version": "2.6.0", "state_dict": module.state_dict()}, tmp_path / "two.ckpt"
    )
    # several submodules: every entry kept, and the report says how to export one
    assert main(["export", str(tmp_path / "two.ckpt"), str(tmp_path / "all.safetensors")]) == 0
    out = capsys.readouterr().out
    assert (
        "kept every entry, named as the LightningModule names them: model (9 tensors), loss_fn (1 tensor)"
        in out
    )
    assert "(command line: --submodule model)" in out
    assert set(safetensors.torch.load_file(tmp_path / "all.safetensors")) == set(module.state_dict())

    args = ["export", str(tmp_path / "two.ckpt"), str(tmp_path / "out.safetensors"), "--submodule", "model"]
    assert main(args) == 0
    assert_same(module.model.state_dict(), safetensors.torch.load_file(tmp_path / "out.safetensors"))

    assert main(["export", str(tmp_path / "missing.ckpt"), str(tmp_path / "x.safetensors")]) == 1
    assert "error: no such file" in capsys.readouterr().err


def test_key_picks_one_of_several_state_dicts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model, ema = net(seed=1).state_dict(), net(seed=2).state_dict()
    torch.save({"epoch": 3, "model": model, "ema": ema}, tmp_path / "train.pt")
    file = str(tmp_path / "train.pt")
    assert main(["inspect", file]) == 1
    err = capsys.readouterr().err
    assert "several state_dicts ('model', 'ema')" in err
    assert "--key model" in err

    assert main(["export", file, str(tmp_path / "ema.safetensors"), "--key", "ema"]) == 0
    assert_same(ema, safetensors.torch.load_file(tmp_path / "ema.safetensors"))
    assert main(["inspect", file, "--key", "ema"]) == 0
    out = capsys.readouterr().out
    assert "weights under 'ema': 9 tensors" in out
    assert f"lightning-mgpu export --key ema --dataparallel {file} {tmp_path / 'train_dp.safetensors'}" in out
    assert main(["export", file, str(tmp_path / "x.safetensors"), "--key", "emma"]) == 1
    err = capsys.readouterr().err
    assert "no entry 'emma'; the entries holding weights are: 'model', 'ema'" in err
    assert main(["export", file, str(tmp_path / "x.safetensors"), "--key", "epoch"]) == 1
    assert "['epoch'] holds a int, not a state_dict" in capsys.readouterr().err
    assert not (tmp_path / "x.safetensors").exists()

    target = net(seed=5)
    assert load_state_dict(target, tmp_path / "train.pt", key="model").ok
    assert_same(model, target.state_dict())


def test_inspect(ckpt: tuple[Path, dict], capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", str(ckpt[0])]) == 0
    out = capsys.readouterr().out
    for line in (
        "Lightning checkpoint (torch zip",
        "weights under 'state_dict': 9 tensors, 69 values (float32 x8, int64 x1)",
        "saved through: model. (LightningModule attribute)",
        "loads into a plain model:          no",
        "  model.3.weight  [2, 6]           float32",
    ):
        assert line in out


class _Touch:
    """Unpickling this would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def test_inspect_refuses_a_pickle_payload(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    marker = tmp_path / "ran"
    torch.save({"x": _Touch(marker)}, tmp_path / "bad.pt")
    assert main(["inspect", str(tmp_path / "bad.pt")]) == 1
    assert "--trust-pickle" in capsys.readouterr().err
    assert not marker.exists()


def test_console_script_and_no_torch_at_import(ckpt: tuple[Path, dict], tmp_path: Path) -> None:
    code = "import sys, lightning_mgpu.cli.export, lightning_mgpu.cli.inspect; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=script_env(), check=True
    )
    assert out.stdout.strip() == "False"

    # a fresh process has not imported omegaconf: the loader does so only when the file needs it
    result = run_command([*CONSOLE, "export", str(ckpt[0]), "w.pt"], cwd=tmp_path)
    assert result.returncode == 0, result.output
    assert torch.load(tmp_path / "w.pt", weights_only=True).keys() == ckpt[1].keys()


def test_trust_pickle_flag(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import argparse

    torch.save({"args": argparse.Namespace(lr=0.1), "state_dict": net().state_dict()}, tmp_path / "old.pth")
    assert main(["inspect", str(tmp_path / "old.pth")]) == 1
    assert "argparse.Namespace" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "old.pth"), str(tmp_path / "w.safetensors"), "--trust-pickle"]) == 0
    assert_same(net().state_dict(), safetensors.torch.load_file(tmp_path / "w.safetensors"))


def test_export_refuses_a_named_pipe(
    ckpt: tuple[Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    os.mkfifo(tmp_path / "fifo")
    assert main(["export", str(ckpt[0]), str(tmp_path / "fifo")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f"lightning-mgpu export: error: cannot write {tmp_path / 'fifo'}: it is a named pipe"
    )
    assert stat.S_ISFIFO((tmp_path / "fifo").stat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]


def test_inspect_a_torch_file_named_safetensors(
    ckpt: tuple[Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    torch.save(ckpt[1], tmp_path / "torch.safetensors")  # a torch file under a safetensors name
    assert main(["inspect", str(tmp_path / "torch.safetensors")]) == 0
    assert "torch.safetensors: state_dict (torch zip" in capsys.readouterr().out


def test_output_into_a_pipe_closed_early(tmp_path: Path) -> None:
    # `lightning-mgpu inspect --all big.pt | head -3`: more output than a pipe holds, reader leaves
    torch.save({f"layer{i}.weight": torch.zeros(1) for i in range(3000)}, tmp_path / "big.pt")
    proc = subprocess.Popen(
        [*CONSOLE, "inspect", "--all", "big.pt"],
        cwd=tmp_path,
        env=script_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    head = [proc.stdout.readline() for _ in range(3)]
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141, err  # 128 + SIGPIPE, what a shell reports for `cat big | head`
    assert head[0].startswith(b"big.pt: state_dict (torch zip")
    assert err == b""


# classes of a training script: pickle records them as __main__.Cfg and __main__.Mode
@dataclasses.dataclass
class Cfg:
    __module__ = "__main__"
    lr: float = 0.1


class Mode(enum.Enum):
    __module__ = "__main__"
    FAST = "fast"


class _Module(LitNet):
    def __init__(self, cfg: Cfg, mode: Mode) -> None:
        super().__init__()
        self.save_hyperparameters()


def test_trust_pickle_with_classes_of_the_training_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as script:  # saved as the training script would save it
        script.setattr(sys.modules["__main__"], "Cfg", Cfg, raising=False)
        script.setattr(sys.modules["__main__"], "Mode", Mode, raising=False)
        fit = trainer(tmp_path)
        fit.fit(_Module(Cfg(), Mode.FAST), loader())
        fit.save_checkpoint(tmp_path / "dataclass.ckpt")

    cli = run_command(
        [*CONSOLE, "export", "dataclass.ckpt", "dc.safetensors", "--trust-pickle"], cwd=tmp_path
    )
    assert cli.returncode == 1
    lines = cli.stderr.splitlines()
    assert len(lines) == 1, cli.stderr
    assert lines[0].startswith("lightning-mgpu export: error: dataclass.ckpt refers to __main__.Cfg, ")
    assert "define or import Cfg in your own script" in lines[0]
    assert not (tmp_path / "dc.safetensors").exists()
    with pytest.raises(ValueError, match=r"refers to __main__.Cfg, a class defined in the script that saved"):
        load_state_dict(net(), tmp_path / "dataclass.ckpt", trust_pickle=True)
    # the safe loader refuses it too, naming both classes and running nothing
    with pytest.raises(ValueError, match=r"not plain weights \(__main__.Cfg, __main__.Mode"):
        load_state_dict(net(), tmp_path / "dataclass.ckpt")


def test_inspect_suggests_commands_that_run_from_the_working_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Paths as typed, outputs next to the input, odd names quoted for a shell."""
    monkeypatch.chdir(tmp_path)
    folder = Path("runs/d 1/checkpoints")
    folder.mkdir(parents=True)
    torch.save({"state_dict": nn.DataParallel(net()).state_dict()}, folder / "final.pth.tar")
    assert main(["inspect", str(folder / "final.pth.tar")]) == 0
    out = capsys.readouterr().out
    assert "export 'runs/d 1/checkpoints/final.pth.tar' 'runs/d 1/checkpoints/final.safetensors'" in out
    assert "loads into nn.DataParallel(model): yes" in out
    assert main(shlex.split(out.split("-> lightning-mgpu ")[1].splitlines()[0])) == 0

    assert main(["inspect", str(folder / "final.safetensors")]) == 0
    out = capsys.readouterr().out
    dp = "'runs/d 1/checkpoints/final_dp.safetensors'"
    assert f"export --dataparallel 'runs/d 1/checkpoints/final.safetensors' {dp}" in out
    # run as printed, from the working folder
    assert main(shlex.split(out.split("-> lightning-mgpu ")[-1].splitlines()[0])) == 0
    written = safetensors.torch.load_file(folder / "final_dp.safetensors")
    assert_same({f"module.{k}": v for k, v in net().state_dict().items()}, written)


def test_ctrl_c_prints_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    torch.save({f"layer{i}.weight": torch.zeros(1024, 1024) for i in range(16)}, tmp_path / "big.pt")
    proc = subprocess.Popen(
        [*CONSOLE, "export", "big.pt", "out.safetensors"],
        cwd=tmp_path,
        env=script_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        # torch is imported only inside the command's run: once its library is mapped, the command runs
        maps = Path(f"/proc/{proc.pid}/maps")
        while proc.poll() is None and "libtorch" not in maps.read_text():
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert err == "lightning-mgpu export: interrupted\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.pt"]


# a signal at the worst moment of a sharded export: inside a read that torch's archive reader calls
# back into Python (a profile hook raises it there, at the second such read: the first is made
# where torch passes an error on unchanged)
_SIGNAL_IN_A_TORCH_READ = """
import signal, sys
from lightning_mgpu.cli.main import main

reads = 0

def signal_in_torch_read(frame, event, arg):
    global reads
    caller = frame.f_back
    if event == "call" and frame.f_code.co_name == "readinto" and caller is not None:
        if caller.f_code.co_filename.endswith("serialization.py"):
            reads += 1
            if reads == 2:
                sys.setprofile(None)
                signal.raise_signal(getattr(signal, sys.argv[1]))

sys.setprofile(signal_in_torch_read)
sys.exit(main(["export", "folder", "out.safetensors"]))
"""


@pytest.mark.parametrize(
    ("signame", "code", "err"),
    [("SIGINT", 130, "lightning-mgpu export: interrupted\n"), ("SIGTERM", -signal.SIGTERM, "")],
)
def test_a_signal_during_a_sharded_export_is_no_damaged_shard(
    tmp_path: Path, signame: str, code: int, err: str
) -> None:
    import torch.distributed.checkpoint as dcp

    weights = {"state_dict": {"w": torch.ones(4, 4), "b": torch.ones(4)}}
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(weights, checkpoint_id=tmp_path / "folder")
    result = run_script(_SIGNAL_IN_A_TORCH_READ, tmp_path, args=[signame])
    assert (result.returncode, result.stderr) == (code, err)  # the exit by the signal, as documented
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "script.py"]
