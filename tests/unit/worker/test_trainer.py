"""The trainer (worker/optimize/trainer.py): rescoring, one optimizer update, packing, LR schedule, version files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load as load_tensors

from asyncgrpo.bucket.layout import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    TRAINER_STATE_JSON_NAME,
    TRAINER_STATE_TENSORS_NAME,
)
from asyncgrpo.run.config import LoraConfig, LossConfig, OptimizerConfig, RunConfig
from tests.support.train_samples import capture_gradients, synthetic_samples
from worker.algo.grpo import NonFiniteError, policy_loss
from worker.generate.transformers_backend import TransformersBackend
from worker.model.policy import TRAIN_ADAPTER, Policy
from worker.optimize.batch import TrainSample, pack_micro_batches
from worker.optimize.trainer import Trainer, learning_rate_at, loss_options, mean_ratio
from worker.optimize.trainer_state import TrainerStateError, adapter_files, write_adapter_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_config(**sections: dict) -> RunConfig:
    return RunConfig.model_validate(sections)


def make_trainer(base: Path, config: RunConfig | None = None) -> Trainer:
    return Trainer.initial(Policy.load(str(base)), config or make_config())


def lora_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in zip(trainer.param_names, trainer.lora_parameters, strict=True)}


def test_rescoring_matches_the_generator(tiny_model_dir: Path, tmp_path: Path) -> None:
    """With unchanged weights, the trainer's logprobs are the generator's: mean ratio 1 within 1e-4."""
    config = make_config(sampling={"temperature": 0.8})
    trainer = make_trainer(tiny_model_dir, config)
    trainer.step(synthetic_samples(trainer, 16, seed=0))  # move off the no-op LoRA init
    adapter_dir = write_adapter_folder(trainer.version_files(1), tmp_path / "v1")

    backend = TransformersBackend(str(tiny_model_dir))
    backend.load_adapter("v1", 1, adapter_dir)
    result = backend.generate(
        ["7=", "3=", "45=", "0="],
        adapter="v1",
        samples_per_prompt=8,
        max_completion_length=16,
        temperature=0.8,
        top_p=1.0,
        seed=5,
    )
    samples = [
        TrainSample(r.prompt_token_ids, c.token_ids, c.logprobs, 0.0) for r in result.results for c in r.completions
    ]
    rescored = trainer.rescore(samples)
    behavior = [s.behavior_logprobs for s in samples]
    assert abs(mean_ratio(behavior, rescored) - 1.0) < 1e-4
    worst = max(abs(a - b) for old, new in zip(behavior, rescored, strict=True) for a, b in zip(old, new, strict=True))
    assert worst < 1e-4
    # A different policy does not pass: the check can fail.
    trainer.step(synthetic_samples(trainer, 16, seed=1))
    assert abs(mean_ratio(behavior, trainer.rescore(samples)) - 1.0) > 1e-3


def test_step_updates_only_lora_and_reports_metrics(tiny_model_dir: Path) -> None:
    trainer = make_trainer(tiny_model_dir)
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    lora_before = lora_state(trainer)
    samples = synthetic_samples(trainer, 12, seed=2)
    metrics = trainer.step(samples)

    assert all(torch.equal(p, base_before[n]) for n, p in trainer.model.named_parameters() if not p.requires_grad)
    changed = [n for n, p in lora_state(trainer).items() if not torch.equal(p, lora_before[n])]
    assert any("lora_B" in name for name in changed)
    assert metrics.update == 0 and trainer.updates == 1 and trainer.version is None
    assert metrics.tokens == sum(len(s.completion_token_ids) for s in samples)
    assert metrics.sequences == 12 and metrics.micro_batches == 1
    assert metrics.ratio == pytest.approx(1.0, abs=1e-5) and metrics.kl == pytest.approx(0.0, abs=1e-5)
    assert metrics.lr == pytest.approx(trainer.optimizer_cfg.learning_rate)
    assert 0.0 < metrics.entropy <= math.log(len(trainer.policy.tokenizer)) + 1e-6
    assert metrics.grad_norm > 0 and metrics.forward_backward_s > 0 and metrics.optimizer_s > 0
    assert metrics.kl_ref is None
    # The same figures the step record stores per update.
    assert set(metrics.model_dump()) >= {"loss", "ratio", "kl", "clip_low", "clip_high", "clip_region", "grad_norm"}


def test_micro_batches_give_the_same_update_as_one_batch(tiny_model_dir: Path) -> None:
    whole = make_trainer(tiny_model_dir)
    split = make_trainer(tiny_model_dir, make_config(optimizer={"micro_batch_tokens": 16}))
    samples = synthetic_samples(whole, 10, seed=3)
    gradients_whole, gradients_split = capture_gradients(whole), capture_gradients(split)
    metrics_whole, metrics_split = whole.step(samples), split.step(samples)
    assert metrics_whole.micro_batches == 1 and metrics_split.micro_batches > 3
    assert metrics_split.loss == pytest.approx(metrics_whole.loss, rel=1e-5)
    assert metrics_split.grad_norm == pytest.approx(metrics_whole.grad_norm, rel=1e-5)
    assert gradients_whole.keys() == gradients_split.keys() == set(whole.param_names)
    scale = max(float(g.abs().max()) for g in gradients_whole.values())
    for name, gradient in gradients_whole.items():
        # float32 summation order differs between the layouts: compare against the largest gradient entry.
        torch.testing.assert_close(gradients_split[name], gradient, rtol=1e-4, atol=1e-5 * scale)


def test_completions_left_out_of_the_loss_train_like_a_batch_without_them(tiny_model_dir: Path) -> None:
    # loss.mask_truncated_completions marks truncated rows untrained: with dapo (token sum / tokens), the
    # update equals one over the other rows alone; micro-batches of 16 tokens mix both kinds of rows.
    config = make_config(optimizer={"micro_batch_tokens": 16, "max_grad_norm": 1e6})
    masked, subset = make_trainer(tiny_model_dir, config), make_trainer(tiny_model_dir, config)
    samples = synthetic_samples(masked, 12, seed=8)
    for index, sample in enumerate(samples):
        sample.trained = index % 3 != 0
    gradients_masked, gradients_subset = capture_gradients(masked), capture_gradients(subset)
    metrics = masked.step(samples)
    subset.step([sample for sample in samples if sample.trained])
    assert metrics.tokens == sum(len(s.completion_token_ids) for s in samples if s.trained)
    scale = max(float(g.abs().max()) for g in gradients_subset.values())
    assert scale > 0
    for name, gradient in gradients_subset.items():
        torch.testing.assert_close(gradients_masked[name], gradient, rtol=1e-4, atol=1e-5 * scale)


def test_non_finite_step_applies_no_update(tiny_model_dir: Path) -> None:
    trainer = make_trainer(tiny_model_dir)
    trainer.version_files(0)
    samples = synthetic_samples(trainer, 6, seed=4)
    samples[2].behavior_logprobs[0] = float("nan")
    before = lora_state(trainer)
    with pytest.raises(NonFiniteError, match="behavior_logprobs"):
        trainer.step(samples)
    assert all(torch.equal(before[n], p) for n, p in lora_state(trainer).items())
    assert trainer.updates == 0 and trainer.version == 0
    assert all(p.grad is None for p in trainer.lora_parameters)


def test_kl_to_the_base_model(tiny_model_dir: Path) -> None:
    trainer = make_trainer(tiny_model_dir, make_config(loss={"beta": 0.5}))
    samples = synthetic_samples(trainer, 8, seed=5)
    first = trainer.step(samples)
    assert first.kl_ref == pytest.approx(0.0, abs=1e-7)  # the LoRA init is the base model
    second = trainer.step(samples)
    assert second.kl_ref is not None and second.kl_ref > 0.0


def test_version_files_are_plain_peft_and_safetensors(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = make_trainer(tiny_model_dir)
    trainer.step(synthetic_samples(trainer, 8, seed=6))
    files = trainer.version_files(1, extra={"step": 1})
    assert set(files) == {
        ADAPTER_WEIGHTS_NAME,
        ADAPTER_CONFIG_NAME,
        TRAINER_STATE_TENSORS_NAME,
        TRAINER_STATE_JSON_NAME,
    }
    assert trainer.version == 1
    for name in (ADAPTER_WEIGHTS_NAME, TRAINER_STATE_TENSORS_NAME):
        header_length = int.from_bytes(files[name][:8], "little")  # safetensors: u64 length, JSON header
        assert json.loads(files[name][8 : 8 + header_length])
        assert load_tensors(files[name])
    meta = json.loads(files[TRAINER_STATE_JSON_NAME])
    assert meta["version"] == 1 and meta["updates"] == 1 and meta["extra"] == {"step": 1}
    adapter_config = json.loads(files[ADAPTER_CONFIG_NAME])
    assert adapter_config["peft_type"] == "LORA" and adapter_config["r"] == 8 and not adapter_config["use_dora"]
    assert adapter_config["target_modules"] == sorted(adapter_config["target_modules"])

    folder = write_adapter_folder(files, tmp_path / "v1")
    loaded = PeftModel.from_pretrained(Policy.load(str(tiny_model_dir)).model, str(folder)).eval()
    ids = torch.tensor([[3, 5, 11, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, trainer.model(input_ids=ids).logits)


def test_loading_files_of_another_lora_shape_is_refused(tiny_model_dir: Path) -> None:
    files = make_trainer(tiny_model_dir).version_files(0)
    other = make_trainer(tiny_model_dir, make_config(lora={"rank": 4}))
    with pytest.raises(TrainerStateError, match="r=8 but this trainer has r=4"):
        other.load_version_files(files)
    with pytest.raises(TrainerStateError, match="lack"):
        other.load_version_files({ADAPTER_CONFIG_NAME: files[ADAPTER_CONFIG_NAME]})


def test_pack_micro_batches() -> None:
    lengths = [5, 12, 3, 40, 8, 8, 1, 7]
    plan = pack_micro_batches(lengths, token_budget=24)
    assert sorted(index for batch in plan for index in batch) == list(range(len(lengths)))
    for batch in plan:
        padded = len(batch) * max(lengths[i] for i in batch)
        assert padded <= 24 or len(batch) == 1  # only an over-long sample exceeds the budget, alone
    assert [3] in plan
    assert pack_micro_batches(lengths, token_budget=24) == plan
    assert pack_micro_batches(lengths, token_budget=1000) == [sorted(range(8), key=lambda i: -lengths[i])]


def test_learning_rate_schedule() -> None:
    constant = OptimizerConfig(learning_rate=1.0, warmup_steps=4, total_steps=14)
    assert [learning_rate_at(i, constant) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    linear = OptimizerConfig(learning_rate=1.0, warmup_steps=4, total_steps=14, lr_schedule="linear")
    assert learning_rate_at(4, linear) == 1.0
    assert learning_rate_at(9, linear) == pytest.approx(0.5)
    assert learning_rate_at(14, linear) == 0.0 and learning_rate_at(99, linear) == 0.0
    cosine = OptimizerConfig(learning_rate=0.5, total_steps=10, lr_schedule="cosine")
    assert learning_rate_at(0, cosine) == 0.5
    assert learning_rate_at(5, cosine) == pytest.approx(0.25)
    assert learning_rate_at(10, cosine) == pytest.approx(0.0)


def test_trainer_takes_the_config_sections(tiny_model_dir: Path) -> None:
    trainer = Trainer(
        Policy.load(str(tiny_model_dir)),
        LoraConfig(rank=2, alpha=4.0, target_modules=["q_proj", "v_proj"]),
        OptimizerConfig(learning_rate=1e-3),
        LossConfig(loss_type="grpo"),
        max_completion_length=8,
        temperature=1.0,
        seed=0,
    )
    assert all(("q_proj" in n or "v_proj" in n) for n in trainer.param_names)
    assert trainer.step(synthetic_samples(trainer, 4, seed=7)).lr == pytest.approx(1e-3)


def test_later_versions_serialise_exactly_what_save_pretrained_writes(tiny_model_dir: Path) -> None:
    # From the second version on, the adapter is serialised in memory (no save_pretrained, no model card).
    trainer = make_trainer(tiny_model_dir)
    first = trainer.version_files(0)
    trainer.step(synthetic_samples(trainer, 8, seed=3))
    second = trainer.version_files(1)
    through_peft = adapter_files(trainer.model, base=trainer.policy.base, adapter_name=TRAIN_ADAPTER)
    assert second[ADAPTER_WEIGHTS_NAME] == through_peft[ADAPTER_WEIGHTS_NAME]
    assert second[ADAPTER_CONFIG_NAME] == through_peft[ADAPTER_CONFIG_NAME] == first[ADAPTER_CONFIG_NAME]
    assert second[ADAPTER_WEIGHTS_NAME] != first[ADAPTER_WEIGHTS_NAME], "the step changed the weights"


# Each edge of a [loss] bound the run config accepts (worker.algo.grpo checks its own at every call): a run
# that `run create` accepted must never fail its first step on an option.
LOSS_EDGES = [
    {"epsilon_low": 1.0, "epsilon_high": 0.0},
    {"loss_type": "cispo", "epsilon_high": 1e-6},
    {"loss_type": "vespo", "vespo_lambda_pos": 1e-6, "vespo_lambda_neg": 1e-6, "vespo_k_pos": 0.0,
     "vllm_importance_sampling_mode": "token_mask"},
    {"loss_type": "sapo", "sapo_temperature_pos": 1e-6, "sapo_temperature_neg": 100.0},
    {"delta": 1.0 + 1e-6, "off_policy_mask_threshold": 0.0, "top_entropy_quantile": 1e-6},
    {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_min": 0.0,
     "vllm_importance_sampling_clip_max": 1e-6},
    {"vllm_importance_sampling_mode": "sequence_truncate", "vllm_importance_sampling_clip_min": 0.0,
     "vllm_importance_sampling_clip_max": None},
    {"vllm_importance_sampling_clip_max": None, "beta": 100.0, "use_bias_correction_kl": False},
    {"loss_type": "luspo", "decoupled": True, "behavior_weight_cap": 1.0 + 1e-6,
     "importance_sampling_level": "sequence"},
    {"decoupled": True, "behavior_weight_cap": 100.0, "delta": 100.0},
]  # fmt: skip


@pytest.mark.parametrize("edge", LOSS_EDGES, ids=lambda edge: ",".join(edge))
def test_a_loss_table_the_config_accepts_the_loss_accepts(edge: dict[str, object]) -> None:
    config = LossConfig(**edge)
    options = loss_options(config)
    torch.manual_seed(0)
    logprobs = -torch.rand(3, 4, requires_grad=True)
    ones = torch.ones(3, 4, dtype=torch.bool)
    proximal = logprobs.detach() if config.decoupled else None  # as the trainer passes it
    loss, _ = policy_loss(
        logprobs, -torch.rand(3, 4), torch.randn(3), ones, **options, ref_logprobs=-torch.rand(3, 4),
        entropy=torch.rand(3, 4), sampling_logprobs=-torch.rand(3, 4), vllm_importance_sampling_correction=True,
        proximal_logprobs=proximal,
    )  # fmt: skip
    assert torch.isfinite(loss)


@pytest.mark.parametrize(
    ("edge", "names"),
    [
        ({"epsilon_low": 1.5}, "epsilon_low"),
        ({"vespo_lambda_pos": 0.0}, "vespo_lambda_pos"),
        ({"vllm_importance_sampling_clip_min": 3.0}, "clip_min"),
        ({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": None}, "clip_max"),
        ({"loss_type": "cispo", "epsilon_high": 0.0}, "epsilon_high"),
    ],
)
def test_a_loss_table_the_loss_would_refuse_is_refused_by_the_config(edge: dict[str, object], names: str) -> None:
    with pytest.raises(ValueError, match=names):
        LossConfig(**edge)
