"""The vLLM generation backend (worker/generate/vllm_backend.py) and the backend factory.

Two groups of tests:

- pure ones that run everywhere: adapter screening, rank rounding, id mapping, the factory's choice and
  engine settings, the GPU recipe's config;
- ``vllm``-marked ones, skipped unless vLLM is importable; run them with ``scripts/test_vllm.sh``, which
  builds the ``.venv-vllm`` environment. They start one real vLLM engine on the tiny model (CPU, float32),
  make real adapter versions with the real trainer, and check vLLM's samples against the trainer's
  rescoring of them, which is the check that the served policy is the trained one.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from asyncgrpo.protocol.records import StepRecord
from asyncgrpo.run.config import RunConfig, load_run_config
from tests.support.fixtures_s3 import open_env_bucket
from tests.support.paths import REPO_ROOT
from worker.generate.factory import (
    VLLM_ENGINE_ARGS_ENV,
    chosen_backend,
    vllm_engine_settings,
)
from worker.generate.settings import GenerateSettings
from worker.generate.vllm_backend import (
    UnservableAdapter,
    adapter_lora_id,
    check_servable_adapter,
    round_up_lora_rank,
)
from worker.process.settings import WorkerSettings

REPO = REPO_ROOT
GPU_RECIPE = REPO / "examples" / "gpu-qwen2.5-math-1.5b.toml"
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks in vLLM 0.32

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed; run scripts/test_vllm.sh"
)


# --- pure checks (no vLLM needed) ---------------------------------------------------------------------------


def write_peft_adapter(folder: Path, **lora_kwargs: Any) -> Path:
    """A PEFT-written adapter folder (config by PEFT itself; the weights file only needs to exist here)."""
    from peft import LoraConfig

    config = LoraConfig(task_type="CAUSAL_LM", **{"r": 8, "target_modules": "all-linear", **lora_kwargs})
    config.save_pretrained(str(folder))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


def test_plain_lora_adapter_is_servable(tmp_path: Path) -> None:
    config = check_servable_adapter(write_peft_adapter(tmp_path / "v0", r=8), max_lora_rank=8, name="v0")
    assert config["r"] == 8


@pytest.mark.parametrize(
    ("lora_kwargs", "named"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"r": 16}, "max_lora_rank=8"),
        ({"r": 4, "rank_pattern": {"q_proj": 32}}, "rank 32"),
        ({"bias": "lora_only"}, "bias"),
    ],
)
def test_unservable_adapter_is_refused_naming_the_field(
    tmp_path: Path, lora_kwargs: dict[str, Any], named: str
) -> None:
    folder = write_peft_adapter(tmp_path / "v3", **lora_kwargs)
    with pytest.raises(UnservableAdapter, match=named) as raised:
        check_servable_adapter(folder, max_lora_rank=8, name="v3")
    assert "v3" in str(raised.value)


def test_adapter_without_weights_or_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"adapter_config\.json"):
        check_servable_adapter(tmp_path, max_lora_rank=8)
    folder = write_peft_adapter(tmp_path / "v1")
    (folder / "adapter_model.safetensors").unlink()
    (folder / "adapter_model.bin").write_bytes(b"")
    with pytest.raises(UnservableAdapter, match="safetensors"):
        check_servable_adapter(folder, max_lora_rank=8)


def test_lora_rank_rounds_up_to_a_size_vllm_supports() -> None:
    assert [round_up_lora_rank(r, VLLM_RANKS) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    with pytest.raises(ValueError, match=r"lower lora\.rank"):
        round_up_lora_rank(513, VLLM_RANKS)


def test_version_zero_gets_lora_id_one() -> None:
    assert [adapter_lora_id(v) for v in (0, 1, 41)] == [1, 2, 42]
    with pytest.raises(ValueError):
        adapter_lora_id(-1)


def test_worker_flag_overrides_the_run_configs_backend() -> None:
    config = RunConfig.model_validate({"sampling": {"backend": "vllm"}})
    assert chosen_backend(config, WorkerSettings(generation_backend=None)) == "vllm"
    assert chosen_backend(config, WorkerSettings(generation_backend="transformers")) == "transformers"
    with pytest.raises(ValueError, match="ASYNCGRPO_GENERATION_BACKEND='sglang'"):
        chosen_backend(config, WorkerSettings(generation_backend="sglang"))


def test_engine_settings_follow_the_run_config() -> None:
    config = RunConfig.model_validate(
        {
            "seed": 5,
            "model": {"max_prompt_length": 100, "dtype": "bfloat16"},
            "lora": {"rank": 2},
            "sampling": {"max_completion_length": 28},
            "async": {"max_staleness": 3},
        }
    )
    settings = vllm_engine_settings(config)
    assert settings == {"dtype": "bfloat16", "max_loras": 5, "max_lora_rank": 2, "max_model_len": 128, "seed": 5}


def test_engine_args_from_env_must_be_a_json_object(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VLLM_ENGINE_ARGS_ENV, '{"gpu_memory_utilization": 0.8}')
    assert GenerateSettings().vllm_engine_args == {"gpu_memory_utilization": 0.8}
    monkeypatch.setenv(VLLM_ENGINE_ARGS_ENV, "gpu_memory_utilization=0.8")
    with pytest.raises(ValueError, match=VLLM_ENGINE_ARGS_ENV):
        GenerateSettings()
    monkeypatch.setenv(VLLM_ENGINE_ARGS_ENV, "[0.8]")
    with pytest.raises(ValueError, match="JSON object"):
        GenerateSettings()


def test_gpu_recipe_validates_and_matches_the_reference_run() -> None:
    config = load_run_config(GPU_RECIPE)
    assert config.model.base == "Qwen/Qwen2.5-Math-1.5B"
    assert (config.lora.rank, config.lora.alpha, config.lora.target_modules) == (1, 2.0, "all-linear")
    assert config.sampling.samples_per_prompt == 8
    assert config.async_.groups_per_step * config.sampling.samples_per_prompt == 128  # completions per step
    assert config.sampling.max_completion_length == 3000
    assert config.model.max_prompt_length + config.sampling.max_completion_length == 4096
    assert config.async_.max_staleness == 4
    assert [reward.name for reward in config.rewards] == ["math_verify"]
    assert config.sampling.backend == "vllm"
    # A Hub dataset, nothing to build by hand; a held-out split for evaluation, templated like training.
    assert (config.dataset.hub_id, config.dataset.split) == ("DigitalLearningGmbH/MATH-lighteval", "train")
    assert (config.eval.dataset.hub_id, config.eval.dataset.split) == ("DigitalLearningGmbH/MATH-lighteval", "test")
    assert config.dataset.chat_templated and config.eval.dataset.chat_templated and config.eval.every_versions > 0
    settings = vllm_engine_settings(config)
    assert (settings["max_loras"], settings["max_model_len"]) == (6, 4096)
    assert round_up_lora_rank(settings["max_lora_rank"], VLLM_RANKS) == 1


# --- with a real vLLM engine ---------------------------------------------------------------------------------

MAX_STALENESS = 2
SAMPLES_PER_PROMPT = 4
TEMPERATURE = 0.8  # not 1, so that a logprob taken before the temperature would show
MAX_COMPLETION_LENGTH = 12
PROMPTS = ["3=", "5=", "8=", "0=", "1=", "7="]
RATIO_TOLERANCE = 1e-3


def vllm_test_config(tiny_dir: Path) -> RunConfig:
    return RunConfig.model_validate(
        {
            "seed": 0,
            "model": {"base": str(tiny_dir), "max_prompt_length": 8},
            "sampling": {
                "samples_per_prompt": SAMPLES_PER_PROMPT,
                "max_completion_length": MAX_COMPLETION_LENGTH,
                "temperature": TEMPERATURE,
                "backend": "vllm",
            },
            # A high learning rate so that consecutive versions differ clearly in a few updates.
            "optimizer": {"learning_rate": 0.05},
            "async": {"max_staleness": MAX_STALENESS},
        }
    )


@dataclass
class VLLMSetup:
    config: RunConfig
    backend: Any  # VLLMBackend
    trainer: Any  # worker.optimize.trainer.Trainer
    versions: list[dict[str, bytes]]  # the files of version 0, 1, ... as the trainer published them


def favour_digit(trainer: Any, digit: str, other: str, updates: int = 3) -> None:
    """A few GRPO updates that reward repeating ``digit`` and punish ``other``: a clearly different policy."""
    from worker.optimize.batch import TrainSample

    tokenizer = trainer.policy.tokenizer
    eos = trainer.policy.eos_token_id
    good = [tokenizer.convert_tokens_to_ids(digit)] * 4 + [eos]
    bad = [tokenizer.convert_tokens_to_ids(other)] * 4 + [eos]
    samples = [
        TrainSample(prompt, completion, [0.0] * len(completion), advantage)
        for prompt in trainer.policy.encode_prompts(PROMPTS[:3])
        for completion, advantage in ((good, 1.0), (bad, -1.0))
    ]
    for _ in range(updates):
        # Behaviour = current policy, so every update is a full policy-gradient step (no clipping).
        current = trainer.rescore(samples)
        samples = [replace(s, behavior_logprobs=lp) for s, lp in zip(samples, current, strict=True)]
        trainer.step(samples)


@pytest.fixture(scope="module")
def vllm_setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMSetup]:
    """One vLLM engine (max_loras = max_staleness + 2) and six trained versions of the tiny model's LoRA."""
    from worker.generate.factory import build_generation_backend
    from worker.model.policy import Policy
    from worker.model.tiny_model import ensure_tiny_model
    from worker.optimize.trainer import Trainer

    tiny_dir = ensure_tiny_model(seed=0, cache_dir=tmp_path_factory.mktemp("asyncgrpo-cache"))
    config = vllm_test_config(tiny_dir)
    trainer = Trainer.initial(Policy.load(str(tiny_dir), dtype="float32", device="cpu"), config)
    versions = [trainer.version_files(0)]
    for version in range(1, MAX_STALENESS + 4):
        favour_digit(trainer, digit=str(version % 10), other=str((version + 5) % 10))
        versions.append(trainer.version_files(version))
    backend = build_generation_backend(config, WorkerSettings(generation_backend="vllm", device="cpu"))
    yield VLLMSetup(config=config, backend=backend, trainer=trainer, versions=versions)


