"""The run config: bad fields are refused with a message naming the field and what to change."""

from __future__ import annotations

import re
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
        if sub_model is None:  # an optional section ([agent]): shown commented out
            assert f"# [{key}]" in text, f"{path} does not show the optional [{key}] section, commented out"
            continue
        missing = set(type(sub_model).model_fields) - set(data[key])
        # TOML has no null: a field unset by default is shown commented out.
        missing -= {field for field in missing if getattr(sub_model, field) is None and f"# {field} = " in text}
        assert not missing, f"{path} [{key}] does not set {sorted(missing)}"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda path: path.name)
def test_every_example_config_loads(path: Path) -> None:
    config = load_run_config(path)
    assert config.model.base


# ---- [agent] ----

CHAT = {"generator": "hidden_digit", "chat_template": True}
TOOL = "worker.generate.calculator:calculate"
ENVIRONMENT = "worker.generate.toy_agent:HiddenDigit"


def _agent(agent: dict, **sections: object) -> dict:
    return {"dataset": CHAT, "agent": agent, **sections}


@pytest.mark.parametrize(
    ("data", "field", "hints"),
    [
        (_agent({"tools": ["calculate"]}), "agent.tools", ["agent.tools.0='calculate'", "'package.module:name'"]),
        (_agent({"tools": [TOOL, "a.b:c()"]}), "agent.tools", ["agent.tools.1='a.b:c()'", "'package.module:name'"]),
        (_agent({"tools": [TOOL, TOOL]}), "agent.tools", ["listed more than once", "list each once"]),
        (_agent({"environment": "toy_agent.HiddenDigit"}), "agent.environment", ["'package.module:name'"]),
        (_agent({"environment": {}}), "agent.environment", ["empty table", "name at least one environment"]),
        (
            _agent({"environment": {"two words": ENVIRONMENT}}),
            "agent.environment",
            ["agent.environment.two words", "letters, digits"],
        ),
        (_agent({"environment": {"ok": "nope"}}), "agent.environment", ["agent.environment.ok='nope'"]),
        (_agent({"tools": [TOOL], "tool_timeout_s": 0}), "agent.tool_timeout_s", ["greater than 0"]),
        (_agent({"tools": [TOOL], "tool_timeout_s": -1.5}), "agent.tool_timeout_s", ["greater than 0"]),
        (_agent({"tools": [TOOL], "max_turn_tokens": 0}), "agent.max_turn_tokens", ["greater than or equal to 1"]),
        (_agent({"tools": [TOOL], "tool_call_format": "json"}), "agent.tool_call_format", ["'hermes'", "'tokenizer'"]),
        (_agent({"tools": [TOOL], "tools_timeout_s": 5}), "agent.tools_timeout_s", ["Extra inputs"]),
    ],
)
def test_bad_agent_field_is_named(data: dict, field: str, hints: list[str]) -> None:
    message = _error(data)
    assert f"- {field}:" in message, message
    for hint in hints:
        assert hint in message, message


@pytest.mark.parametrize(
    ("data", "hints"),
    [
        (_agent({}), ["[agent] has neither tools nor environment", "set agent.tools or agent.environment"]),
        (
            {"dataset": {"generator": "hidden_digit"}, "agent": {"tools": [TOOL]}},
            ["set dataset.chat_template = true", "dataset.messages_column"],
        ),
        (
            _agent({"environment": {"digit": ENVIRONMENT}}),
            ["agent.environment is a table", "set dataset.environment_column"],
        ),
        (
            {"dataset": {**CHAT, "environment_column": "env"}, "agent": {"environment": ENVIRONMENT}},
            ["dataset.environment_column is set", "agent.environment is not a table"],
        ),
        (
            {"dataset": {**CHAT, "environment_column": "env"}, "agent": {"tools": [TOOL]}},
            ["dataset.environment_column is set", "not a table of named environments"],
        ),
        (
            {"dataset": {**CHAT, "environment_column": "env"}},
            ["dataset.environment_column names environments", "[agent] has no environment table"],
        ),
        (
            _agent({"tools": [TOOL]}, eval={"every_versions": 10}),
            ["[agent] evaluates conversations too", "set eval.dataset.chat_template = true"],
        ),
        (
            {
                "dataset": {**CHAT, "environment_column": "env"},
                "agent": {"environment": {"digit": ENVIRONMENT}},
                "eval": {"every_versions": 10, "dataset": CHAT},
            },
            ["agent.environment is a table", "set eval.dataset.environment_column"],
        ),
        ({"rewards": []}, ["rewards: add at least one [[rewards]] entry", "agent.environment with get_reward"]),
        (_agent({"tools": [TOOL]}, rewards=[]), ["rewards: add at least one [[rewards]] entry"]),
    ],
)
def test_agent_that_cannot_run_says_what_to_change(data: dict, hints: list[str]) -> None:
    message = _error(data)
    assert message.startswith("test.toml is not a valid run config"), message
    for hint in hints:
        assert hint in message, message


