"""What agent rollouts cost beyond sampling: the tool process's round trip, and a task of conversations against
the same prompts sampled single-turn.

* ``tool_call_ms``: one ``ToolProcess.call`` of a trivial tool (the toy environment's ``reveal``), p50 and p99
  over ``--calls`` calls: the pipe, JSON and the child's dispatch.
* ``converse`` vs ``generate``: ``--prompts`` x ``--group`` conversations of the toy agent task
  (``worker.generate.agent.converse``, the transformers backend) against one ``generate`` of the same templated
  prompts with the same budget, interleaved ``--repeats`` times. Printed: wall seconds (median), the model's
  tokens per second, the share of the conversation time spent outside sampling (tool and environment calls,
  templating prompts and tool answers, parsing calls), turns and calls per
  conversation. The random-init model calls the tool in about one conversation in seven, so most
  conversations are one turn: the ratio shows the loop's own cost (turn batches, templating, masks).

    python3 benchmarks/bench_agent.py [--device cuda] [--hidden 1024 --layers 8] [--prompts 16 --group 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from asyncgrpo.run.agent_config import AgentConfig
from asyncgrpo.run.config import DatasetConfig
from asyncgrpo.run.datasets import hidden_digit_prompts
from worker.generate.agent import AgentRun, converse
from worker.generate.backend import chat_messages, fed_prompts
from worker.generate.tool_process import ToolProcess
from worker.generate.transformers_backend import TransformersBackend
from worker.model.tiny_model import train_tiny_agent_tokenizer

ENVIRONMENT = "worker.generate.toy_agent:HiddenDigit"


def _build(out: Path, hidden: int, layers: int) -> Path:
    tokenizer = train_tiny_agent_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 128, 1),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
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


def _tool_call_ms(calls: int) -> dict[str, float]:
    with ToolProcess([], {None: ENVIRONMENT}, timeout_s=30) as tools:
        tools.describe()
        tools.start("bench", None, "?=", "7")
        times = []
        for _ in range(calls):
            started = time.perf_counter()
            tools.call("bench", "reveal", {})
            times.append((time.perf_counter() - started) * 1000)
        tools.end("bench")
    times.sort()
    return {"p50": round(times[len(times) // 2], 3), "p99": round(times[int(len(times) * 0.99)], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32, help="the conversation's budget (max_completion_length)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()

    figures: dict[str, object] = {"tool_call_ms": _tool_call_ms(args.calls)}
    with tempfile.TemporaryDirectory() as folder:
        backend = TransformersBackend(str(_build(Path(folder), args.hidden, args.layers)), device=args.device)
        agent = AgentRun.start(AgentConfig(environment=ENVIRONMENT, max_tool_calling_iterations=2), backend.tokenizer)
        dataset = DatasetConfig(generator="hidden_digit", chat_template=True)
        records = hidden_digit_prompts(args.prompts, seed=0)
        chats = [chat_messages(record, dataset) for record in records]
        fed = fed_prompts(records, range(len(records)), dataset, backend.tokenizer, lambda _: agent.schemas_for(None))
        options = {"temperature": 1.0, "top_p": 1.0}
        runs: dict[str, list[float]] = {"converse": [], "generate": []}
        tokens: dict[str, int] = {}
        tool_share, turns, calls = [], [], []
        for repeat in range(args.repeats + 1):  # the first round warms up both paths
            started = time.perf_counter()
            groups, _, tools_s = converse(
                backend,
                agent,
                records,
                chats,
                adapter=None,
                samples_per_prompt=args.group,
                max_completion_length=args.tokens,
                seed=repeat,
                task_id=f"bench-{repeat}",
                **options,
            )
            elapsed = time.perf_counter() - started
            conversations = [c for group in groups for c in group.completions]
            if repeat:
                runs["converse"].append(elapsed)
                tool_share.append(tools_s / elapsed)
                turns += [c.turns for c in conversations]
                calls += [c.tool_calls for c in conversations]
            tokens["converse"] = sum(sum(c.mask) for c in conversations)
            started = time.perf_counter()
            result = backend.generate(
                [fed.texts[index] for index in range(len(records))],
                adapter=None,
                samples_per_prompt=args.group,
                max_completion_length=args.tokens,
                seed=repeat,
                add_special_tokens=False,
                **options,
            )
            if repeat:
                runs["generate"].append(time.perf_counter() - started)
            tokens["generate"] = result.timings.completion_tokens
        agent.close()
    wall = {name: statistics.median(values) for name, values in runs.items()}
    figures.update(
        {
            "device": args.device,
            "model": {"hidden": args.hidden, "layers": args.layers},
            "conversations": args.prompts * args.group,
            "wall_s": {name: round(value, 4) for name, value in wall.items()},
            "model_tokens_per_s": {name: round(tokens[name] / wall[name], 1) for name in wall},
            "outside_sampling_share_of_converse": round(statistics.median(tool_share), 4),
            "turns_per_conversation": round(statistics.mean(turns), 3),
            "calls_per_conversation": round(statistics.mean(calls), 3),
            "converse_vs_generate_wall": round(wall["converse"] / wall["generate"], 3),
        }
    )
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