def adapter_folder(setup: VLLMSetup, version: int, root: Path) -> Path:
    from worker.optimize.trainer_state import write_adapter_folder

    return write_adapter_folder(setup.versions[version], root / f"v{version}")


def sample(setup: VLLMSetup, adapter: str | None, seed: int = 11) -> Any:
    return setup.backend.generate(
        PROMPTS,
        adapter=adapter,
        samples_per_prompt=SAMPLES_PER_PROMPT,
        max_completion_length=MAX_COMPLETION_LENGTH,
        temperature=TEMPERATURE,
        top_p=1.0,
        seed=seed,
    )


def rescore_under(setup: VLLMSetup, version: int, result: Any) -> tuple[list[list[float]], list[list[float]]]:
    """(vLLM's behaviour logprobs, the trainer's logprobs of the same tokens under ``version``'s weights)."""
    from worker.optimize.batch import TrainSample

    samples = [
        TrainSample(prompt.prompt_token_ids, completion.token_ids, completion.logprobs, 0.0, version)
        for prompt in result.results
        for completion in prompt.completions
    ]
    setup.trainer.load_version_files(setup.versions[version])
    return [s.behavior_logprobs for s in samples], setup.trainer.rescore(samples)


def logprob_gap(behaviour: list[list[float]], rescored: list[list[float]]) -> float:
    """Mean absolute difference of two logprob lists, token by token."""
    diffs = [
        abs(b - r) for row_b, row_r in zip(behaviour, rescored, strict=True) for b, r in zip(row_b, row_r, strict=True)
    ]
    return sum(diffs) / len(diffs)


