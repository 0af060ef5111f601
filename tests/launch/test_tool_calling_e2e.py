"""End to end through the real CLI, Ray, vLLM (the default engine) and DeepSpeed: the calculator
task (`rl_launch.presets.calculator`) with `--rollout.executor tool_call`, then through the agent
server.

A tiny model warm-started by a lazy teacher (who calls the calculator on some answers and
guesses on the others) is trained by GRPO on "1 for the right sum". From outside the run:
the reward and the tool-call rate rise, the tool results are environment tokens (the policy's
loss counts only the action tokens), and no tool call failed."""

from __future__ import annotations

import pytest

from tests.launch.launching import launch, read_metrics

pytestmark = pytest.mark.slow


STEPS, PROMPTS, SAMPLES = 8, 16, 8


def _train(calculator_task, joined_ray, run_dir, learning_rate: str, *own: str) -> list[dict]:
    """`rl-launch ppo` on the calculator task: GRPO, STEPS steps of PROMPTS prompts x SAMPLES, no KL,
    the default engine (vLLM), the run's own options `own`; its metrics lines (one per step, checked)."""
    ray_args, env = joined_ray
    args = [
        "--preset", "none",
        "--model.pretrain", calculator_task.model_path,
        "--data.prompt_data", calculator_task.train_path,
        "--data.prompt_max_len", "64",
        "--algo.advantage.estimator", "grpo",
        "--algo.kl.init_kl_coef", "0",
        "--rollout.n_samples_per_prompt", str(SAMPLES),
        "--rollout.rollout_batch_size", str(PROMPTS),
        "--rollout.generate_max_len", "32",
        "--rollout.temperature", "1.0",
        "--train.max_steps", str(STEPS),
        "--train.actor_learning_rate", learning_rate,
        "--ckpt.save_hf_model", "false",
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        *ray_args,
        *own,
    ]  # fmt: skip
    result = launch(args, env)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = read_metrics(run_dir)
    assert [line["step"] for line in metrics] == list(range(1, STEPS + 1))
    return metrics


def test_grpo_teaches_a_tiny_model_to_call_the_calculator(calculator_task, joined_ray, tmp_path):
    metrics = _train(
        calculator_task,
        joined_ray,
        tmp_path / "run",
        "5e-4",
        *("--reward.function", calculator_task.reward),
        *("--rollout.executor", "tool_call"),
        *("--rollout.executor_options.tools", calculator_task.tools_path),
        *("--rollout.executor_options.parser", "hermes"),
        *("--rollout.executor_options.max_turns", "2"),
        *("--rollout.executor_options.tool_timeout_s", "10"),
    )
    records = PROMPTS * SAMPLES
    for line in metrics:
        assert line["rollout/tools/errors/malformed"] + line["rollout/tools/errors/unknown_tool"] <= records
        assert line["rollout/tools/errors/timeout"] == 0.0
        # response = call + tool turn + answer; the loss sees the call and the answer only
        assert line["policy/tokens"] == pytest.approx(line["rollout/action_tokens_mean"] * records)
        if line["rollout/tools/call_rate"] > 0:
            assert line["rollout/env_tokens_mean"] > 0
    # Measured (the calculator task's defaults): call rate and reward 0.45 -> 0.78 from step 1 to 8;
    # the warm-started model copies operands and results, so every call earns the reward.
    first, last = metrics[0], metrics[-1]
    assert last["rollout/tools/call_rate"] > first["rollout/tools/call_rate"] + 0.15
    assert last["reward/mean"] > first["reward/mean"] + 0.15
    assert last["reward/mean"] > 0.8 * last["rollout/tools/call_rate"]


