"""How far a sampler's logprobs drift from the trainer's, per dtype and device: the case for the
generator-trainer correction (``loss.vllm_importance_sampling_correction``).

A random-init Qwen2 of a chosen size samples completions token by token against its KV cache (the
transformers backend's loop, ``sample_completions``); the trainer then scores the same tokens in one
padding-free forward, with the same weights. In float32 the two agree to rounding; in bfloat16 the kernels
of the two paths round differently, as vLLM's do against a trainer's. Printed per dtype: the per-token gap
|trainer - sampler| (mean, p99, max), the sequence weights exp(sum of gaps) the default mode
(``sequence_mask``, at most 3) forms and the share it drops, the token weights' range, and the time of one
``Trainer.step`` on those samples with and without the correction (interleaved repetitions).

    python3 benchmarks/bench_correction.py [--device cuda] [--hidden 1024 --layers 8 --vocab 32000]

A random-init model's next-token distributions are nearly flat, so the gaps of a trained model (peaked
distributions, long completions) differ: read the figures as the order of magnitude of the effect.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from asyncgrpo.run.config import RunConfig
from worker.generate.transformers_backend import sample_completions
from worker.model.policy import Policy
from worker.model.tiny_model import train_tiny_tokenizer
from worker.optimize.batch import TrainSample
from worker.optimize.trainer import Trainer


def _build(out: Path, hidden: int, layers: int, vocab: int) -> Path:
    tokenizer = train_tiny_tokenizer()
    heads = max(hidden // 64, 1)
    config = Qwen2Config(
        vocab_size=max(vocab, len(tokenizer)),
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 4, 1),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def measure(base: Path, dtype: str, device: str, args: argparse.Namespace) -> dict[str, float | str]:
    config = RunConfig.model_validate(
        {
            "model": {"dtype": dtype},
            "sampling": {"samples_per_prompt": args.group, "max_completion_length": args.tokens},
            "optimizer": {"micro_batch_tokens": 1 << 20},
        }
    )
    policy = Policy.load(str(base), dtype=dtype, device=device)
    trainer = Trainer.initial(policy, config)
    prompts = [[1 + (i % 10), 11] for i in range(args.prompts)]
    rows = [prompt for prompt in prompts for _ in range(args.group)]
    with torch.no_grad():
        tokens, sampled = sample_completions(
            trainer.model,
            rows,
            max_completion_length=args.tokens,
            temperature=1.0,
            top_p=1.0,
            seed=1,
            eos_token_id=-1,
            pad_token_id=policy.pad_token_id,
            device=policy.device,
        )
    advantages = [float((i % args.group) - (args.group - 1) / 2) for i in range(len(rows))]
    samples = [TrainSample(rows[i], tokens[i], sampled[i], advantages[i]) for i in range(len(rows))]
    scored = trainer.rescore(samples)
    pairs = list(zip(scored, sampled, strict=True))
    gaps = [t - s for trained, sampler in pairs for t, s in zip(trained, sampler, strict=True)]
    sequence_weights = [
        math.exp(sum(t - s for t, s in zip(trained, sampler, strict=True)))
        for trained, sampler in zip(scored, sampled, strict=True)
    ]
    clip = config.loss.vllm_importance_sampling_clip_max or math.inf
    corrected = [
        TrainSample(s.prompt_token_ids, s.completion_token_ids, s.behavior_logprobs, s.advantage, corrected=True)
        for s in samples
    ]
    times: dict[str, list[float]] = {"step": [], "step_corrected": []}
    for rep in range(args.reps + 1):
        for name, batch in (("step", samples), ("step_corrected", corrected)):
            if policy.device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            trainer.step(batch)
            if policy.device.type == "cuda":
                torch.cuda.synchronize()
            if rep:  # the first round warms up
                times[name].append(time.perf_counter() - started)
    absolute = [abs(gap) for gap in gaps]
    return {
        "dtype": dtype,
        "device": str(policy.device),
        "gap_mean": statistics.fmean(absolute),
        "gap_p99": _quantile(absolute, 0.99),
        "gap_max": max(absolute),
        "token_weight_min": math.exp(min(gaps)),
        "token_weight_max": math.exp(max(gaps)),
        "sequence_weight_min": min(sequence_weights),
        "sequence_weight_median": statistics.median(sequence_weights),
        "sequence_weight_max": max(sequence_weights),
        "sequences_dropped": sum(w > clip for w in sequence_weights) / len(sequence_weights),
        "step_s": statistics.median(times["step"]),
        "step_corrected_s": statistics.median(times["step_corrected"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens per sequence")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-correction-") as tmp:
        base = _build(Path(tmp) / "model", args.hidden, args.layers, args.vocab)
        results = [measure(base, dtype, args.device, args) for dtype in args.dtypes.split(",")]
    print(
        f"random-init Qwen2 hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}; "
        f"{args.prompts} prompts x G={args.group}, {args.tokens} tokens each"
    )
    for result in results:
        print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
