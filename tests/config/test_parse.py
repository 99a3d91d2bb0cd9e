"""Finding configs by name or path, and reading key=value overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_mgpu.config.parse import find_config, load, parse_overrides, shipped_configs


def test_shipped_names_and_paths(tmp_path: Path) -> None:
    assert find_config("digits").name == "digits.yaml"
    mine = tmp_path / "mine.yaml"
    mine.write_text("recipe: linear\n")
    assert find_config(str(mine)) == mine
    assert {"digits", "linear", "resnet18", "resnet50", "mnist", "heatmap", "seq_linear"} <= set(
        shipped_configs()
    )


def test_unknown_name_suggests_and_lists() -> None:
    with pytest.raises(
        FileNotFoundError, match=r"'digit'.*did you mean digits\? shipped configs: digits, heatmap"
    ):
        find_config("digit")


def test_override_values_are_yaml() -> None:
    parsed = parse_overrides(
        ["trainer.devices=[0,3]", "data.batch_size=128", "run_dir=null", "model.arch=resnet50"]
    )
    assert parsed.trainer.devices == [0, 3]
    assert parsed.data.batch_size == 128
    assert parsed.run_dir is None
    assert parsed.model.arch == "resnet50"


@pytest.mark.parametrize("bad", ["trainer.devices", "=3"])
def test_override_without_key_or_equals(bad: str) -> None:
    with pytest.raises(
        ValueError, match=f"override '{bad}' is not key=value; write e.g. trainer.max_epochs=3"
    ):
        parse_overrides([bad])


def test_not_yaml_or_not_a_mapping(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("trainer: [1, 2\n")
    with pytest.raises(ValueError, match="broken.yaml is not valid YAML"):
        load(str(broken))
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="must hold a mapping of sections"):
        load(str(listing))


def test_overrides_replace_file_values() -> None:
    raw = load("digits", ["trainer.max_epochs=2", "trainer.devices=[1]"])
    assert raw.trainer.max_epochs == 2
    assert list(raw.trainer.devices) == [1]
    assert raw.model.hidden == 128  # untouched keys keep the file's value
