"""ToolCallExecutor: tool-calling episodes with exact token capture, each failure kind answered
to the model as a tool message, limits, rewards on the final answer and the metrics.

`ScriptedToolEngine` implements OUR `Engine` protocol deterministically (not a stand-in for
vLLM): an episode's k-th action is `script[k]` (k = the number of assistant turns in the prompt
it is given, minus one) followed by EOS, with log-prob −(t+1)/10 for token t; every call is
logged so a test can check exactly which ids the engine saw and returned. The prompts are
rendered by the tiny tokenizer's "chatml-tools" template.
"""

from __future__ import annotations

import asyncio
import warnings

import pytest
import torch

from rl_data import PromptSample
from rl_rollout import BatchedReward, SamplingParams, Tool, ToolCallExecutor
from rl_rollout.protocol import Engine, Generation
from rl_rollout.tool_executor import ToolPrompt


class ScriptedToolEngine(Engine):
    name = "ScriptedToolEngine"

    def __init__(self, tokenizer, script, *, max_model_len=1024):
        self.tokenizer, self.script, self._max_model_len = tokenizer, list(script), max_model_len
        self.calls: list[tuple[list[int], list[int]]] = []

    @property
    def max_model_len(self):
        return self._max_model_len

    def generate(self, prompts, params):
        raise NotImplementedError("the tool executor uses agenerate")

    async def agenerate(self, prompt, params):
        text = self.tokenizer.decode(list(prompt), skip_special_tokens=False)
        turn = text.count("<|im_start|>assistant") - 1
        ids = self.tokenizer(self.script[min(turn, len(self.script) - 1)], add_special_tokens=False)[
            "input_ids"
        ]
        ids = [*ids, self.tokenizer.eos_token_id]
        finish = "stop"
        if len(ids) > params.max_new_tokens:
            ids, finish = ids[: params.max_new_tokens], "length"
        self.calls.append((list(prompt), ids))
        logprobs = [-(t + 1) / 10 for t in range(len(ids))]
        return [Generation(token_ids=ids, logprobs=logprobs, finish_reason=finish) for _ in range(params.n)]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first term.
        b: second term.
    """
    return a + b


def broken(x: int) -> int:
    """Always fails."""
    raise RuntimeError("disk on fire")


async def slow(x: int) -> int:
    """Takes x / 100 seconds."""
    await asyncio.sleep(x / 100)
    return x


TOOLS = [add, broken, slow]


def call(name, **arguments):
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture(scope="module")
def tokenizer(make_tokenizer):
    return make_tokenizer("chatml-tools")


def sample(tokenizer, question="What is 2 + 3?", label="5"):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return PromptSample(
        prompt_ids=tokenizer(text, add_special_tokens=False)["input_ids"], prompt=text, label=label, index=0
    )


def first_integer_reward():
    def reward(queries, prompts, labels):
        import re

        out = []
        for query, prompt, label in zip(queries, prompts, labels, strict=True):
            match = re.search(r"\d+", query[len(prompt) :])
            out.append(1.0 if match and match.group() == str(label) else 0.0)
        return out

    return BatchedReward(reward, name="first_integer")


def run(tokenizer, script, **options):
    engine = ScriptedToolEngine(tokenizer, script)
    options = {"tools": TOOLS, "tool_timeout_s": 0.05, **options}
    executor = ToolCallExecutor(
        engine, first_integer_reward(), tokenizer, SamplingParams(max_new_tokens=256), **options
    )
    [record] = executor.run([sample(tokenizer)])
    return record, engine, executor


def tool_turn(tokenizer, *contents):
    """What the template writes after an assistant turn's EOS for these tool results."""
    return "".join(f"\n<|im_start|>tool\n{c}<|im_end|>" for c in contents) + "\n<|im_start|>assistant\n"