def token_ids(result: Any) -> list[list[int]]:
    return [completion.token_ids for prompt in result.results for completion in prompt.completions]


@needs_vllm
@pytest.mark.vllm
def test_versions_sample_differently_and_match_the_trainers_rescoring(vllm_setup: VLLMSetup, tmp_path: Path) -> None:
    from worker.optimize.trainer import mean_ratio

    backend = vllm_setup.backend
    for version in (1, 2):
        backend.load_adapter(f"v{version}", version, adapter_folder(vllm_setup, version, tmp_path))
    try:
        first, second = sample(vllm_setup, "v1"), sample(vllm_setup, "v2")
        assert token_ids(first) != token_ids(second), "two adapter versions gave the same samples from one seed"
        assert token_ids(sample(vllm_setup, "v1")) == token_ids(first), "the same seed gave other samples"
        for result in (first, second):
            for prompt in result.results:
                assert len(prompt.completions) == SAMPLES_PER_PROMPT
                for completion in prompt.completions:
                    stopped = completion.token_ids[-1] == backend.eos_token_id
                    assert completion.finish_reason == ("stop" if stopped else "length")
                    assert stopped or len(completion.token_ids) == MAX_COMPLETION_LENGTH

        ratios = {}
        for version, result in ((1, first), (2, second)):
            behaviour, rescored = rescore_under(vllm_setup, version, result)
            ratios[version] = mean_ratio(behaviour, rescored)
            assert abs(ratios[version] - 1.0) < RATIO_TOLERANCE, (version, ratios[version])
            assert logprob_gap(behaviour, rescored) < 1e-4
        # The check can fail: the same samples rescored under the other version are far off.
        behaviour, wrong = rescore_under(vllm_setup, 2, first)
        assert logprob_gap(behaviour, wrong) > 0.02
        print(f"\nvLLM vs trainer rescoring, fp32 CPU: mean ratio v1={ratios[1]:.7f} v2={ratios[2]:.7f}")
    finally:
        for version in (1, 2):
            backend.drop_adapter(f"v{version}")


