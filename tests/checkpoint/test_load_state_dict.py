"""load_state_dict: readable strict errors, hints, by_order, ambiguity, safe hyperparameter loading."""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path, PurePosixPath, PureWindowsPath

import pytest
import torch
from omegaconf import OmegaConf
from omegaconf.nodes import PathNode
from torch import nn

from lightning_mgpu import LoadReport, export_state_dict, load_state_dict
from lightning_mgpu.checkpoint import LoadError
from tests.checkpoint._models import LitNet, LitTwo, ResNet, assert_same, lightning_checkpoint, net


class Renamed(nn.Module):
    """The same layers as ``net()`` under other names, as a custom model mirroring a pretrained one."""

    def __init__(self) -> None:
        super().__init__()
        self.fc_in = nn.Linear(4, 6)
        self.norm = nn.BatchNorm1d(6)
        self.fc_out = nn.Linear(6, 2)


def test_by_order_maps_by_position_and_reports_pairs(tmp_path: Path) -> None:
    source = net(seed=1)
    export_state_dict(source, tmp_path / "pretrained.safetensors")
    target = Renamed()
    with pytest.raises(ValueError, match="by_order=True pairs entries by position"):
        load_state_dict(target, tmp_path / "pretrained.safetensors")

    report = load_state_dict(target, tmp_path / "pretrained.safetensors", by_order=True)
    assert report.ok
    assert report.pairs[0] == ("0.weight", "fc_in.weight")
    assert report.pairs[-1] == ("3.bias", "fc_out.bias")
    assert len(report.pairs) == 9
    assert_same(
        source.state_dict(), dict(zip(source.state_dict(), target.state_dict().values(), strict=True))
    )
    assert "paired by order (9): 0.weight -> fc_in.weight" in str(report)


def test_by_order_checks_every_shape() -> None:
    wrong = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))
    before = {k: v.clone() for k, v in wrong.state_dict().items()}
    with pytest.raises(
        ValueError, match=r"shape mismatch \(2\): fc_out.weight \[2, 6\] -> 3.weight \[3, 6\]"
    ):
        load_state_dict(wrong, Renamed(), by_order=True)
    assert_same(before, wrong.state_dict())  # strict failure loads nothing

    report = load_state_dict(wrong, Renamed(), by_order=True, strict=False)
    assert [m[0] for m in report.mismatched] == ["fc_out.weight", "fc_out.bias"]
    assert report.loaded == 7


def test_by_order_count_mismatch_is_listed() -> None:
    with pytest.raises(ValueError, match=r"missing from the source \(2\): 3.weight, 3.bias"):
        load_state_dict(net(), nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)), by_order=True)


def test_strict_error_lists_problems_one_per_line() -> None:
    source = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3), nn.Linear(3, 1))
    target = nn.DataParallel(net())
    with pytest.raises(ValueError, match="^cannot load") as err:
        load_state_dict(target, nn.DataParallel(source))
    lines = str(err.value).splitlines()
    assert lines[0] == "cannot load module Sequential in DataParallel into DataParallel with strict=True:"
    assert "  not in the model (2): 4.weight, 4.bias" in lines
    assert (
        "  shape mismatch (2): 3.weight: source [3, 6], model [2, 6], 3.bias: source [3], model [2]" in lines
    )
    # both sides DataParallel: the names went in as they were, and the report says so
    assert "  prefixes: none changed (the source and the model both carry module.)" in lines
    assert lines[-1].startswith(
        "to load what matches anyway: lightning_mgpu.load_state_dict(model, source, strict=False)"
    )
    assert err.value.report.unchanged_prefixes == ["module."]
    assert err.value.problems.splitlines() == lines[:-1]  # for a caller that names its own way out
    assert load_state_dict(nn.DataParallel(net()), nn.DataParallel(net(seed=1))).unchanged_prefixes == [
        "module."
    ]


def test_wrapper_prefix_on_only_some_entries() -> None:
    source = {f"module.{k}": v for k, v in net(seed=1).state_dict().items()}
    source["step"] = torch.tensor(3)
    target = net(seed=2)
    report = load_state_dict(target, source)  # "module." fits the model exactly: "step" is set aside
    assert report.ignored == ["step"]
    assert_same(net(seed=1).state_dict(), target.state_dict())

    del source["module.3.bias"]
    with pytest.raises(ValueError, match=r"8 source entries start with 'module.' .* but others do not"):
        load_state_dict(target, source)


def test_strict_false_loads_what_matches_and_reports_the_rest() -> None:
    source = net(seed=1).state_dict()
    source.pop("3.bias")
    source["extra.weight"] = torch.zeros(1)
    target = net(seed=2)
    report = load_state_dict(target, source, strict=False)
    assert isinstance(report, LoadReport)
    assert not report.ok
    assert report.missing == ["3.bias"]
    assert report.unexpected == ["extra.weight"]
    assert torch.equal(target.state_dict()["3.weight"], source["3.weight"])


