"""The run config: bad fields are refused with a message naming the field and what to change."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncgrpo.run.config import ConfigError, RunConfig, load_run_config, parse_run_config
from tests.support.paths import REPO_ROOT

EXAMPLES = REPO_ROOT / "examples"


def _error(data: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_run_config(data, "test.toml")
    return str(caught.value)


def test_defaults_are_valid_and_roundtrip_through_json() -> None:
    config = RunConfig()
    assert RunConfig.from_json(config.to_json()) == config
    tuned = parse_run_config({"seed": 7, "async": {"max_staleness": 4, "groups_per_step": 2}})
    assert tuned.async_.max_staleness == 4
    again = RunConfig.from_json(tuned.to_json())
    assert again == tuned and '"async"' in tuned.to_json()


@pytest.mark.parametrize(
    ("data", "field", "hint"),
    [
        ({"lora": {"rnak": 8}}, "lora.rnak", "Extra inputs are not permitted"),
        ({"colour": "blue"}, "colour", "Extra inputs are not permitted"),
        ({"lora": {"rank": 0}}, "lora.rank", "greater than or equal to 1"),
        ({"sampling": {"samples_per_prompt": 1}}, "sampling.samples_per_prompt", "greater than or equal to 2"),
        ({"sampling": {"top_p": 1.5}}, "sampling.top_p", "less than or equal to 1"),
        ({"optimizer": {"learning_rate": -1.0}}, "optimizer.learning_rate", "greater than 0"),
        ({"loss": {"loss_type": "ppo"}}, "loss.loss_type", "'dapo'"),
        ({"async": {"max_staleness": 65}}, "async.max_staleness", "less than or equal to 64"),
        ({"model": {"dtype": "int8"}}, "model.dtype", "'float32'"),
        ({"model": {"attn_implementation": "flash_attention"}}, "model.attn_implementation", "'flash_attention_2'"),
        ({"optimizer": {"gradient_checkpoint": True}}, "optimizer.gradient_checkpoint", "Extra inputs"),
        ({"optimizer": {"torch_compile": "yes please"}}, "optimizer.torch_compile", "valid boolean"),
        ({"rewards": []}, "rewards", "at least 1"),
        ({"seed": "abc"}, "seed", "valid integer"),
    ],
)
def test_bad_field_is_named(data: dict, field: str, hint: str) -> None:
    message = _error(data)
    assert message.startswith("test.toml is not a valid run config")
    assert f"- {field}:" in message, message
    assert hint in message, message


def test_speed_switches_default_to_transformers_and_trl_defaults_but_padding_free() -> None:
    config = RunConfig()
    assert config.model.attn_implementation is None  # transformers' default
    assert (config.optimizer.gradient_checkpointing, config.optimizer.torch_compile) == (False, False)
    assert config.optimizer.padding_free is True
    tuned = parse_run_config(
        {
            "model": {"attn_implementation": "eager"},
            "optimizer": {"gradient_checkpointing": True, "torch_compile": True, "padding_free": False},
        }
    )
    assert tuned.model.attn_implementation == "eager"
    assert (tuned.optimizer.gradient_checkpointing, tuned.optimizer.torch_compile) == (True, True)
    assert tuned.optimizer.padding_free is False
    assert RunConfig.from_json(tuned.to_json()) == tuned


def test_queue_smaller_than_a_step_says_what_to_raise() -> None:
    message = _error({"async": {"queue_maxsize": 4, "groups_per_step": 8, "groups_per_task": 4}})
    assert "async.queue_maxsize=4" in message and "async.groups_per_step" in message
    assert "raise queue_maxsize" in message


def test_buffer_that_can_never_fill_a_version_is_refused() -> None:
    # 10 groups fit, but in tasks of 4 only 8 are reachable.
    assert "at most 8" in _error({"async": {"groups_per_task": 4, "groups_per_step": 10, "queue_maxsize": 10}})
    assert "publish_every" in _error({"async": {"groups_per_step": 4, "publish_every": 3, "queue_maxsize": 8}})
    config = RunConfig.model_validate(
        {"async": {"groups_per_task": 2, "groups_per_step": 4, "publish_every": 2, "queue_maxsize": 8}}
    )
    assert config.final_version == -(-config.optimizer.total_steps // 2)


def test_queue_smaller_than_a_task_is_refused() -> None:
    message = _error({"async": {"queue_maxsize": 8, "groups_per_step": 8, "groups_per_task": 9}})
    assert "async.groups_per_task=9" in message


def test_dataset_needs_a_source() -> None:
    message = _error({"dataset": {"generator": ""}})
    assert "dataset.path" in message and "dataset.generator" in message


def test_empty_target_modules_refused() -> None:
    assert "lora.target_modules" in _error({"lora": {"target_modules": []}})


def test_load_run_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_config(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[lora\nrank = 8\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_run_config(broken)
    bad = tmp_path / "bad.toml"
    bad.write_text("[async]\nmax_staleness = -1\n")
    with pytest.raises(ConfigError, match=r"async\.max_staleness"):
        load_run_config(bad)


def test_demo_config_is_valid_and_spells_out_every_section() -> None:
    path = EXAMPLES / "demo.toml"
    config = load_run_config(path)
    text = path.read_text()
    for section in ("[model]", "[lora]", "[dataset]", "[[rewards]]", "[sampling]", "[optimizer]", "[loss]", "[async]"):
        assert section in text, f"{path} lacks the {section} section"
    # The demo writes every field out explicitly, so a reader sees each knob and its value.
    import tomllib

    data = tomllib.loads(text)
    for name, section in RunConfig.model_fields.items():
        key = section.alias or name
        if key in ("seed", "rewards"):
            assert key in data
            continue
        sub_model = getattr(config, name)
        missing = set(type(sub_model).model_fields) - set(data[key])
        # TOML has no null: a field unset by default is shown commented out.
        missing -= {field for field in missing if getattr(sub_model, field) is None and f"# {field} = " in text}
        assert not missing, f"{path} [{key}] does not set {sorted(missing)}"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda path: path.name)
def test_every_example_config_loads(path: Path) -> None:
    config = load_run_config(path)
    assert config.model.base