@needs_vllm
@pytest.mark.vllm
def test_worker_serves_every_cached_version_and_only_the_one_asked_for(vllm_setup: VLLMSetup, tmp_path: Path) -> None:
    """The generate worker's own adapter cache (max_staleness + 2 versions) wired to vLLM as runtime.py does."""
    from asyncgrpo.bucket.backends import FileBucket
    from asyncgrpo.bucket.layout import write_version
    from worker.generate.adapter_cache import AdapterCache
    from worker.generate.backend import UnknownAdapter

    backend = vllm_setup.backend
    run = "vllm-cache"
    bucket = FileBucket(tmp_path / "bucket")
    shas = [write_version(bucket, run, v, files, {"step": v})[1] for v, files in enumerate(vllm_setup.versions)]
    capacity = vllm_setup.config.async_.max_staleness + 2
    assert backend.max_loras == capacity
    cache = AdapterCache(bucket, run, tmp_path / "cache", capacity=capacity, backend=backend)

    def lease(version: int) -> None:  # what generate_job does on a lease of `version`
        backend.load_adapter(f"v{version}", version, cache.get(version, shas[version]))

    newest = len(vllm_setup.versions) - 1  # max_staleness + 3 versions: the first one must go
    fresh: dict[int, list[list[int]]] = {}
    try:
        for version in range(newest + 1):
            lease(version)
            fresh[version] = token_ids(sample(vllm_setup, f"v{version}"))
        kept = list(range(newest + 1 - capacity, newest + 1))
        assert backend.loaded_adapters() == sorted(f"v{v}" for v in kept)
        assert backend.llm.llm_engine.list_loras() == {v + 1 for v in kept}  # id = version + 1, nothing else
        with pytest.raises(UnknownAdapter):
            sample(vllm_setup, f"v{newest - capacity}")

        # Requests in a mixed order, the oldest kept version (still leased) included: each is served by the
        # version it names, token for token as when it was new, with that version's logprobs.
        for version in (kept[0], newest, kept[1], kept[0]):
            result = sample(vllm_setup, f"v{version}")
            assert token_ids(result) == fresh[version], f"v{version} is not served as it was when loaded"
            behaviour, rescored = rescore_under(vllm_setup, version, result)
            assert logprob_gap(behaviour, rescored) < 1e-4, f"v{version} served with other weights"
            for other in kept:
                if other != version:
                    assert logprob_gap(*rescore_under(vllm_setup, other, result)) > 0.01
    finally:
        for name in backend.loaded_adapters():
            backend.drop_adapter(name)