def test_exact_names_win_over_a_prefix_swap(tmp_path: Path) -> None:
    """A source of ``0.*`` and ``2.*`` into a model of ``0.*`` only: ``0.*`` loads as named, never
    ``2.*`` renamed ``0.*`` (which fits the names, not the shapes)."""
    source = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 5))
    torch.save(source.state_dict(), tmp_path / "two.pt")
    for given in (source.state_dict(), tmp_path / "two.pt"):
        target = nn.Sequential(nn.Linear(2, 3))
        report = load_state_dict(target, given, strict=False)
        assert report.loaded == 2
        assert sorted(report.unexpected) == ["2.bias", "2.weight"]
        assert report.mismatched == []
        assert report.removed_prefixes == report.added_prefixes == []
        assert_same(target.state_dict(), {k: v for k, v in source.state_dict().items() if k.startswith("0.")})


def test_batchnorm_weights_from_before_num_batches_tracked_load_like_torch(tmp_path: Path) -> None:
    trained = net(seed=1)
    trained[1].running_mean.fill_(0.5)
    old = {k: v for k, v in trained.state_dict().items() if not k.endswith("num_batches_tracked")}
    torch.save(old, tmp_path / "old.pth")
    expected, model = net(seed=2), net(seed=2)
    for m in (expected, model):
        m[1].num_batches_tracked.fill_(7)
    expected.load_state_dict(torch.load(tmp_path / "old.pth", weights_only=True))  # torch takes it

    report = load_state_dict(model, tmp_path / "old.pth", strict=True)
    assert report.ok
    assert report.missing == []
    assert_same(expected.state_dict(), model.state_dict())
    torch.testing.assert_close(model[1].running_mean, torch.full((6,), 0.5))
    # a missing running_mean is still missing
    del old["1.running_mean"]
    with pytest.raises(ValueError, match=r"1\.running_mean"):
        load_state_dict(net(seed=2), old, strict=True)


def test_hints_speak_of_the_chosen_submodule_only() -> None:
    checkpoint = {"pytorch-lightning_version": "2.4.0", "state_dict": LitTwo().state_dict()}
    wider = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"0\.weight") as failed:
        load_state_dict(wider, checkpoint, submodule="model")
    assert "several top-level entries" not in str(failed.value)
    with pytest.raises(ValueError, match="several top-level entries: model .*loss_fn"):
        load_state_dict(wider, checkpoint)


def test_lightning_checkpoint_ignores_other_submodules(tmp_path: Path) -> None:
    module = LitTwo()
    report = load_state_dict(net(seed=9), module)
    assert report.ok
    assert report.ignored == ["loss_fn.weight"]
    assert report.removed_prefixes == ["model."]


def test_only_ways_whose_shapes_fit_are_offered() -> None:
    wider = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))  # same names
    target = net(seed=3)
    report = load_state_dict(target, nn.ModuleDict({"wide": wider, "fit": net(seed=1)}))
    assert report.removed_prefixes == ["fit."]
    assert_same(net(seed=1).state_dict(), target.state_dict())
    three = nn.ModuleDict({"student": net(seed=1), "wide": wider, "teacher": net(seed=2)})
    with pytest.raises(ValueError, match="several ways") as err:
        load_state_dict(target, three)
    assert "'wide" not in str(err.value)
    assert str(err.value).endswith("Pass submodule='student' or submodule='teacher' to choose.")


def test_ways_whose_shapes_do_not_fit_are_no_choice() -> None:
    """Names that fit under ``norm.`` and under ``head.``, shapes under neither: a shape mismatch."""
    two = nn.ModuleDict({"norm": nn.LayerNorm(4), "head": nn.LayerNorm(4)})
    target = nn.LayerNorm(8)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(LoadError, match=r"shape mismatch \(2\): norm.weight \[4\] -> weight \[8\]") as err:
        load_state_dict(target, two)
    assert "several ways" not in str(err.value)
    assert_same(before, target.state_dict())


def test_two_exact_fits_are_ambiguous_until_submodule_is_given() -> None:
    pair = nn.ModuleDict({"student": net(seed=1), "teacher": net(seed=2)})
    target = net(seed=3)
    with pytest.raises(
        ValueError, match="several ways: under 'student.'.*under 'teacher.'.*submodule='student'"
    ):
        load_state_dict(target, pair)
    load_state_dict(target, pair, submodule="teacher")
    assert_same(pair["teacher"].state_dict(), target.state_dict())


def test_lightning_to_lightning_with_another_attribute_name(tmp_path: Path) -> None:
    class LitOther(LitNet):
        def __init__(self) -> None:
            super().__init__()
            self.net = self.model
            del self.model

    source = LitNet(net(seed=1))
    target = LitOther()
    report = load_state_dict(target, source)
    assert (report.removed_prefixes, report.added_prefixes) == (["model."], ["net."])
    assert_same(source.model.state_dict(), target.net.state_dict())


HYPERPARAMETERS = {
    "omegaconf": OmegaConf.create(
        {"lr": 0.1, "layers": [4, 6, 2], "name": "run", "opt": {"beta": None, "nesterov": True}}
    ),
    "pathlib": {
        "data_dir": Path("data") / "train",
        "pure": PurePosixPath("/mnt/shared"),
        "windows_dir": PureWindowsPath(r"C:\runs"),
        "cfg": OmegaConf.create({"out": Path("out"), "typed": PathNode(Path("logs"))}),
    },
}