# The same task through the agent server (`rollout.executor agent_server`): the whole agent is a
# user's `run_agent` written with the `openai` client; the tool calls come back as OpenAI
# `tool_calls` and the agent sends the results as `role: tool` messages.
OPENAI_AGENT = """
import json
import re

import openai

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression of integers with +, - and *.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example 123 + 456"}},
            "required": ["expression"],
        },
    },
}]


def calculator(expression):
    a, op, b = re.fullmatch(r"\\s*(\\d+)\\s*([-+*])\\s*(\\d+)\\s*", expression).groups()
    return str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op])


async def run_agent(client, prompt, label):
    messages, message = [{"role": "user", "content": prompt}], None
    for _ in range(2):  # a call, then the answer
        try:
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        except openai.BadRequestError as error:
            if error.code != "context_length_exceeded":
                raise
            break  # the conversation outgrew the context: it ends here
        message = reply.choices[0].message
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                result = calculator(**json.loads(call.function.arguments))
            except Exception as error:
                result = f"error: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    found = re.search(r"-?\\d+", (message and message.content) or "")
    return 1.0 if found and found.group(0) == str(label) else 0.0
"""

# Full-stack runs of the args below on 2 CPU cores (the calculator task's defaults: 500 warm-start
# steps, intermediate size 256), (reward, call rate) per step, first two and last two of 8 steps:
#   hf engine, default seeds:        (0.531 0.531) (0.453 0.461) ... (0.672 0.664) (0.672 0.672)
#   hf, train.seed 1, rollout.seed 1007: (0.484 0.492) (0.516 0.516) ... (0.578 0.578) (0.586 0.586)
#   vllm engine (now), default seeds: (0.492 0.492) (0.484 0.484) ... (0.727 0.727) (0.562 0.570)
# The mean of the last two steps minus the first two's: reward +0.18 / +0.082 / +0.16, call rate
# +0.17 / +0.078 / +0.16 (the previous defaults, 1000 steps at intermediate size 512: +0.12 / +0.01
# and +0.12 / +0.01). On recipe 1, lr 5e-4 (the tool_call run's) broke the operands copied into
# the calls after the first update (reward 0.30 at the end while the call rate rose to 0.61), and
# lr 2e-4 climbed too slowly on the second seed. With the default seeds a run repeats itself (every
# request is seeded: request k of episode j samples with seed + j·2¹⁶ + k): the call-rate rise is
# pinned for the default seeds only (the reward rose on both seeds tried with hf). vLLM's generation here is
# 1.3-1.7 s a step for the tool_call run (hf: 4-5 s); through the agent server ~6 s either way (its
# HTTP round trips).
SERVER_RISE = 0.08


def test_an_openai_client_agent_learns_to_call_the_calculator_through_the_agent_server(
    calculator_task, joined_ray, tmp_path
):
    agent = tmp_path / "calculator_agent.py"
    agent.write_text(OPENAI_AGENT)
    metrics = _train(
        calculator_task,
        joined_ray,
        tmp_path / "run",
        "3e-4",
        # run_agent gets the question; it builds the messages
        *("--data.apply_chat_template", "false"),
        *("--rollout.executor", "agent_server"),
        *("--rollout.agent_func_path", str(agent)),
    )
    records = PROMPTS * SAMPLES
    for line in metrics:
        assert line["rollout/episode_failures"] == 0.0
        # a call is one more request: the tool message is a delta of environment tokens
        assert line["rollout/turns_mean"] == pytest.approx(1 + line["rollout/tools/calls_mean"], abs=0.05)
        assert line["rollout/env_tokens_mean"] > 0
        assert line["policy/tokens"] == pytest.approx(line["rollout/action_tokens_mean"] * records)
        assert line["rollout/action_tokens_mean"] == pytest.approx(
            line["response_length/mean"] - line["rollout/env_tokens_mean"]
        )

    def rise(key: str) -> float:
        return sum(line[key] for line in metrics[-2:]) / 2 - sum(line[key] for line in metrics[:2]) / 2

    assert rise("reward/mean") >= SERVER_RISE, [line["reward/mean"] for line in metrics]
    assert rise("rollout/tools/call_rate") >= SERVER_RISE, [
        line["rollout/tools/call_rate"] for line in metrics
    ]
