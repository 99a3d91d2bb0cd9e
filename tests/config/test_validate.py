"""Config validation: every mistake reported at once, with the key, the expected type and a suggestion."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from lightning_mgpu.config import ConfigError, load_config
from lightning_mgpu.config.parse import load
from lightning_mgpu.config.schema import CPU_DEVICE_CAP, RunConfig
from lightning_mgpu.config.validate import validate


def problems(overrides: list[str], config: str = "digits") -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(config, overrides)
    return info.value.problems


def test_typo_names_the_key_and_the_closest_valid_one() -> None:
    assert problems(["trainer.max_epoch=3"]) == [
        "trainer.max_epoch: unknown key; did you mean trainer.max_epochs?"
    ]
    assert problems(["model.hiden=3"]) == ["model.hiden: unknown key; did you mean model.hidden?"]
    assert problems(["trainr.devices=2"]) == ["trainr: unknown key; did you mean trainer?"]


def test_unknown_key_without_a_close_match_lists_the_section() -> None:
    (message,) = problems(["optimizer.zzzz=1"])
    assert message == (
        "optimizer.zzzz: unknown key; valid keys in optimizer:"
        " _component_, lr, weight_decay, momentum, kwargs, scheduler"
    )


def test_wrong_types_say_what_was_expected_and_given() -> None:
    assert problems(["trainer.max_epochs=ten", "data.batch_size=3.5", "data.shuffle=maybe"]) == [
        "trainer.max_epochs: expected an integer or null, got 'ten'",  # null: Lightning's default
        "data.batch_size: expected an integer, got 3.5",
        "data.shuffle: expected true or false, got 'maybe'",
    ]
    assert problems(["callbacks.memory=null"]) == [
        "callbacks.memory: expected a section of keys, got None;"
        " to turn it off write callbacks.memory.enabled=false"
    ]


def test_impossible_values_are_rejected() -> None:
    assert problems(
        [
            "optimizer.lr=-0.1",
            "trainer.devices=[0,0]",
            "data.batch_size=0",
            "optimizer._component_=adan",
            "task=train",
        ]
    ) == [
        "task: 'train' is not one of fit, validate, predict",
        "trainer.devices: each index may appear once, got [0, 0]",
        "data.batch_size: must be >= 1, got 0",
        "optimizer.lr: must be > 0, got -0.1",
        "optimizer._component_: 'adan' is not an optimizer; did you mean adam? Otherwise give a short name"
        " (adamw, adam, sgd) or a class path such as torch.optim.AdamW",
    ]
    devices, fast, limit = problems(
        ["trainer.devices=0", "trainer.fast_dev_run=-2", "trainer.limit_train_batches=1.5"]
    )
    assert devices == "trainer.devices: must be >= 1 (or -1 for all), got 0"
    assert fast.startswith("trainer.fast_dev_run: must be >= 0")
    assert "true or a batch count runs that many batches" in fast  # what the values mean
    assert fast.endswith("got -2")
    assert limit.startswith("trainer.limit_train_batches: expected a batch count (int >= 0) or a fraction")
    assert limit.endswith(" in [0.0, 1.0], got 1.5")


def test_every_kind_of_mistake_in_one_error() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(
            "digits", ["trainer.max_epoch=3", "trainer.precision=17", "model.dropout=x", "optimizer.lr=0"]
        )
    assert str(info.value) == (
        "digits has 4 problems:\n"
        "  trainer.max_epoch: unknown key; did you mean trainer.max_epochs?\n"
        "  model.dropout: expected a number, got 'x'\n"
        "  trainer.precision: '17' is not one of 32-true, 16-mixed, bf16-mixed, 16-true, bf16-true, 64-true,"
        " 32, 16, bf16, 64\n"
        "  optimizer.lr: must be > 0, got 0"
    )


def test_recipe_and_strategy_names_get_suggestions() -> None:
    raw = OmegaConf.create({"recipe": "digts", "trainer": {"strategy": "mgpu_atuo"}})
    with pytest.raises(ConfigError) as info:
        validate(raw, source="my.yaml")
    first, second = info.value.problems
    assert first.startswith("recipe: 'digts' is not a recipe; did you mean digits? known recipes: linear,")
    assert second.startswith(
        "trainer.strategy: 'mgpu_atuo' is not a registered strategy; did you mean mgpu_auto? e.g. mgpu_ddp, "
    )
    assert {"mgpu_dp", "mgpu_auto"} <= set(second.partition("e.g. ")[2].split(", "))
    assert problems(["recipe=null"])[0].startswith("recipe: missing; set it to one of linear, seq_linear")


def test_cross_section_and_task_checks() -> None:
    assert problems(["data.num_classes=3"], "resnet18") == [
        "model.num_classes=10 but data.num_classes=3; set model.num_classes=3"
    ]
    assert problems(["task=predict"], "linear") == [
        "task: recipe linear cannot predict; it supports fit, validate"
    ]


def test_cosine_schedule_needs_a_step_or_epoch_limit() -> None:
    unlimited = ["optimizer.scheduler=cosine", "trainer.max_epochs=-1", "trainer.max_steps=-1"]
    assert problems([*unlimited, "data.batch_size=0"], "linear") == [
        "optimizer.scheduler: cosine decays over the run's steps, so it needs trainer.max_steps or"
        " trainer.max_epochs (both are -1); set one, or optimizer.scheduler=none",
        "data.batch_size: must be >= 1, got 0",
    ]
    assert load_config("linear", [*unlimited, "trainer.max_steps=100"]).trainer.max_steps == 100
    assert load_config("linear", [*unlimited, "trainer.fast_dev_run=true"]).trainer.fast_dev_run is True
    validate_only = [*unlimited, "task=validate", "callbacks.memory.enabled=false"]
    assert load_config("linear", validate_only).task == "validate"  # nothing is scheduled


def test_memory_monitor_outside_fit_gets_a_warning(recwarn: pytest.WarningsRecorder) -> None:
    with pytest.warns(UserWarning, match="callbacks.memory: the memory monitor records training only, so"):
        assert load_config("digits", ["task=validate"]).task == "validate"
    recwarn.clear()
    assert load_config("resnet18_predict").callbacks.memory.enabled is False
    assert load_config("digits", ["task=validate", "callbacks.memory.enabled=false"]).task == "validate"
    assert load_config("digits").callbacks.memory.enabled is True
    assert not [w for w in recwarn if "callbacks.memory" in str(w.message)]


def test_valid_config_is_typed_and_overrides_apply() -> None:
    cfg = load_config("resnet18", ["trainer.devices=[0,3]", "model.num_classes=4", "optimizer.lr=1"])
    assert isinstance(cfg, RunConfig)
    assert cfg.trainer.devices == [0, 3]
    assert cfg.data.num_classes == 4  # follows ${model.num_classes}
    assert cfg.optimizer.lr == 1.0
    assert isinstance(cfg.optimizer.lr, float)
    assert CPU_DEVICE_CAP >= 2


def test_broken_interpolation_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cannot resolve an interpolation"):
        validate(load("linear", ["data.in_features=${model.nope}"]))


def test_key_in_the_wrong_section_points_to_the_right_one() -> None:
    assert problems(["trainer.lr=0.1", "trainer.batch_size=8"]) == [
        "trainer.lr: unknown key; did you mean optimizer.lr?",
        "trainer.batch_size: unknown key; did you mean data.batch_size?",
    ]


def test_yaml_numbers_fill_string_and_float_fields_but_booleans_do_not() -> None:
    cfg = load_config("digits", ["trainer.precision=16", "optimizer.weight_decay=0"])
    assert cfg.trainer.precision == "16"
    assert cfg.optimizer.weight_decay == 0.0
    assert problems(["callbacks.checkpoint.monitor=true"]) == [
        "callbacks.checkpoint.monitor: expected a string or null, got True"
    ]


def test_lightning_1x_strategy_names_point_to_the_mgpu_strategies() -> None:
    assert problems(["trainer.strategy=dp"]) == [
        "trainer.strategy: 'dp' is a Lightning 1.x strategy that Lightning 2 removed;"
        " use mgpu_dp (DataParallel in one process) or mgpu_ddp (one process per device)"
    ]
    (ddp2,) = problems(["trainer.strategy=ddp2"])
    assert "use mgpu_ddp (one process per device)" in ddp2
    still_in_2x = load_config("linear", ["trainer.strategy=ddp_spawn"])
    assert still_in_2x.trainer.strategy == "ddp_spawn"


class LooseAnnotations(torch.optim.SGD):
    """A third-party optimizer whose annotation (a string here) names what no import made."""

    def __init__(self, params: object, lr: float = 0.1, extra: os.nothere.Thing | None = None) -> None:
        super().__init__(params, lr=lr)


def test_an_optimizer_whose_annotations_cannot_be_evaluated_is_checked_by_its_names() -> None:
    name = f"{__name__}.LooseAnnotations"
    assert problems([f"optimizer._component_={name}", "optimizer.kwargs.extr=1"]) == [
        f"optimizer.kwargs.extr: {name} takes no argument extr; did you mean extra?"
    ]
    cfg = load_config("digits", [f"optimizer._component_={name}", "optimizer.kwargs.extra=null"])
    assert cfg.optimizer.kwargs == {"extra": None}


def test_optimizer_class_path_typos_are_named_before_anything_runs() -> None:
    assert problems(["optimizer._component_=torch.optim.SDG", "optimizer.kwargs.betaz=[0.9,0.95]"]) == [
        "optimizer._component_: 'torch.optim.SDG': torch.optim has no SDG; did you mean torch.optim.SGD?",
    ]
    assert problems(["optimizer._component_=torhc.optim.AdamW"]) == [
        "optimizer._component_: 'torhc.optim.AdamW': cannot import torhc.optim (No module named 'torhc')"
    ]
    assert problems(["optimizer._component_=torch.nn.Linear"])[0].startswith(
        "optimizer._component_: 'torch.nn.Linear' is not a torch.optim.Optimizer class"
    )
    assert problems(["optimizer.kwargs.betaz=[0.9,0.95]", "optimizer.kwargs.lr=0.1"]) == [
        "optimizer.kwargs.betaz: torch.optim.AdamW takes no argument betaz; did you mean betas?",
        "optimizer.kwargs.lr: set it as optimizer.lr, the section's own key",
    ]
    (far,) = problems(["optimizer.kwargs.qqqq=1"])  # nothing close: what the class takes
    assert far.startswith("optimizer.kwargs.qqqq: torch.optim.AdamW takes no argument qqqq; it takes lr, ")
    assert problems(["optimizer._component_=sgd", "optimizer.nesterov=true"]) == [
        "optimizer.nesterov: an argument of torch.optim.SGD; write it under kwargs: optimizer.kwargs.nesterov"
    ]
    cfg = load_config("digits", ["optimizer._component_=sgd", "optimizer.kwargs.nesterov=true"])
    assert cfg.optimizer.kwargs == {"nesterov": True}


def test_optimizer_component_overrides_the_file_and_name_is_not_a_key() -> None:
    assert load_config("digits").optimizer._component_ == "torch.optim.AdamW"
    assert load_config("digits", ["optimizer._component_=sgd"]).optimizer._component_ == "sgd"
    raw = OmegaConf.create({"recipe": "linear", "optimizer": {"_component_": "adam", "lr": 0.1}})
    assert validate(raw).optimizer._component_ == "adam"
    named = OmegaConf.create({"recipe": "linear", "optimizer": {"name": "adam"}})
    with pytest.raises(ConfigError) as info:
        validate(named)
    assert len(info.value.problems) == 1
    assert "optimizer.name: unknown key" in info.value.problems[0]
    assert "_component_" in info.value.problems[0]


def test_micro_batch_size_takes_rows_auto_or_null_and_only_where_a_strategy_takes_it() -> None:
    assert load_config("digits").trainer.micro_batch_size is None
    rows = load_config("digits", ["trainer.strategy=mgpu_ddp", "trainer.micro_batch_size=4"])
    assert rows.trainer.micro_batch_size == 4
    auto = load_config("digits", ["trainer.strategy=mgpu_dp", "trainer.micro_batch_size=auto"])
    assert auto.trainer.micro_batch_size == "auto"
    # the strategies' own check (check_micro_batch_size) speaks, one rule for config and Python
    expected = "trainer.micro_batch_size must be a positive number of rows, 'auto' (halve on out-of-memory)"
    for overrides, given in (
        (["trainer.micro_batch_size=0"], "got 0"),
        (["trainer.micro_batch_size=2.5", "trainer.strategy=ddp"], "got 2.5"),
        (["trainer.micro_batch_size=true"], "got True"),
    ):
        (message,) = problems(overrides)
        assert message.startswith(expected)
        assert message.endswith(given)
    for lightnings_own in ("ddp", "single_device", "auto"):
        (message,) = problems(["trainer.micro_batch_size=4", f"trainer.strategy={lightnings_own}"])
        takers = message.partition("the strategies that take micro_batch_size are ")[2].partition(" (")[0]
        assert message.startswith(
            f"trainer.micro_batch_size: strategy '{lightnings_own}' does not take micro_batch_size;"
        )
        assert message.endswith("(set trainer.strategy to one of them), or set trainer.micro_batch_size=null")
        assert {"mgpu_ddp", "mgpu_dp"} <= set(takers.split(", "))
        assert "ddp" not in takers.split(", ")


def test_strategy_options_are_checked_against_the_strategy_class_all_at_once() -> None:
    ddp = ["trainer.strategy=mgpu_ddp"]
    assert problems([*ddp, "trainer.strategy.stall_timout=60", "trainer.max_epoch=3"]) == [
        "trainer.max_epoch: unknown key; did you mean trainer.max_epochs?",
        "trainer.strategy.stall_timout: mgpu_ddp takes no option stall_timout; did you mean stall_timeout?",
    ]
    (far,) = problems([*ddp, "trainer.strategy.qqqq=1"])  # nothing close: what the strategy takes
    assert far.startswith("trainer.strategy.qqqq: mgpu_ddp takes no option qqqq; it takes ")
    assert "stall_timeout" in far
    stall, timeout = problems([*ddp, "trainer.strategy.stall_timeout=sixty", "trainer.strategy.timeout=[1]"])
    assert stall == "trainer.strategy.stall_timeout: expected a number or null, got 'sixty'"
    # a timedelta, in a config's words
    assert timeout == "trainer.strategy.timeout: expected seconds or null, got [1]"
    (environment,) = problems([*ddp, "trainer.strategy.cluster_environment=slurm"])
    # an option only Python code can set says so, rather than "expected null"
    assert environment.startswith("trainer.strategy.cluster_environment: expected null or a ClusterEnv")
    assert "given in Python code, not in a config" in environment
    (elsewhere,) = problems(["trainer.strategy=mgpu_dp", "trainer.strategy.stall_timeout=60"])
    assert elsewhere.startswith("trainer.strategy.stall_timeout: strategy 'mgpu_dp' does not take")
    assert "mgpu_ddp" in elsewhere.partition(" are ")[2]
    # values go through the strategy's own checks: the same words as MGPUDDPStrategy(stall_timeout=-1)
    (negative,) = problems([*ddp, "trainer.strategy.stall_timeout=-1"])
    assert negative.startswith("trainer.strategy.stall_timeout must be a positive number of seconds")
    (rows,) = problems([*ddp, "trainer.strategy.micro_batch_size=0"])
    assert rows.startswith("trainer.strategy.micro_batch_size must be a positive number of rows")
    both = problems([*ddp, "trainer.strategy.micro_batch_size=2", "trainer.micro_batch_size=2"])
    assert both == ["trainer.micro_batch_size: trainer.strategy.micro_batch_size is set too; keep one"]
    (not_a_name,) = problems(["trainer.strategy=[mgpu_ddp]"])
    assert not_a_name.startswith("trainer.strategy: expected a strategy name such as mgpu_ddp, or a mapping")


def test_a_strategy_mapping_merges_with_the_name_from_the_file_or_the_command_line(tmp_path: Path) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text("recipe: digits\ntrainer:\n  strategy: {name: mgpu_ddp, stall_timeout: 60}\n")
    more = load_config(mine, ["trainer.strategy.micro_batch_size=2"]).trainer.strategy
    assert more == {"name": "mgpu_ddp", "stall_timeout": 60, "micro_batch_size": 2}
    assert load_config(mine, ["trainer.strategy=mgpu_dp"]).trainer.strategy == "mgpu_dp"  # its defaults
    added = load_config("digits", ["trainer.strategy.stall_timeout=60"]).trainer.strategy
    assert added == {"name": "mgpu_auto", "stall_timeout": 60}  # digits.yaml names mgpu_auto
    cfg = load_config(
        "digits",
        [
            "trainer.strategy=mgpu_ddp",
            "trainer.strategy.stall_timeout=60",
            "trainer.strategy.find_unused_parameters=true",  # DistributedDataParallel's, through mgpu_ddp
            "trainer.strategy.timeout=600",
        ],
    )
    assert cfg.trainer.strategy == {
        "name": "mgpu_ddp",
        "stall_timeout": 60,
        "find_unused_parameters": True,
        "timeout": 600,
    }
    assert load_config("digits", ["trainer.strategy=mgpu_ddp"]).trainer.strategy == "mgpu_ddp"


def test_every_trainer_argument_is_a_key_read_from_lightnings_signature() -> None:
    cfg = load_config("digits", ["trainer.detect_anomaly=true", "trainer.val_check_interval=0.5"])
    assert (cfg.trainer.detect_anomaly, cfg.trainer.val_check_interval) == (True, 0.5)
    assert cfg.trainer.max_time is None  # Lightning's default where the run keeps it
    assert problems(["trainer.detect_anomly=true"]) == [
        "trainer.detect_anomly: unknown key; did you mean trainer.detect_anomaly?"
    ]


def test_wrong_types_of_any_trainer_argument_come_in_one_error_with_the_other_problems() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(
            "digits", ["trainer.val_check_interval=[1]", "trainer.detect_anomaly=maybe", "optimizer.lr=0"]
        )
    anomaly, interval, lr = info.value.problems  # keys omegaconf types first, then Lightning's unions
    assert str(info.value).startswith("digits has 3 problems:\n")
    assert anomaly.startswith("trainer.detect_anomaly: expected true or false, got 'maybe'")
    # Lightning's union in words: a timedelta reads "seconds", what a config gives for one
    assert interval.startswith("trainer.val_check_interval: expected an integer, a number, a string, seconds")
    assert interval.endswith("got [1]")
    assert lr.startswith("optimizer.lr: must be > 0")
    (clip,) = problems(["trainer.gradient_clip_val=-1"])
    assert clip.startswith("trainer.gradient_clip_val: must be >= 0")


def test_trainer_arguments_the_run_sets_say_where_to_set_them() -> None:
    logger, checkpointing = problems(["trainer.logger=false", "trainer.enable_checkpointing=false"])
    assert logger.startswith("trainer.logger: set by the run;")
    assert "metrics.csv" in logger
    assert checkpointing.endswith("set callbacks.checkpoint.enabled")


def test_callback_keys_are_the_callbacks_own_arguments_and_the_callbacks_check_them() -> None:
    cfg = load_config(
        "digits", ["callbacks.checkpoint.every_n_train_steps=2", "callbacks.early_stopping.min_delta=0.1"]
    )
    assert (cfg.callbacks.checkpoint.every_n_train_steps, cfg.callbacks.early_stopping.min_delta) == (2, 0.1)
    typo, other, own = problems(
        ["callbacks.checkpoint.every_n_train_step=2", "callbacks.checkpoint.mode=mni", "data.batch_size=0"]
    )
    assert typo.startswith("callbacks.checkpoint.every_n_train_step: unknown key; did you mean")
    assert typo.endswith("callbacks.checkpoint.every_n_train_steps?")
    assert other.startswith("data.batch_size: must be >= 1")
    assert own.startswith("callbacks.checkpoint: `mode` can be min, max")  # ModelCheckpoint's own words
    (rows,) = problems(["callbacks.memory.every_n_steps=0"])
    assert rows.startswith("callbacks.memory.every_n_steps must be a positive integer")
    (dirpath,) = problems(["callbacks.checkpoint.dirpath=elsewhere"])
    assert dirpath.startswith("callbacks.checkpoint.dirpath: set by the run;")