@needs_vllm
@pytest.mark.vllm
def test_loading_past_the_lora_slots_is_refused(vllm_setup: VLLMSetup, tmp_path: Path) -> None:
    from worker.generate.vllm_backend import AdapterSlotsFull

    backend = vllm_setup.backend
    slots = backend.max_loras
    try:
        for version in range(slots):
            backend.load_adapter(f"v{version}", version, adapter_folder(vllm_setup, version, tmp_path))
        with pytest.raises(AdapterSlotsFull, match="drop one first"):
            backend.load_adapter(f"v{slots}", slots, adapter_folder(vllm_setup, slots, tmp_path))
        with pytest.raises(ValueError, match="never reused"):
            backend.load_adapter("v0", 1, adapter_folder(vllm_setup, 1, tmp_path / "again"))
        unservable = write_peft_adapter(tmp_path / "dora", use_dora=True)
        backend.drop_adapter("v0")
        with pytest.raises(UnservableAdapter, match="use_dora"):
            backend.load_adapter("v99", 99, unservable)
        assert "v99" not in backend.loaded_adapters()
    finally:
        for name in backend.loaded_adapters():
            backend.drop_adapter(name)


@needs_vllm
@pytest.mark.vllm
def test_base_model_and_prompt_limits(vllm_setup: VLLMSetup) -> None:
    backend = vllm_setup.backend
    result = sample(vllm_setup, None)
    assert result.adapter is None and len(result.results) == len(PROMPTS)
    assert result.timings.completion_tokens == sum(len(ids) for ids in token_ids(result))
    assert backend.tokenize(["3="]) == [vllm_setup.trainer.policy.encode_prompts(["3="])[0]]
    with pytest.raises(ValueError, match="max_model_len"):
        backend.generate(
            ["1234567890="],
            adapter=None,
            samples_per_prompt=2,
            max_completion_length=12,
            temperature=1.0,
            top_p=1.0,
            seed=0,
        )


@needs_vllm
@pytest.mark.vllm
def test_generate_path_imports_in_this_environment_without_vllm() -> None:
    """What a generate or optimize worker imports works here, and only building a vLLM backend imports vLLM."""
    code = (
        "import sys\n"
        "import worker.process.tasks, worker.generate.job, worker.optimize.job, worker.process.runtime\n"
        "import worker.generate.factory, worker.generate.vllm_backend, worker.generate.transformers_backend\n"
        "assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if m.startswith('vllm'))[:5]\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, env=dict(os.environ)
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


# --- token-id continuation and agent conversations, on the tiny agent model ----------------------------------

TOY_ENVIRONMENT = "worker.generate.toy_agent:HiddenDigit"
AGENT_PROMPTS = 8
AGENT_SAMPLES = 8
AGENT_BUDGET = 16  # sampling.max_completion_length: a conversation's tokens, model and tool tokens alike


def agent_test_config(agent_dir: Path) -> RunConfig:
    return RunConfig.model_validate(
        {
            "seed": 0,
            "model": {"base": str(agent_dir), "max_prompt_length": 16},
            "dataset": {"generator": "hidden_digit", "chat_template": True},
            "rewards": [{"name": "repeat_digit", "weight": 0.75}],
            "agent": {"environment": TOY_ENVIRONMENT, "max_tool_calling_iterations": 2, "tool_timeout_s": 10},
            "sampling": {
                "samples_per_prompt": AGENT_SAMPLES,
                "max_completion_length": AGENT_BUDGET,
                "temperature": TEMPERATURE,
                "backend": "vllm",
            },
        }
    )


@dataclass
class AgentSetup:
    config: RunConfig
    backend: Any  # VLLMBackend on the tiny agent model
    trainer: Any  # its trainer (LoRA at zero: the base model's logprobs)


@pytest.fixture(scope="module")
def agent_setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentSetup]:
    """A second vLLM engine, on the tiny agent model, and a trainer on the same weights."""
    from worker.generate.factory import build_generation_backend
    from worker.model.policy import Policy
    from worker.model.tiny_model import ensure_tiny_model
    from worker.optimize.trainer import Trainer

    agent_dir = ensure_tiny_model(cache_dir=tmp_path_factory.mktemp("asyncgrpo-agent-cache"), agent=True)
    config = agent_test_config(agent_dir)
    trainer = Trainer.initial(Policy.load(str(agent_dir), dtype="float32", device="cpu"), config)
    backend = build_generation_backend(config, WorkerSettings(generation_backend="vllm", device="cpu"))
    yield AgentSetup(config=config, backend=backend, trainer=trainer)


