"""estimate_memory: exact byte counts on models whose sizes are known, peak arithmetic, errors."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_mgpu import MemoryEstimate, estimate_memory
from lightning_mgpu.devices import format_bytes, parse_bytes

D, H, K, B = 16, 32, 4, 8
PARAM_BYTES = 4 * (D * H + H + H * K + K)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, K))


class Classifier(L.LightningModule):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Dropout(dropout), nn.Linear(H, K))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("measure_on", ["meta", "cpu"])
def test_linear_stack_bytes_are_exact(measure_on: str) -> None:
    model = mlp()
    est = estimate_memory(
        model, torch.randn(B, D), optimizer=torch.optim.Adam(model.parameters()), measure_on=measure_on
    )
    assert isinstance(est, MemoryEstimate)
    assert est.measured_on == measure_on
    assert est.parameter_bytes == PARAM_BYTES
    assert est.gradient_bytes == PARAM_BYTES
    assert est.optimizer_state_bytes == 2 * PARAM_BYTES  # Adam: exp_avg and exp_avg_sq
    assert est.buffer_bytes == 0
    assert est.batch_bytes_per_sample == 4 * D
    # ReLU saves its output, which the second Linear saves too: one tensor of H floats per sample;
    # the input and the weights the Linears save are the batch and the parameters, not activations
    assert est.activation_bytes_per_sample == 4 * H
    assert est.output_bytes_per_sample == 4 * K
    # forward at its peak holds the last step's gradients, the batch, the pre-activation and the ReLU output
    # (Adam's four scalar step counters live on the CPU, so they count only when measuring there)
    counters = 4 * 4 if measure_on == "cpu" else 0
    assert est.forward_backward == (PARAM_BYTES * 4 + counters, 4 * D + 8 * H)
    # Adam's foreach step makes one temporary the size of the parameters; the batch and outputs stay alive
    assert est.optimizer_step == (PARAM_BYTES * 5 + counters, 4 * D + 4 * K)


def test_optimizer_state_follows_the_optimizer_and_trainable_parameters() -> None:
    model = mlp()
    sgd = estimate_memory(model, torch.randn(B, D), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert sgd.optimizer_state_bytes == 0
    momentum = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert estimate_memory(model, torch.randn(B, D), optimizer=momentum).optimizer_state_bytes == PARAM_BYTES

    model[0].requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = estimate_memory(model, torch.randn(B, D), optimizer=torch.optim.Adam(trainable))
    second_layer = 4 * (H * K + K)
    assert frozen.parameter_bytes == PARAM_BYTES
    assert frozen.gradient_bytes == second_layer
    assert frozen.optimizer_state_bytes == 2 * second_layer


def test_lightning_module_uses_training_step_and_configure_optimizers_and_is_left_untouched() -> None:
    model = Classifier(dropout=0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = (torch.randn(B, D), torch.randint(0, K, (B,)))
    rng = torch.get_rng_state()
    est = estimate_memory(model, batch, devices=2, measure_on="cpu")  # dropout draws random numbers on CPU
    assert est.optimizer == "AdamW"
    assert est.optimizer_state_bytes == 2 * PARAM_BYTES
    assert est.batch_bytes_per_sample == 4 * D + 8  # features and an int64 label
    assert est.output_bytes_per_sample == 0  # the loss is a scalar
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())
    assert model.training


def test_strategy_arithmetic_and_largest_batch() -> None:
    model = mlp()
    est = estimate_memory(
        model,
        torch.randn(B, D),
        devices=4,
        device_memory="64KiB",
        optimizer=torch.optim.Adam(model.parameters()),
    )
    assert est.device_memory == 64 * 1024
    assert est.per_device_batch("mgpu_dp") == 2
    assert est.per_device_batch("mgpu_ddp") == B
    for b in (1, 8, 100):
        single = est.peak("single", b)
        fb_fixed, fb_slope = est.forward_backward
        step_fixed, step_slope = est.optimizer_step
        assert single == int(max(fb_fixed + fb_slope * b, step_fixed + step_slope * b))
        assert est.peak("mgpu_ddp", b) == single + est.gradient_bytes  # DDP's gradient buckets
        # card 0 under mgpu_dp also receives the other 3 chunks and gathers 4 chunks of outputs
        chunks = 3 * b * est.batch_bytes_per_sample
        outputs = 4 * b * est.output_bytes_per_sample
        dp = max(fb_fixed + fb_slope * b + chunks + outputs, step_fixed + step_slope * b + chunks)
        assert est.peak("mgpu_dp", b) == int(dp)
    for strategy in ("single", "mgpu_dp", "mgpu_ddp"):
        best = est.largest_per_device_batch(strategy)
        assert best > 0
        assert est.peak(strategy, best) <= 64 * 1024 < est.peak(strategy, best + 1)
    assert est.largest_per_device_batch("single", device_memory=est.parameter_bytes) == 0
    report = str(est)
    for text in ("single", "mgpu_dp", "mgpu_ddp", "largest batch/device", "Adam", format_bytes(PARAM_BYTES)):
        assert text in report


def test_precision_changes_what_is_counted() -> None:
    batch = (torch.randn(B, D), torch.randint(0, K, (B,)))
    half = estimate_memory(Classifier(), batch, precision="bf16-true")
    assert half.parameter_bytes == PARAM_BYTES // 2
    assert half.batch_bytes_per_sample == 2 * D + 8
    mixed = estimate_memory(Classifier(), batch, precision="bf16-mixed")
    assert mixed.measured_on == "cpu"  # autocast does not apply to meta tensors
    full = estimate_memory(Classifier(), batch)
    assert mixed.parameter_bytes == full.parameter_bytes
    assert mixed.activation_bytes_per_sample < full.activation_bytes_per_sample


@pytest.mark.filterwarnings("ignore:`precision=.*historical reasons")
def test_precision_takes_the_short_forms_the_trainer_takes() -> None:
    batch = (torch.randn(B, D), torch.randint(0, K, (B,)))
    for short, name in [(16, "16-mixed"), ("16", "16-mixed"), ("bf16", "bf16-mixed"), (64, "64-true")]:
        est = estimate_memory(Classifier(), batch, precision=short)
        assert est.precision == name
        assert est == estimate_memory(Classifier(), batch, precision=name)
    assert estimate_memory(Classifier(), batch, precision="32").parameter_bytes == PARAM_BYTES
    with pytest.raises(ValueError, match="unknown precision 8: use one of 32-true, .*, 16, bf16"):
        estimate_memory(Classifier(), batch, precision=8)


class Predicting(Classifier):
    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).softmax(dim=-1)


@pytest.mark.parametrize("measure_on", ["meta", "cpu"])
def test_inference_holds_weights_batch_and_the_forward_peak_only(measure_on: str) -> None:
    model = mlp()
    est = estimate_memory(model, torch.randn(B, D), devices=2, inference=True, measure_on=measure_on)
    assert (est.inference, est.gradient_bytes, est.optimizer_state_bytes) == (True, 0, 0)
    assert (est.parameter_bytes, est.activation_bytes_per_sample) == (PARAM_BYTES, 0)
    # the input, the first layer's output and the ReLU's output are alive together at the peak
    assert est.forward_backward == (PARAM_BYTES, 4 * (D + 2 * H))
    assert est.output_bytes_per_sample == 4 * K
    assert est.peak("single", 100) == PARAM_BYTES + 100 * 4 * (D + 2 * H)
    assert est.peak("mgpu_ddp", 4) == est.peak("single", 4)  # no gradients, so no DDP buckets
    assert est.other_device_peak(4) == PARAM_BYTES + 4 * 4 * (D + 2 * H)
    assert est.peak() < estimate_memory(model, torch.randn(B, D), measure_on=measure_on).peak()
    assert model.training  # eval mode was for the copies' pass only
    report = str(est)
    assert report.startswith("Inference memory estimate for Sequential (32-true, no gradients or optimizer")
    assert "  gradients " not in report
    assert "DDP's all-reduce buckets" not in report

    lightning = estimate_memory(Predicting(), (torch.randn(B, D), torch.zeros(B)), inference=True)
    assert lightning.output_bytes_per_sample == 4 * K  # through predict_step, not forward


class NeedsValues(nn.Module):
    """Reads a value out of a tensor, which meta tensors cannot do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * float(x.abs().max().item() > 0)