def test_exact_tokens_across_turns_and_environment_tokens_out_of_the_loss(tokenizer):
    script = [call("add", a=2, b=3), "5"]
    record, engine, executor = run(tokenizer, script)
    assert len(engine.calls) == 2
    (prompt0, action0), (prompt1, action1) = engine.calls
    tools_line = "<|im_start|>system\nTools: add(a, b) broken(x) slow(x)<|im_end|>\n"
    assert tokenizer.decode(prompt0) == tools_line + sample(tokenizer).prompt
    assert record.prompt_ids.tolist() == prompt0
    env_ids = tokenizer(tool_turn(tokenizer, "5"), add_special_tokens=False)["input_ids"]
    # byte for byte: what the engine generated, then the rendered tool turn, then the next action
    assert record.response_ids.tolist() == action0 + env_ids + action1
    assert prompt1 == prompt0 + action0 + env_ids  # the second turn continues the exact ids
    assert record.action_mask.tolist() == [True] * len(action0) + [False] * len(env_ids) + [True] * len(
        action1
    )
    expected_logprobs = [-(t + 1) / 10 for t in range(len(action0))] + [0.0] * len(env_ids)
    expected_logprobs += [-(t + 1) / 10 for t in range(len(action1))]
    assert record.rollout_logprobs.tolist() == pytest.approx(expected_logprobs)
    assert record.reward == 1.0
    assert record.finish_reason == "stop"
    assert record.extra["turns"] == 2
    assert record.extra["tools"] == {
        "calls": 1,
        "unknown_tool": 0,
        "bad_arguments": 0,
        "exception": 0,
        "timeout": 0,
        "malformed": 0,
        "limit_reached": 0,
    }
    assert executor.last_metrics["rollout/tools/calls_mean"] == 1.0
    assert executor.last_metrics["rollout/tools/call_rate"] == 1.0
    assert executor.last_metrics["rollout/reward_mean"] == 1.0


def env_text(record, engine):
    """The decoded environment tokens of a two-turn episode."""
    start, end = record.extra["action_ranges"][0][1], record.extra["action_ranges"][1][0]
    return engine.tokenizer.decode(record.response_ids[start:end].tolist(), skip_special_tokens=False)


def test_malformed_call_is_answered_and_the_episode_goes_on(tokenizer):
    record, engine, executor = run(
        tokenizer, ['<tool_call>{"name": "add", "arguments": {"a": 2,}}</tool_call>', "5"]
    )
    assert env_text(record, engine) == tool_turn(
        tokenizer,
        "Error: tool call 0: not valid JSON (Expecting property name enclosed in double quotes at character "
        '37): \'{"name": "add", "arguments": {"a": 2,}}\'',
    )
    assert record.extra["tools"]["malformed"] == 1
    assert record.extra["tools"]["calls"] == 0
    assert executor.last_metrics["rollout/tools/errors/malformed"] == 1.0
    assert record.reward == 1.0


def test_unknown_tool_is_answered(tokenizer):
    record, engine, _ = run(tokenizer, [call("multiply", a=2, b=3), "6"])
    assert env_text(record, engine) == tool_turn(tokenizer, "Error: tool 'multiply' is not available.")
    assert record.extra["tools"]["unknown_tool"] == 1
    assert record.reward == 0.0  # answered 6 for label 5


def test_bad_arguments_are_answered(tokenizer):
    record, engine, _ = run(tokenizer, [call("add", a="2", b=3), "5"])
    assert env_text(record, engine) == tool_turn(
        tokenizer, "Error: bad arguments for add: argument 'a' must be of type integer, got \"2\"."
    )
    assert record.extra["tools"]["bad_arguments"] == 1


def test_tool_exception_is_answered(tokenizer):
    record, engine, _ = run(tokenizer, [call("broken", x=1), "5"])
    assert env_text(record, engine) == tool_turn(tokenizer, "Error: broken raised RuntimeError: disk on fire")
    assert record.extra["tools"]["exception"] == 1
    assert "episode_error" not in record.extra


def test_tool_timeout_is_answered(tokenizer):
    record, engine, executor = run(tokenizer, [call("slow", x=100), "5"], tool_timeout_s=0.01)
    assert env_text(record, engine) == tool_turn(tokenizer, "Error: slow timed out after 0.01 s.")
    assert record.extra["tools"]["timeout"] == 1
    assert executor.last_metrics["rollout/tools/errors/timeout"] == 1.0


