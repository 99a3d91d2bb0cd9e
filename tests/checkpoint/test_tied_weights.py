"""Files that leave out tied weights, as Hugging Face ``save_pretrained`` writes them."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from lightning_mgpu import inspect_checkpoint, load_state_dict
from tests.checkpoint._models import assert_same


class TinyLM(nn.Module):
    """A decoder whose output head is the embedding (``tie_word_embeddings``)."""

    def __init__(self, seed: int = 0, tied: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.lm_head = nn.Linear(4, 10, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight


class TinyBert(nn.Module):
    """BERT's masked-LM head: ``cls.predictions.decoder`` ties its weight and its bias."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.word_embeddings = nn.Embedding(10, 4)
        self.cls = nn.Module()
        self.cls.predictions = nn.Module()
        self.cls.predictions.bias = nn.Parameter(torch.randn(10))
        self.cls.predictions.decoder = nn.Linear(4, 10)
        self.cls.predictions.decoder.weight = self.word_embeddings.weight
        self.cls.predictions.decoder.bias = self.cls.predictions.bias


def save_pretrained_style(model: nn.Module, left_out: list[str], path: Path) -> None:
    """What ``save_pretrained`` writes: tied names left out, only ``{"format": "pt"}`` as metadata."""
    kept = {k: v.clone() for k, v in model.state_dict().items() if k not in left_out}
    safetensors.torch.save_file(kept, path, metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("build", "left_out", "ties"),
    [
        (TinyLM, ["lm_head.weight"], [("lm_head.weight", "embed.weight")]),
        (
            TinyBert,
            ["cls.predictions.decoder.weight", "cls.predictions.decoder.bias"],
            [
                ("cls.predictions.decoder.weight", "word_embeddings.weight"),
                ("cls.predictions.decoder.bias", "cls.predictions.bias"),
            ],
        ),
    ],
)
def test_tied_names_left_out_are_filled_through_the_loaded_weight(
    tmp_path: Path, build: type[nn.Module], left_out: list[str], ties: list[tuple[str, str]]
) -> None:
    model = build(seed=1)  # type: ignore[call-arg]
    path = tmp_path / "model.safetensors"
    save_pretrained_style(model, left_out, path)
    with pytest.raises(RuntimeError, match="Missing key"):  # what torch's strict loading says
        build(seed=2).load_state_dict(safetensors.torch.load_file(path))  # type: ignore[call-arg]

    for wrap in (lambda m: m, nn.DataParallel):
        fresh = build(seed=2)  # type: ignore[call-arg]
        report = load_state_dict(wrap(fresh), path)
        assert report.ok
        assert sorted(report.tied) == sorted(ties)
        assert "not in the source but tied to a loaded entry" in str(report)
        assert_same(model.state_dict(), fresh.state_dict())

    info = inspect_checkpoint(path)
    assert info.tied_unknown
    text = str(info)
    assert "loads into a plain model:          yes" not in text
    assert "loads into a plain model:          only if the model ties no weights" in text


def test_an_untied_model_still_misses_what_the_file_left_out(tmp_path: Path) -> None:
    save_pretrained_style(TinyLM(seed=1), ["lm_head.weight"], tmp_path / "m.safetensors")
    with pytest.raises(ValueError, match=r"missing from the source \(1\): lm_head.weight"):
        load_state_dict(TinyLM(seed=2, tied=False), tmp_path / "m.safetensors")