def test_auto_falls_back_to_cpu_and_says_why() -> None:
    est = estimate_memory(NeedsValues(), torch.randn(B, D))
    assert est.measured_on == "cpu"
    assert any("meta" in note for note in est.notes)
    assert any("no optimizer" in note for note in est.notes)
    with pytest.raises(RuntimeError):
        estimate_memory(NeedsValues(), torch.randn(B, D), measure_on="meta")


class Manual(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class NeedsTrainer(Classifier):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        steps = self.trainer.estimated_stepping_batches
        return torch.optim.SGD(self.parameters(), lr=1.0 / steps)


class ReturnsNothing(Classifier):
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        return None


def test_errors_name_the_problem_and_the_fix() -> None:
    batch = (torch.randn(B, D), torch.randint(0, K, (B,)))
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        estimate_memory(Classifier(), batch, precision="fp8")
    with pytest.raises(ValueError, match="cannot read the memory size '12 parsecs'"):
        estimate_memory(Classifier(), batch, device_memory="12 parsecs")
    with pytest.raises(ValueError, match="manual optimization.*step_fn"):
        estimate_memory(Manual(), batch)
    with pytest.raises(ValueError, match="configure_optimizers\\(\\) failed outside a Trainer.*optimizer="):
        estimate_memory(NeedsTrainer(), batch)
    with pytest.raises(ValueError, match="returned NoneType.*step_fn"):
        estimate_memory(ReturnsNothing(), batch)
    with pytest.raises(ValueError, match="devices must be a positive integer"):
        estimate_memory(Classifier(), batch, devices=0)
    with pytest.raises(ValueError, match="unknown strategy 'ddp'"):
        estimate_memory(Classifier(), batch).peak("ddp")
    with pytest.raises(ValueError, match="unknown strategy 'ddp'"):
        estimate_memory(Classifier(), batch).peak("ddp", per_device_batch=2)
    with pytest.raises(ValueError, match="unknown strategy 'ddp'"):
        estimate_memory(Classifier(), batch, device_memory="1GiB").largest_per_device_batch("ddp")
    with pytest.raises(ValueError, match="no device memory"):
        estimate_memory(Classifier(), batch).largest_per_device_batch()


def test_step_fn_for_manual_optimization() -> None:
    batch = (torch.randn(B, D), torch.randint(0, K, (B,)))
    model = Manual()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    est = estimate_memory(
        model, batch, optimizer=optimizer, step_fn=lambda m, b: nn.functional.cross_entropy(m.net(b[0]), b[1])
    )
    assert est.optimizer_state_bytes == PARAM_BYTES


def test_parse_and_format_bytes() -> None:
    assert parse_bytes("12GiB") == 12 * 1024**3
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("1.5 mib") == int(1.5 * 1024**2)
    assert parse_bytes("16G") == 16 * 1024**3
    assert parse_bytes(1000) == 1000
    for bad in ("", "-1GiB", "0", "12 GiBs", True):
        with pytest.raises(ValueError, match="memory size"):
            parse_bytes(bad)
    assert format_bytes(3 * 1024**2) == "3.00 MiB"
    assert format_bytes(512) == "512 B"


@pytest.mark.gpu
def test_prediction_matches_cuda_peak_within_15_percent() -> None:
    from lightning.pytorch.callbacks import Callback

    class Wide(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            # ~300 MiB of weights, so the few MiB of cuBLAS workspace stay small beside them
            self.net = nn.Sequential(
                nn.Linear(1024, 8192), nn.ReLU(), nn.Linear(8192, 8192), nn.ReLU(), nn.Linear(8192, 10)
            )

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters())

    class Peak(Callback):
        peak = 0

        def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
            if trainer.global_step == 2:  # steady state: gradients and optimizer state exist
                torch.cuda.reset_peak_memory_stats()

        def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
            if trainer.global_step == 3:
                Peak.peak = torch.cuda.max_memory_allocated()

    batch_size = 512
    data = torch.utils.data.TensorDataset(
        torch.randn(4 * batch_size, 1024), torch.randint(0, 10, (4 * batch_size,))
    )
    model = Wide()
    est = estimate_memory(model, next(iter(torch.utils.data.DataLoader(data, batch_size=batch_size))))
    trainer = L.Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        callbacks=[Peak()],
    )
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=batch_size))
    predicted = est.peak("single")
    error = abs(predicted - Peak.peak) / Peak.peak
    print(f"predicted {predicted} measured {Peak.peak} error {error:.1%}")
    assert error < 0.15


def test_report_says_when_nothing_fits_and_what_would() -> None:
    model = mlp()
    adam = torch.optim.Adam(model.parameters())
    est = estimate_memory(model, torch.randn(B, D), devices=2, device_memory=PARAM_BYTES, optimizer=adam)
    assert est.largest_per_device_batch("single") == 0
    report = str(est)
    one_sample = min(est.peak(s, 1) for s in ("single", "mgpu_dp", "mgpu_ddp", "mgpu_fsdp"))
    assert f"  Nothing fits: one sample per device needs {format_bytes(one_sample)}," in report
    # weights, gradients and Adam's two moments: four copies of the parameters
    assert f"optimizer state alone take {format_bytes(4 * PARAM_BYTES)};" in report
    assert f"  - an optimizer with less state: Adam keeps {format_bytes(2 * PARAM_BYTES)}" in report
    single = next(line for line in report.splitlines() if line.startswith("  single "))
    assert single.split()[-3:] == ["NO", "none", "none"]

    roomy = estimate_memory(model, torch.randn(B, D), devices=2, device_memory="1GiB", optimizer=adam)
    assert "Nothing fits" not in str(roomy)
    assert "none" not in str(roomy)