def test_an_environment_may_own_the_reward_without_rewards() -> None:
    config = parse_run_config(_agent({"environment": ENVIRONMENT}, rewards=[]))
    assert config.rewards == [] and config.agent is not None
    assert config.agent.environments == {None: ENVIRONMENT} and not config.agent.named_environments


def test_named_environments_with_their_column_validate() -> None:
    config = parse_run_config(
        {
            "dataset": {**CHAT, "environment_column": "env"},
            "agent": {"tools": [TOOL], "environment": {"digit": ENVIRONMENT, "other-one.v2": ENVIRONMENT}},
            "eval": {"every_versions": 10, "dataset": {**CHAT, "environment_column": "env"}},
        }
    )
    assert config.agent is not None and config.agent.named_environments
    assert config.agent.environments == {"digit": ENVIRONMENT, "other-one.v2": ENVIRONMENT}


def test_a_run_without_agent_stores_the_json_it_stored_before_agent_existed() -> None:
    import json

    for config in (RunConfig(), load_run_config(EXAMPLES / "gpu-qwen2.5-math-1.5b.toml")):
        text = config.to_json()
        data = json.loads(text)
        assert "agent" not in data
        assert "environment_column" not in text
        assert "environment_column" not in data["dataset"] and "environment_column" not in data["eval"]["dataset"]
        again = RunConfig.from_json(text)
        assert again == config and again.agent is None and again.to_json() == text


def test_a_run_with_agent_roundtrips_through_json() -> None:
    import json

    config = parse_run_config(
        {
            "dataset": {**CHAT, "environment_column": "env"},
            "rewards": [],
            "agent": {
                "tools": [TOOL],
                "environment": {"digit": ENVIRONMENT},
                "max_tool_calling_iterations": 3,
                "tool_timeout_s": 2.5,
                "max_turn_tokens": 64,
                "tool_call_format": "tokenizer",
            },
            "eval": {"every_versions": 10, "dataset": {**CHAT, "environment_column": "env"}},
        }
    )
    text = config.to_json()
    data = json.loads(text)
    assert data["agent"]["tools"] == [TOOL] and data["dataset"]["environment_column"] == "env"
    again = RunConfig.from_json(text)
    assert again == config and again.to_json() == text


def test_the_agent_gpu_recipe_calls_the_calculator_on_gsm8k() -> None:
    config = load_run_config(EXAMPLES / "gpu-qwen2.5-1.5b-agent.toml")
    agent = config.agent
    assert agent is not None
    assert agent.tools == [TOOL] and agent.environment is None
    assert agent.tool_call_format == "hermes"
    assert agent.max_tool_calling_iterations == 4 and 0 < agent.tool_timeout_s <= 30
    assert config.model.base == "Qwen/Qwen2.5-1.5B-Instruct" and config.sampling.backend == "vllm"
    for dataset in (config.dataset, config.eval.dataset):
        assert (dataset.hub_id, dataset.subset, dataset.prompt_column) == ("openai/gsm8k", "main", "question")
        assert dataset.chat_template and "\\boxed{}" in (dataset.system_prompt or "")
        assert "calculate" in (dataset.system_prompt or "")
        found = re.search(dataset.answer_pattern or "", "She sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\n#### 18")
        assert found is not None and found.group(1) == "18"
    assert [reward.name for reward in config.rewards] == ["math_verify"]
    assert config.eval.every_versions > 0
    # The conversation's budget leaves room for several turns, each turn within it.
    assert agent.max_turn_tokens is not None and 2 * agent.max_turn_tokens <= config.sampling.max_completion_length
