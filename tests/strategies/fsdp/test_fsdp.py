"""``mgpu_fsdp`` on real gloo processes: the same weights as one process, and 1/N of the state per rank.

One launch of two processes runs every fit of tests/scripts/fsdp_fits.py (Lightning's launcher starts
the second rank once and later Trainers reuse the process group), so this file pays for one
process start-up. Each rank builds its model from its own seed: the strategy must start
both from rank 0's weights, as DDP does.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MGPUFSDPStrategy, estimate_memory
from tests.helpers import run_file

# (test_a_checkpoint_of_two_processes_resumes_in_one resumes ckpt/last.ckpt in this pytest process)


class Reference(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 33), nn.Tanh())
        self.head = nn.Linear(33, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x))


def reference(data: dict, initial: dict, optimizer: str, epochs: int = 2) -> dict[str, torch.Tensor]:
    """One process, plain torch, batches of 8 = the two ranks' batches of 4 together."""
    model = Reference()
    model.load_state_dict(initial)
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for _ in range(epochs):
        for start in range(0, 64, 8):
            loss = nn.functional.mse_loss(model(data["x"][start : start + 8]), data["y"][start : start + 8])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.state_dict()


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory):
    tmp_path = tmp_path_factory.mktemp("fsdp")
    result = run_file("fsdp_fits.py", tmp_path, timeout=400)
    assert result.returncode == 0, result.output
    return tmp_path, result


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_two_processes_end_with_the_weights_of_one(fsdp_run, optimizer: str) -> None:
    tmp_path, _ = fsdp_run
    run = torch.load(tmp_path / f"{optimizer}.pt")
    expected = reference(torch.load(tmp_path / "data.pt"), run["initial"], optimizer)
    assert run["final"].keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(run["final"][name], value, atol=1e-5, rtol=0)
    assert not torch.equal(run["final"]["net.0.weight"], run["initial"]["net.0.weight"])
    # every parameter was a sharded DTensor, kept in float32
    assert set(run["sharded"].values()) == {("DTensor", "torch.float32")}


def test_each_rank_holds_half_of_the_model_state(fsdp_run) -> None:
    tmp_path, _ = fsdp_run
    ranks = [json.loads((tmp_path / f"state_rank{r}.json").read_text()) for r in (0, 1)]
    whole = ranks[0]["whole"]
    assert whole == ranks[1]["whole"]
    assert whole["parameters"] == whole["gradients"] == 1381 * 4
    for rank in ranks:
        local, rows = rank["local"], rank["rows"]  # rows: one row of each parameter, the most padding adds
        assert local["parameters"] <= whole["parameters"] / 2 + rows
        assert local["gradients"] <= whole["gradients"] / 2 + rows
        # AdamW: two moments per parameter, sharded, plus a one-number step per parameter on each rank
        assert local["optimizer"] <= whole["optimizer"] / 2 + 2 * rows + 6 * 4
        assert sum(local.values()) <= 0.55 * sum(whole.values())
    for kind in ("parameters", "gradients"):  # the shards add up to the whole, nothing held twice
        assert ranks[0]["local"][kind] + ranks[1]["local"][kind] == whole[kind]


def test_the_memory_monitor_and_the_estimate_show_each_rank_half_of_the_model_state(fsdp_run) -> None:
    tmp_path, result = fsdp_run
    measured = [json.loads((tmp_path / f"state_rank{rank}.json").read_text()) for rank in (0, 1)]
    whole = sum(measured[0]["whole"].values())
    summary = json.loads((tmp_path / "adamw_memory.json").read_text())
    held = {d["device"]: d["model_state_bytes"] for d in summary["devices"]}
    assert set(held) == {"cpu:rank0", "cpu:rank1"}
    for rank in (0, 1):
        assert 0.45 * whole <= held[f"cpu:rank{rank}"] <= 0.55 * whole
        assert held[f"cpu:rank{rank}"] == sum(measured[rank]["local"].values())
    assert "Model state (rank)" in result.stderr.split("Device memory over the fit (peaks):")[1]  # logged
    # the estimate's fullest rank, padding included, is rank 0's shards (less AdamW's six step counts)
    model = Reference()
    optimizer = torch.optim.AdamW(model.parameters())
    est = estimate_memory(model, torch.randn(4, 6), devices=2, optimizer=optimizer)
    assert 0 <= sum(measured[0]["local"].values()) - est.sharded_state_bytes() <= 6 * 8