@pytest.mark.parametrize("kind", HYPERPARAMETERS)
def test_common_hyperparameters_load_safely(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "fit.ckpt"
    module = lightning_checkpoint(path, cfg=HYPERPARAMETERS[kind])
    # what Lightning's load_from_checkpoint meets: plain weights-only loading refuses the file
    with pytest.raises(pickle.UnpicklingError, match=kind):
        torch.load(path, weights_only=True)

    target = net(seed=7)
    assert load_state_dict(target, path).ok
    assert_same(module.model.state_dict(), target.state_dict())
    # the allowlist was widened only while loading
    allowed = {getattr(g, "__module__", "") for g in torch.serialization.get_safe_globals()}
    assert not any(name.startswith(("pathlib", "omegaconf")) for name in allowed)
    with pytest.raises(pickle.UnpicklingError, match=kind):
        torch.load(path, weights_only=True)


def test_trust_pickle_is_the_explicit_way_for_legacy_objects(tmp_path: Path) -> None:
    path = tmp_path / "legacy.pth"
    model = net(seed=1)
    # old training scripts saved argparse namespaces next to the weights, in the pre-1.6 format
    torch.save(
        {"args": argparse.Namespace(lr=0.1), "state_dict": model.state_dict()},
        path,
        _use_new_zipfile_serialization=False,
    )
    with pytest.raises(
        ValueError, match=r"argparse.Namespace.*trust_pickle=True \(command line: --trust-pickle\)"
    ):
        load_state_dict(net(), path)
    target = net(seed=2)
    assert load_state_dict(target, path, trust_pickle=True).ok
    assert_same(model.state_dict(), target.state_dict())


def test_whole_pickled_module_needs_trust_pickle(tmp_path: Path) -> None:
    model = net(seed=1)
    torch.save(model, tmp_path / "model.pt")
    with pytest.raises(ValueError, match="trust_pickle"):
        load_state_dict(net(), tmp_path / "model.pt")
    target = net(seed=2)
    load_state_dict(target, tmp_path / "model.pt", trust_pickle=True)
    assert_same(model.state_dict(), target.state_dict())


def test_by_order_refuses_a_foreign_safetensors_file_without_order(tmp_path: Path) -> None:
    import safetensors.torch

    safetensors.torch.save_file(net().state_dict(), tmp_path / "foreign.safetensors")
    assert load_state_dict(net(), tmp_path / "foreign.safetensors").ok  # by name it is fine
    with pytest.raises(ValueError, match="does not record the order"):
        load_state_dict(Renamed(), tmp_path / "foreign.safetensors", by_order=True)


def test_map_location_of_a_safetensors_file(tmp_path: Path) -> None:
    source = net(seed=1)
    export_state_dict(source, tmp_path / "w.safetensors")
    model = net(seed=2)
    assert load_state_dict(model, tmp_path / "w.safetensors", map_location=None).ok  # as torch.load
    assert_same(source.state_dict(), model.state_dict())
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="map_location='cuda', but CUDA is not available here"):
            load_state_dict(net(seed=2), tmp_path / "w.safetensors", map_location="cuda")


@pytest.mark.gpu
def test_cuda_models_and_map_location(tmp_path: Path) -> None:
    model = net(seed=1).cuda()
    export_state_dict(
        nn.DataParallel(model), tmp_path / "w.safetensors"
    )  # each tensor goes to the CPU to be written
    target = nn.DataParallel(net(seed=2).cuda())
    assert load_state_dict(target, tmp_path / "w.safetensors", map_location="cuda").ok
    cpu = {k: v.cpu() for k, v in model.state_dict().items()}
    assert_same(cpu, {k: v.cpu() for k, v in target.module.state_dict().items()})


def test_by_order_from_a_module_with_several_submodules_suggests_one() -> None:
    with pytest.raises(ValueError, match=r"holds several top-level entries: model .*loss_fn.*submodule=NAME"):
        load_state_dict(Renamed(), LitTwo(), by_order=True)
    source = LitTwo()
    target = Renamed()
    assert load_state_dict(target, source, by_order=True, submodule="model").ok
    assert_same(
        source.model.state_dict(),
        dict(zip(source.model.state_dict(), target.state_dict().values(), strict=True)),
    )


def test_a_file_whose_module_is_the_models_own_attribute(tmp_path: Path) -> None:
    # the names alone read ``module.stem.module.`` as two wrappers; the model shows the inner one is its own
    source = ResNet(seed=1)
    torch.save(nn.DataParallel(source).state_dict(), tmp_path / "dp.pt")
    for target, plain, removed in (
        (ResNet(seed=2), lambda m: m, ["module."]),
        (nn.DataParallel(ResNet(seed=2)), lambda m: m.module, []),  # names unchanged: DataParallel both
        (LitNet(ResNet(seed=2)), lambda m: m.model, ["module."]),
    ):
        report = load_state_dict(target, tmp_path / "dp.pt")
        assert report.removed_prefixes == removed
        assert_same(source.state_dict(), plain(target).state_dict())