def model_token_gaps(trainer: Any, samples: list[Any]) -> list[float]:
    """|generator - trainer| logprob of every model token (completion_mask True, or all when None)."""
    gaps = []
    for sample, rescored in zip(samples, trainer.rescore(samples), strict=True):
        mask = sample.completion_mask or [True] * len(rescored)
        gaps += [abs(b - r) for b, r, model in zip(sample.behavior_logprobs, rescored, mask, strict=True) if model]
    return gaps


@needs_vllm
@pytest.mark.vllm
def test_generate_from_ids_continues_each_sequence_as_the_trainer_scores_it(agent_setup: AgentSetup) -> None:
    from worker.generate.agent import prompt_text, tool_answer_ids
    from worker.model.tiny_model import REVEAL_CALL
    from worker.optimize.batch import TrainSample
    from worker.optimize.trainer import mean_ratio

    backend = agent_setup.backend
    tokenizer = backend.tokenizer
    eos = backend.eos_token_id
    chat = prompt_text(tokenizer, [{"role": "user", "content": "?="}], [], None)  # "<user>?=<assistant>"
    prompt = backend.tokenize([chat], add_special_tokens=False)[0]
    reveal = tokenizer.convert_tokens_to_ids(REVEAL_CALL)
    answer = tool_answer_ids(tokenizer, [{"role": "tool", "name": "reveal", "content": "7"}], eos)
    digits = backend.tokenize(["35"], add_special_tokens=False)[0]
    # Conversations at several points (after the prompt, a tool answer, a model's partial turn), some of them
    # prefixes of others; the short budgets must cut their sequences.
    after_tool = [*prompt, reveal, eos, *answer]
    sequences = [prompt, after_tool, prompt + digits, prompt, after_tool]
    budgets = [AGENT_BUDGET, 10, 2, 1, 1]

    def continue_all(seed: int) -> list[Any]:
        return backend.generate_from_ids(
            sequences, adapter=None, max_completion_lengths=budgets, temperature=TEMPERATURE, top_p=1.0, seed=seed
        )

    completions = continue_all(seed=3)
    assert len(completions) == len(sequences)
    for completion, budget in zip(completions, budgets, strict=True):
        assert 1 <= len(completion.token_ids) <= budget
        assert eos not in completion.token_ids[:-1], "a completion went on past its EOS"
        stopped = completion.token_ids[-1] == eos
        assert completion.finish_reason == ("stop" if stopped else "length"), completion
        assert stopped or len(completion.token_ids) == budget
    cut = [c for c, budget in zip(completions, budgets, strict=True) if budget < AGENT_BUDGET]
    assert any(c.finish_reason == "length" for c in cut), "no short budget cut its sequence"

    again = continue_all(seed=3)
    assert [(c.token_ids, c.logprobs) for c in again] == [(c.token_ids, c.logprobs) for c in completions]
    assert [c.token_ids for c in continue_all(seed=4)] != [c.token_ids for c in completions]

    samples = [TrainSample(ids, c.token_ids, c.logprobs, 0.0) for ids, c in zip(sequences, completions, strict=True)]
    behaviour = [s.behavior_logprobs for s in samples]
    rescored = agent_setup.trainer.rescore(samples)
    gaps = model_token_gaps(agent_setup.trainer, samples)
    print(f"\ngenerate_from_ids vs trainer rescoring: largest logprob gap {max(gaps):.2e} over {len(gaps)} tokens")
    assert logprob_gap(behaviour, rescored) < 1e-4
    assert abs(mean_ratio(behaviour, rescored) - 1.0) < RATIO_TOLERANCE


