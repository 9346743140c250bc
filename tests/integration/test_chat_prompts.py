"""Chat templates end to end: a ``save_to_disk`` dataset goes through ``run create``, a real generate task on the
tiny model templates its prompts, and the rollout records the templated text and exactly its tokens; a
template that writes its own BOS is not given a second one; a model without a template is refused by name."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, open_bucket
from asyncgrpo.bucket.layout import write_version
from asyncgrpo.protocol.schemas import (
    GroupRef,
    LeaseGrant,
    LeaseRequest,
    ReleaseResult,
    RolloutSubmission,
    SubmitResult,
)
from asyncgrpo.run.config import DatasetConfig, RunConfig
from asyncgrpo.run.creation import create_run, load_run
from worker.algo.rollout import decode_rollout, read_rollout_header
from worker.generate.adapter_cache import AdapterCache
from worker.generate.backend import ChatTemplateMissing, chat_messages, fed_prompt_text
from worker.generate.job import GenerateTask
from worker.generate.task_context import TaskContext
from worker.generate.transformers_backend import TransformersBackend
from worker.model.policy import Policy
from worker.model.tiny_model import TINY_CHAT_TEMPLATE, train_tiny_tokenizer
from worker.optimize.trainer import Trainer

datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

RUN = "chat"
TASK = "gen-chat-0-00000001"
RUN_TOML = """\
[model]
max_prompt_length = 128
[dataset]
hub_id = "chat-data"
{dataset}
[[rewards]]
name = "repeat_digit"
[sampling]
samples_per_prompt = 2
max_completion_length = 3
"""
CHATS = [
    [{"role": "user", "content": "3="}, {"role": "assistant", "content": "333"}],
    [{"role": "system", "content": "Digits."}, {"role": "user", "content": "7="}],
]
PLAIN = 'prompt_column = "question"\nanswer_column = "digit"\nchat_template = true\nsystem_prompt = "Repeat."'
MESSAGES = 'messages_column = "chat"\nanswer_column = "digit"\nsystem_prompt = "Repeat."'


@dataclass
class LeasingProxy:
    """Stands in for ProxyClient: grants leases on version 0 and admits every submission."""

    manifest_sha256: str
    submissions: list[RolloutSubmission] = field(default_factory=list)

    def lease(self, request: LeaseRequest) -> LeaseGrant:
        return LeaseGrant(
            lease_id="lease-1",
            version=0,
            adapter_prefix=bucket_keys.adapter_prefix(RUN, 0),
            manifest_key=bucket_keys.manifest_key(RUN, 0),
            manifest_sha256=self.manifest_sha256,
            ttl_s=60.0,
            expires_at=0.0,
        )

    def renew(self, lease_id: str) -> LeaseGrant:
        raise AssertionError(f"a 60 s lease ({lease_id}) needs no renewal in this test")

    def release(self, lease_id: str) -> ReleaseResult:
        return ReleaseResult(released=True)

    def submit_rollout(self, submission: RolloutSubmission) -> SubmitResult:
        self.submissions.append(submission)
        return SubmitResult(status="admitted")


def _create_chat_run(tmp_path: Path, dataset_toml: str) -> tuple[Bucket, RunConfig, list[dict[str, Any]]]:
    """``run create`` of a save_to_disk DatasetDict (train + test), offline."""
    table = {"question": ["3=", "7="], "chat": CHATS, "digit": ["3", "7"]}
    splits = {"train": datasets.Dataset.from_dict(table), "test": datasets.Dataset.from_dict(table).select([0])}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "chat-data"))
    (tmp_path / "run.toml").write_text(RUN_TOML.format(dataset=dataset_toml))
    bucket = open_bucket(f"file://{tmp_path / 'bucket'}")
    create_run(tmp_path / "run.toml", RUN, bucket)
    config, prompts, _ = load_run(bucket, RUN)
    return bucket, config, prompts


def _generate(bucket: Bucket, config: RunConfig, prompts: list, backend: TransformersBackend, cache: Path) -> bytes:
    trainer = Trainer.initial(Policy.load(backend.policy.base), config)  # its own copy: LoRA wraps the model
    _, manifest_sha = write_version(bucket, RUN, 0, trainer.version_files(0), {"step": 0, "base_version": -1})
    proxy = LeasingProxy(manifest_sha256=manifest_sha)
    context = TaskContext(
        run=RUN,
        config=config,
        prompts=prompts,
        bucket=bucket,
        client=proxy,
        backend=backend,
        adapter_cache=AdapterCache(bucket, RUN, cache, capacity=2),
        worker_id="gen-1",
    )
    result = GenerateTask(context, TASK, [GroupRef(group_id=f"{TASK}.{i}", prompt_index=i) for i in (1, 0)]).run()
    assert result.status == "admitted" and result.groups == 2, result.summary()
    return bucket.get(proxy.submissions[0].key)


@pytest.mark.parametrize("dataset_toml", [PLAIN, MESSAGES], ids=["chat_template", "messages_column"])
def test_run_create_then_rollouts_record_the_templated_prompts(
    tmp_path: Path, tiny_model_dir: Path, dataset_toml: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    bucket, config, prompts = _create_chat_run(tmp_path, dataset_toml)
    backend = TransformersBackend(str(tiny_model_dir))
    data = _generate(bucket, config, prompts, backend, tmp_path / "cache")

    header = read_rollout_header(data)
    system = "Digits." if dataset_toml == MESSAGES else "Repeat."  # a chat's own system message wins
    assert header.extra.prompts == [  # group order: prompt 1, then prompt 0
        f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n7=<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>system\nRepeat.<|im_end|>\n<|im_start|>user\n3=<|im_end|>\n<|im_start|>assistant\n",
    ]
    # the reference reply of a messages dataset never reaches the model
    assert all("333" not in text for text in header.extra.prompts)
    rollout = decode_rollout(data)
    for sample in rollout.samples:
        text = header.extra.prompts[sample.group_index]
        assert sample.prompt_token_ids == backend.tokenize([text], add_special_tokens=False)[0]


def _bos_tokenizer() -> Any:
    """The tiny alphabet with a tokenizer that adds a BOS (``<pad>`` plays it) and a template that writes one,
    as Llama's do; characters outside the alphabet (the markers) are ``<unk>``, so the markers show in ids."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = train_tiny_tokenizer()
    tokenizer.bos_token = "<pad>"
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<pad> $A", special_tokens=[("<pad>", tokenizer.pad_token_id)]
    )
    tokenizer.chat_template = "{{ bos_token }}" + TINY_CHAT_TEMPLATE
    return tokenizer


