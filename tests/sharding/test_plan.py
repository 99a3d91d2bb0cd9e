"""The sharding plan: which submodules ``mgpu_fsdp`` shards one by one (a pure function, one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mgpu._sharding.plan import find_blocks, plan_sharding, validate_block_classes
from recipes.resnet import resnet18


class Block(nn.Module):
    """A pre-norm transformer block."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.attn(h, h, h)[0] + self.mlp(h)


class TinyGPT(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight  # tied


class Stage(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)


class StagedNet(nn.Module):
    """ResNet-like stages held as attributes, not in a container."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.stage1 = Stage(4)
        self.stage2 = Stage(4)
        self.fc1 = nn.Linear(4, 4)  # two torch.nn layers side by side are not stages
        self.fc2 = nn.Linear(4, 2)


def test_transformer_blocks_in_a_module_list_are_the_units() -> None:
    plan = plan_sharding(TinyGPT())
    assert plan.blocks == ("blocks.0", "blocks.1", "blocks.2")
    assert plan.units == 4
    assert plan.describe() == "4 unit(s): blocks.0, blocks.1, blocks.2 and the root"
    # torch's own encoder: its layers, not their insides
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), num_layers=2)
    assert find_blocks(encoder) == ["layers.0", "layers.1"]


def test_resnet_blocks_of_every_stage_are_the_units() -> None:
    plan = plan_sharding(resnet18(num_classes=10))
    assert plan.blocks == tuple(f"layer{stage}.{block}" for stage in (1, 2, 3, 4) for block in (0, 1))
    assert plan.chosen_by == "automatic policy"
    assert plan.describe() == "9 unit(s): layer1.0, layer1.1, layer2.0, layer2.1, 4 more and the root"


def test_stages_held_as_attributes_are_units_and_plain_layers_are_not() -> None:
    assert find_blocks(StagedNet()) == ["stage1", "stage2"]


def test_an_mlp_shards_each_layer_and_skips_what_holds_nothing() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    assert find_blocks(model) == ["0", "2", "4"]
    # different classes side by side are not repeated blocks: the stem stays with the root
    assert find_blocks(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))) == []
    assert plan_sharding(nn.Linear(4, 2)).units == 1


@pytest.mark.parametrize("spec", [[Block], ["Block"], [f"{__name__}.Block"], Block, "Block"])
def test_block_classes_by_class_or_name(spec: object) -> None:
    classes = validate_block_classes(spec)
    plan = plan_sharding(TinyGPT(layers=2), classes)
    assert plan.blocks == ("blocks.0", "blocks.1")
    assert plan.chosen_by == "block_classes"


def test_block_classes_take_the_outermost_match() -> None:
    # Linear layers inside the blocks are not sharded again; the tied head is a Linear too
    plan = plan_sharding(TinyGPT(layers=2), ["Block", nn.Linear])
    assert plan.blocks == ("blocks.0", "blocks.1", "head")


def test_block_classes_that_match_nothing_name_what_exists() -> None:
    with pytest.raises(ValueError, match=r"block_classes=\['Blok'\] matches no submodule of TinyGPT") as err:
        plan_sharding(TinyGPT(), ["Blok"])
    assert "Block, Embedding, LayerNorm, Linear" in str(err.value)
    assert "Did you mean 'Block'?" in str(err.value)


def test_a_model_without_parameters_has_nothing_to_shard() -> None:
    with pytest.raises(ValueError, match="ReLU has no parameters, so mgpu_fsdp has nothing to shard"):
        plan_sharding(nn.ReLU())


@pytest.mark.parametrize("bad", [3, [Block, 3], [int], nn.Linear(2, 2)])
def test_block_classes_of_the_wrong_type(bad: object) -> None:
    with pytest.raises(TypeError, match="block_classes"):
        validate_block_classes(bad)
    with pytest.raises(ValueError, match="block_classes is empty"):
        validate_block_classes([])
