"""``lightning-mgpu``'s entry point: an error the user can fix is one line, a bug keeps its traceback.

``bug_in_a_subcommand`` below is a real subcommand module (``add_arguments``, ``run``) whose ``run``
fails the way a bug in the project's own code would.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_mgpu.cli import main as cli_main
from lightning_mgpu.cli.main import main

_FAILURES: dict[str, Exception] = {
    "key": KeyError("recipe_list"),
    "type": TypeError("unsupported operand type(s) for +: 'int' and 'str'"),
    "attribute": AttributeError("'NoneType' object has no attribute 'items'"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("failure", choices=sorted(_FAILURES))


def run(args: argparse.Namespace) -> int:
    raise _FAILURES[args.failure]


@pytest.fixture
def bug_in_a_subcommand(monkeypatch: pytest.MonkeyPatch) -> str:
    commands = {**cli_main.COMMANDS, "buggy": (__name__, "a subcommand with a bug")}
    monkeypatch.setattr(cli_main, "COMMANDS", commands)
    return "buggy"


@pytest.mark.parametrize("failure", sorted(_FAILURES))
def test_a_bug_in_a_subcommand_keeps_its_traceback(
    bug_in_a_subcommand: str, failure: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # the error leaves main() as raised, so the interpreter prints its traceback and exits 1
    with pytest.raises(type(_FAILURES[failure])) as raised:
        main([bug_in_a_subcommand, failure])
    assert raised.value is _FAILURES[failure]
    assert "error:" not in capsys.readouterr().err


def test_errors_a_user_can_fix_stay_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.pt"
    assert main(["inspect", str(missing)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("lightning-mgpu inspect: error: "), err
    assert str(missing) in err, err
    assert err.count("\n") == 1, err

    # --key naming no entry: a KeyError of the library, the user's to fix here
    weights = nn.Linear(2, 1).state_dict()
    torch.save({"model": weights, "ema": weights}, tmp_path / "t.pt")
    assert main(["export", str(tmp_path / "t.pt"), str(tmp_path / "w.safetensors"), "--key", "emma"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("lightning-mgpu export: error: "), err
    assert "no entry 'emma'; the entries holding weights are: 'model', 'ema'" in err
    assert err.count("\n") == 1, err
    assert main(["inspect", str(tmp_path / "t.pt"), "--key", "emma"]) == 1
    assert capsys.readouterr().err.count("\n") == 1