def test_a_template_that_writes_its_bos_gets_no_second_one(tmp_path: Path, tiny_model_dir: Path) -> None:
    bucket, config, prompts = _create_chat_run(tmp_path, PLAIN)
    policy = Policy.load(str(tiny_model_dir))
    policy.tokenizer = _bos_tokenizer()
    bos = policy.tokenizer.pad_token_id
    assert policy.tokenizer("7=")["input_ids"][0] == bos  # this tokenizer adds a BOS to plain text
    backend = TransformersBackend(str(tiny_model_dir), policy=policy)
    data = _generate(bucket, config, prompts, backend, tmp_path / "cache")

    header, rollout = read_rollout_header(data), decode_rollout(data)
    assert all(text.startswith("<pad><|im_start|>system\nRepeat.") for text in header.extra.prompts)
    unk = policy.tokenizer.unk_token_id
    for sample in rollout.samples:
        ids = sample.prompt_token_ids
        assert ids[0] == bos and ids[1] == unk and ids.count(bos) == 1, ids  # one BOS, then the markers
        assert ids == policy.tokenizer(header.extra.prompts[sample.group_index], add_special_tokens=False)["input_ids"]


def test_prompt_text_without_and_with_a_template(tiny_model_dir: Path) -> None:
    tokenizer = train_tiny_tokenizer()
    record = {"prompt": "3=", "answer": "3"}
    assert fed_prompt_text(record, DatasetConfig(), tokenizer) == "3="
    chat = DatasetConfig(chat_template=True)
    assert fed_prompt_text(record, chat, tokenizer) == "<|im_start|>user\n3=<|im_end|>\n<|im_start|>assistant\n"
    with_system = DatasetConfig(chat_template=True, system_prompt="Be brief.")
    assert chat_messages(record, with_system) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "3="},
    ]
    tokenizer.chat_template = None
    with pytest.raises(ChatTemplateMissing, match=r"dataset\.chat_template = false"):
        fed_prompt_text(record, chat, tokenizer)
    assert fed_prompt_text(record, DatasetConfig(), tokenizer) == "3="  # no template needed without one