@needs_vllm
@pytest.mark.vllm
def test_agent_conversations_through_vllm_mask_the_tool_answers_and_rescore_to_the_trainers(
    agent_setup: AgentSetup,
) -> None:
    """tests/unit/worker/test_agent.py's check of whole conversations, with vLLM sampling the model's turns."""
    from asyncgrpo.run.datasets import hidden_digit_prompts
    from tests.support.toy_conversations import check_toy_conversation
    from worker.generate.agent import AgentRun, converse
    from worker.generate.backend import chat_messages

    config, backend = agent_setup.config, agent_setup.backend
    assert config.agent is not None
    tokenizer = backend.tokenizer
    records = hidden_digit_prompts(AGENT_PROMPTS, seed=1)
    agent = AgentRun.start(config.agent, tokenizer)
    try:
        groups, scores, _ = converse(
            backend,
            agent,
            records,
            [chat_messages(record, config.dataset) for record in records],
            adapter=None,
            samples_per_prompt=AGENT_SAMPLES,
            max_completion_length=AGENT_BUDGET,
            temperature=TEMPERATURE,
            top_p=1.0,
            seed=5,
            task_id="vllm-agent",
        )
    finally:
        agent.close()
    assert all(group.failure is None for group in groups)
    called = 0
    samples = []
    for record, group, rewards in zip(records, groups, scores["HiddenDigit"], strict=True):
        assert len(group.completions) == AGENT_SAMPLES
        for completion, reward in zip(group.completions, rewards, strict=True):
            assert len(completion.token_ids) <= AGENT_BUDGET
            samples.append(check_toy_conversation(tokenizer, record["answer"], completion, reward, 2))
            called += completion.tool_calls > 0
    total = AGENT_PROMPTS * AGENT_SAMPLES
    assert called >= 4, f"only {called} of {total} random conversations called reveal(); the check needs some"
    gaps = model_token_gaps(agent_setup.trainer, samples)
    print(
        f"\nvLLM agent conversations: {called} of {total} called reveal(); largest |vLLM - trainer| logprob gap "
        f"{max(gaps):.2e}, mean {sum(gaps) / len(gaps):.2e} over {len(gaps)} model tokens"
    )
    assert sum(gaps) / len(gaps) < 1e-4
    assert max(gaps) < 1e-3


# --- a whole run with a vLLM generate worker -----------------------------------------------------------------

E2E_STEPS = 60
E2E_CONFIG_TOML = """\
seed = 1

[model]
base = "tiny"

[dataset]
generator = "repeat_digit"
num_prompts = 256

[[rewards]]
name = "repeat_digit"

[sampling]
samples_per_prompt = 8
max_completion_length = 8
backend = "vllm"

[optimizer]
learning_rate = 0.005
total_steps = 10000

[async]
max_staleness = 2
groups_per_task = 4
groups_per_step = 8
queue_maxsize = 16
generate_task_timeout_s = 300
"""
CHANCE = 1 / 14  # one character of the tiny model's 14-token vocabulary