def test_bf16_mixed_computes_in_bf16_and_keeps_float32_shards(fsdp_run) -> None:
    tmp_path, _ = fsdp_run
    run = torch.load(tmp_path / "bf16.pt")
    assert run["forward_dtypes"] == ["torch.bfloat16"]
    assert set(run["sharded"].values()) == {("DTensor", "torch.float32")}
    expected = reference(torch.load(tmp_path / "data.pt"), run["initial"], "sgd")
    for name, value in expected.items():
        torch.testing.assert_close(run["final"][name], value, atol=1e-2, rtol=0)
    assert not torch.equal(run["final"]["net.0.weight"], run["initial"]["net.0.weight"])


def test_a_sharded_checkpoint_resumes_to_the_same_weights(fsdp_run) -> None:
    tmp_path, _ = fsdp_run
    assert (tmp_path / "ckpt" / "last.ckpt" / ".metadata").is_file()  # a torch.distributed.checkpoint folder
    straight = torch.load(tmp_path / "adamw.pt")["final"]
    resumed = torch.load(tmp_path / "resumed.pt")["final"]
    for name, value in straight.items():
        torch.testing.assert_close(resumed[name], value, atol=1e-6, rtol=0)


class Regression(L.LightningModule):
    """The script's model, to resume its checkpoint here."""

    def __init__(self) -> None:
        super().__init__()
        layers = Reference()  # the same layers under the same names as the script's module
        self.net, self.head = layers.net, layers.head

    forward = Reference.forward

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)


def test_a_checkpoint_of_two_processes_resumes_in_one(fsdp_run, monkeypatch: pytest.MonkeyPatch) -> None:
    tmp_path, _ = fsdp_run
    monkeypatch.chdir(tmp_path)
    data = torch.load(tmp_path / "data.pt")
    model = Regression()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=MGPUFSDPStrategy(), max_epochs=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    loader = DataLoader(TensorDataset(data["x"], data["y"]), batch_size=8)  # the two ranks' batches together
    trainer.fit(model, loader, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert trainer.global_step == 16
    straight = torch.load(tmp_path / "adamw.pt")["final"]  # two processes, two epochs without a stop
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value.full_tensor(), straight[name], atol=1e-6, rtol=0)


def test_plain_weights_of_a_sharded_run_load_into_a_plain_model(fsdp_run) -> None:
    tmp_path, _ = fsdp_run
    from safetensors.torch import load_file

    gathered = torch.load(tmp_path / "first_epoch.pt")["final"]  # the run's weights, gathered by torch
    assert (tmp_path / "ckpt" / "last.ckpt").is_dir()  # a sharded folder
    for name in ("final", "last"):  # the final weights, and the sibling of the folder checkpoint
        weights = load_file(tmp_path / "ckpt" / f"{name}.safetensors")
        Reference().load_state_dict(weights, strict=True)
        for key, value in gathered.items():
            torch.testing.assert_close(weights[key], value, atol=0, rtol=0)


def test_plain_weights_of_a_model_in_one_attribute_load_into_that_model(fsdp_run) -> None:
    tmp_path, result = fsdp_run
    from safetensors.torch import load_file

    gathered = torch.load(tmp_path / "wrapped.pt")  # the attribute's weights, gathered by torch
    for name in ("final", "last"):  # as `lightning-mgpu export` writes them: without the attribute's prefix
        weights = load_file(tmp_path / "wrapped" / f"{name}.safetensors")
        plain = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 2))
        plain.load_state_dict(weights, strict=True)
        for key, value in gathered.items():
            torch.testing.assert_close(weights[key], value, atol=0, rtol=0)
    # the second epoch's last.ckpt replaces the run's own first one: a normal run, nothing to warn about
    assert "Detected an existing checkpoint" not in result.output


def test_the_summary_shows_the_plan_and_each_rank_share(fsdp_run) -> None:
    _, result = fsdp_run
    assert result.output.count("mgpu_fsdp: 1 node(s) x 2 process(es) per node = 2 process(es)") == 6
    plan = "sharding: 3 unit(s): net.0, net.2 and the root, blocks chosen by the automatic policy"
    assert f"{plan}; reshard_after_forward=True\n" in result.output
    assert f"{plan}; reshard_after_forward=False\n" in result.output  # the resumed run's option
    bf16 = "parameters gathered in torch.bfloat16, gradients reduced in torch.float32"
    assert f"{plan}; reshard_after_forward=True, {bf16}\n" in result.output
    assert "model state per process: parameters 2.76 KiB of 5.39 KiB (51%) on rank 0" in result.output


def test_a_dead_rank_stops_the_run_and_is_named(tmp_path: Path) -> None:
    result = run_file("fsdp_death.py", tmp_path, timeout=180)
    assert result.returncode != 0
    pid = (tmp_path / "victim_pid").read_text()
    assert f"rank 1 (pid {pid}) was killed by signal 9 (SIGKILL)" in result.output, result.output[-3000:]