def test_several_calls_in_one_turn_run_concurrently_in_call_order(tokenizer):
    record, engine, _ = run(tokenizer, [call("slow", x=7) + call("add", a=1, b=1), "5"], tool_timeout_s=5.0)
    assert env_text(record, engine) == tool_turn(tokenizer, "7", "2")
    assert record.extra["tools"]["calls"] == 2


def test_max_tool_calls_ends_the_episode_without_running_the_turn(tokenizer):
    record, engine, executor = run(
        tokenizer,
        [call("add", a=1, b=1), call("add", a=2, b=2) + call("add", a=3, b=3), "5"],
        max_tool_calls=2,
    )
    assert len(engine.calls) == 2
    assert record.extra["tools"]["calls"] == 1
    assert record.extra["tools"]["limit_reached"] == 1
    _, last_end = record.extra["action_ranges"][-1]
    assert last_end == record.response_ids.numel()  # no tool turn after the refused calls
    assert executor.last_metrics["rollout/tools/limit_reached"] == 1.0


def test_max_turns_ends_an_episode_that_keeps_calling(tokenizer):
    record, engine, _ = run(tokenizer, [call("add", a=1, b=1)], max_turns=3)
    assert len(engine.calls) == 3
    assert record.finish_reason == "length"
    assert record.extra["tools"]["calls"] == 3
    assert record.reward == 0.0  # the last action is a call, not the answer


def test_options_are_checked_with_their_names():
    engine = ScriptedToolEngine(None, ["x"])
    reward = first_integer_reward()
    sampling = SamplingParams()
    with pytest.raises(ValueError, match=r"tools: none given"):
        ToolCallExecutor(engine, reward, None, sampling)
    with pytest.raises(
        ValueError, match=r"parser: 'pythonic' is not a registered tool parser; expected one of \['hermes'"
    ):
        ToolCallExecutor(engine, reward, None, sampling, tools=TOOLS, parser="pythonic")
    with pytest.raises(
        ValueError, match=r"tools_in_prompt: 'system' is not allowed; expected one of \('template', 'none'\)"
    ):
        ToolCallExecutor(engine, reward, None, sampling, tools=TOOLS, tools_in_prompt="system")
    with pytest.raises(ValueError, match=r"tool_timeout_s: 0 is not allowed"):
        ToolCallExecutor(engine, reward, None, sampling, tools=TOOLS, tool_timeout_s=0)
    with pytest.raises(ValueError, match=r"tools: tools file '/nowhere/t.py' does not exist"):
        ToolCallExecutor(engine, reward, None, sampling, tools="/nowhere/t.py")


def test_a_template_that_ignores_tools_is_refused(make_tokenizer):
    with pytest.raises(ValueError, match=r"ignores tools=.*tools_in_prompt='none'"):
        ToolPrompt(make_tokenizer("chatml"), [Tool(name="t").schema()])
    prompt = ToolPrompt(make_tokenizer("chatml-tools"), [Tool(name="t").schema()])
    with pytest.raises(
        ValueError, match=r"does not read as the chat template's rendering of one user message"
    ):
        prompt(
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        )


def test_tools_in_prompt_none_keeps_the_prompt(tokenizer):
    record, _, _ = run(tokenizer, ["5"], tools_in_prompt="none")
    assert record.prompt_ids.tolist() == sample(tokenizer).prompt_ids.tolist()
    assert record.extra["tools"]["calls"] == 0
    assert record.reward == 1.0
    assert torch.equal(record.action_mask, torch.ones_like(record.action_mask))


def test_run_inside_a_running_event_loop_is_refused_and_names_arun(tokenizer):
    engine = ScriptedToolEngine(tokenizer, ["5"])
    executor = ToolCallExecutor(engine, first_integer_reward(), tokenizer, SamplingParams(), tools=TOOLS)

    async def inside_a_loop():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the refused coroutine is closed, not left un-awaited
            executor.run([sample(tokenizer)])

    with pytest.raises(
        RuntimeError,
        match=r"ToolCallExecutor.run: an event loop is running here; await ToolCallExecutor.arun",
    ):
        asyncio.run(inside_a_loop())
    assert engine.calls == []
    [record] = executor.run([sample(tokenizer)])  # outside a loop it runs
    assert record.reward == 1.0