def run_locally(workdir: Path, backend: str) -> tuple[list[dict[str, Any]], str]:
    """Run E2E_STEPS steps with one generate worker on ``backend`` and one optimize worker, as real processes
    on this interpreter; returns the step records and the generate worker's log."""
    import time

    from asyncgrpo.run.creation import create_run
    from cli.history import load_step_records
    from cli.local_cluster import LocalCluster

    threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "ASYNCGRPO_HEARTBEAT_S": "0.5"}
    cluster = LocalCluster(workdir=workdir, run=f"e2e-{backend}", extra_env=threads)
    try:
        config_path = workdir / "run.toml"
        config_path.write_text(E2E_CONFIG_TOML)
        create_run(config_path, cluster.run, open_env_bucket(cluster.bucket_url))
        cluster.ensure_redis()
        cluster.start_proxy()
        cluster.start_worker("optimize", name="opt-1")
        cluster.start_worker("generate", name="gen-1", env={"ASYNCGRPO_GENERATION_BACKEND": backend})
        bucket = open_env_bucket(cluster.bucket_url)
        deadline = time.monotonic() + 400
        records: list[StepRecord] = []
        while len(records) < E2E_STEPS:
            cluster.check_children()
            assert time.monotonic() < deadline, f"{backend}: only {len(records)} steps in 400 s: {cluster.status()}"
            time.sleep(1.0)
            records = load_step_records(bucket, cluster.run)
        return records[:E2E_STEPS], (workdir / "logs" / "gen-1.log").read_text(errors="replace")
    finally:
        cluster.stop()


def reward_per_10_steps(records: list[StepRecord]) -> list[float]:
    rewards = [r.reward_mean or 0.0 for r in records]
    return [round(sum(rewards[i : i + 10]) / len(rewards[i : i + 10]), 3) for i in range(0, len(rewards), 10)]


@needs_vllm
@pytest.mark.vllm
@pytest.mark.slow
def test_run_with_a_vllm_generate_worker_learns_like_one_with_transformers(tmp_path: Path) -> None:
    """The same short run twice: a vLLM generate worker, then a transformers one; the usual optimize worker."""
    vllm_records, vllm_log = run_locally(tmp_path / "vllm", "vllm")
    transformers_records, _ = run_locally(tmp_path / "transformers", "transformers")
    assert "generation.vllm_ready" in vllm_log, "the generate worker did not run the vLLM backend"

    vllm_curve, transformers_curve = reward_per_10_steps(vllm_records), reward_per_10_steps(transformers_records)
    ratios = [r.rescore_ratio for r in vllm_records]
    # The generator-trainer correction is on by default for vLLM's rollouts, off for the transformers backend's.
    weights = [r.importance_sampling_ratio for r in vllm_records]
    assert all(figures is not None for figures in weights), "a vLLM step reported no correction weights"
    assert all(r.importance_sampling_ratio is None for r in transformers_records)
    low, high = min(f.min for f in weights if f), max(f.max for f in weights if f)
    gap = max(f.logp_difference_max for f in weights if f)
    print(
        f"\nreward per 10 steps: vLLM {vllm_curve}, transformers {transformers_curve}; "
        f"vLLM rescore ratio in [{min(ratios):.7f}, {max(ratios):.7f}]; correction weights in "
        f"[{low:.7f}, {high:.7f}], largest |trainer - vLLM| logprob gap {gap:.2e}"
    )
    # On CPU both compute in float32: the weights are 1 up to the same tolerance as the rescoring ratio.
    assert all(abs(f.mean - 1.0) < RATIO_TOLERANCE for f in weights if f), weights
    # The trainer rescored every vLLM rollout under the version it claims: the served policy is the trained one.
    assert all(abs(ratio - 1.0) < RATIO_TOLERANCE for ratio in ratios), ratios
    assert not any(r.flagged_rollouts for r in vllm_records)
    assert all(r.max_staleness <= 2 for r in vllm_records)
    # The bar of the transformers backend's learning test (tests/unit/worker/test_learning.py), and close to its
    # run here.
    first, last = vllm_curve[0], vllm_curve[-1]
    assert last >= 2 * first, f"vLLM run: mean reward went from {first:.3f} to only {last:.3f}"
    assert last >= 4 * CHANCE, f"vLLM run: mean reward {last:.3f} of the last 10 steps is not well above chance"
    assert last >= transformers_curve[-1] - 0.15, f"vLLM run reached {last:.3f}, transformers {transformers_curve}"
