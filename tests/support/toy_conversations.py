"""The checks every backend's toy agent conversations must pass (``worker.generate.toy_agent``): the tool answers
masked out exactly, the counts of turns and calls, the environment's reward; and the train sample each becomes,
so that a test can hold the trainer's rescoring of the model's tokens to the generator's logprobs."""

from __future__ import annotations

from typing import Any

from worker.generate.agent import AgentCompletion
from worker.model.tiny_model import REVEAL_CALL
from worker.optimize.batch import TrainSample


def segments(tokens: list[str], mask: list[bool]) -> list[list[str]]:
    """The conversation as alternating runs: model tokens, tool-answer tokens, model tokens, ..."""
    runs: list[list[str]] = []
    for index, (token, model) in enumerate(zip(tokens, mask, strict=True)):
        if index == 0 or model != mask[index - 1]:
            runs.append([])
        runs[-1].append(token)
    assert mask[0], "a conversation starts with the model's turn"
    return runs


def check_toy_conversation(
    tokenizer: Any, digit: str, completion: AgentCompletion, reward: float, max_tool_calling_iterations: int
) -> TrainSample:
    """Assert what a toy conversation must hold; return it as a train sample (advantage 0)."""
    turns = segments(tokenizer.convert_ids_to_tokens(completion.token_ids), completion.mask)
    model_turns, answers = turns[0::2], turns[1::2]
    # Each answered turn called reveal() and got exactly "<tool>" and the digit per call, then "<assistant>",
    # masked out; nothing else is masked out.
    for turn, answer in zip(model_turns, answers, strict=False):
        assert answer == ["<tool>", digit] * turn.count(REVEAL_CALL) + ["<assistant>"]
    assert completion.turns == len(model_turns) == len(answers) + 1
    assert completion.tool_failures == 0
    answered = sum(turn.count(REVEAL_CALL) for turn in model_turns[:-1])
    if completion.tool_calls > answered:  # the last turn's calls ran, but their answers would not fit
        assert completion.finish_reason == "length"
        assert completion.tool_calls == answered + model_turns[-1].count(REVEAL_CALL)
    else:
        assert completion.tool_calls == answered
    if REVEAL_CALL in model_turns[-1] and completion.finish_reason == "stop":
        assert len(answers) == max_tool_calling_iterations  # the limit left its call unanswered
    assert all(lp == 0.0 for lp, model in zip(completion.logprobs, completion.mask, strict=True) if not model)
    assert reward == (0.25 if completion.tool_calls else 0.0)
    return TrainSample(
        completion.prompt_token_ids, completion.token_ids, completion.logprobs, 0.0, completion_mask=completion.mask
    )
