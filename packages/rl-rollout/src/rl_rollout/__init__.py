"""rl_rollout: generation for RL post-training, token ids in and token ids out.

- One engine protocol (`Engine`, `SamplingParams`, `Generation`): vLLM in-process
  (`rl_rollout.engines.VLLMEngine`), HF transformers (`HFEngine`) and an OpenAI-compatible
  server (`HTTPEngine`) all pass the same contract tests. Engines receive weights from a
  learner through `rl_data.sync` (`WeightReceiver`, one receiver per transport in `RECEIVERS`), never by importing `rl_learner`.
- Executors turn `rl_data.PromptSample`s into scored `rl_data.Trajectory` records: single-turn
  (n samples per prompt) and multi-turn agents (environment tokens carry action mask 0; OpenRLHF
  agent files work unchanged, their own `AgentExecutor.execute` included).
- Agents written against the OpenAI API (`AgentServerExecutor`): an `AgentServer` over any engine
  serves `/v1/chat/completions` on 127.0.0.1 for a rollout and captures every session's exact
  token ids, log-probs and action mask (delta tokenisation, never re-tokenising earlier turns);
  the user's `async def run_agent(client, prompt, label)` is the whole agent.
- Tool calling (`rl_rollout.tools`): tools from Python functions or MCP / OpenAI declarations,
  call parsers by name (`TOOL_PARSERS`, Hermes / Qwen `<tool_call>` built in), calls that never
  raise into the episode (`call_tool`); `ToolCallExecutor` runs tool-calling episodes (results
  are environment tokens, the final answer is scored by the run's reward function).
- Rewritten histories (`history="segments"`): thinking templates that drop earlier reasoning
  make an agent's episode a list of segments, one record each (`rl_rollout.episodes`).
- A sandbox for model-written code (`run_python`: deadline, memory, output cap, no network, a
  throwaway folder), the unit-test `CodeReward` and a `python_tool()` on it.
- reasoning-gym tasks as prompts and their verifiers as `ReasoningGymReward`
  (`rl_rollout.reasoning_gym`, extra `rl-rollout[reasoning-gym]`).
- verifiers 0.4 environments: their tasks as prompts, their rubric as `VerifiersReward`
  (`rl_rollout.verifiers_env`) and their own `Env.run` driving multi-turn episodes in which our
  engine plays the seat (`rl_rollout.verifiers_episode`); extra `rl-rollout[verifiers]`.
- Rewards: OpenRLHF `reward_func` files, rule rewards for verifiable tasks, a remote reward client,
  a judge model scoring completions from a prompt template and a parser (`JudgeReward`).
- DAPO dynamic filtering that never drops accepted groups, overlong and stop-properly shaping.

    from rl_rollout import SamplingParams, SingleTurnExecutor, NumericAnswerReward
    from rl_rollout.engines import VLLMEngine

    engine = VLLMEngine("path/to/model")
    records = SingleTurnExecutor(engine, NumericAnswerReward(), tokenizer, SamplingParams(n=8)).run(prompts)
"""

from .__about__ import __version__
from .agent_server import HISTORY_MODES, AgentServer, ServerError, SessionRecord
from .code_tasks import CodeReward, python_tool, run_tests
from .executors import EpisodeError, MultiTurnExecutor, SingleTurnExecutor, load_agent, load_agent_class
from .filtering import (
    DynamicSampler,
    FilterResult,
    dynamic_sample,
    filter_groups,
    groups_in_order,
    shape_rewards,
)
from .judge import JUDGE_PARSERS, JudgeReward, load_judge_template, render_judge_prompt
from .protocol import Engine, EngineError, Generation, SamplingParams
from .reasoning_gym import ReasoningGymReward
from .receiver_base import RECEIVERS, TransportReceiver
from .remote import RemoteRewardClient, RemoteRewardError
from .rewards import (
    BatchedReward,
    ExactMatchReward,
    FormatReward,
    NumericAnswerReward,
    PerSampleReward,
    RewardError,
    RewardFunction,
    RewardOutput,
    RewardTimeout,
    WeightedSumReward,
    load_reward_function,
)
from .sandbox import SandboxError, SandboxLimits, SandboxResult, run_python
from .server_executor import AgentServerExecutor, load_run_agent
from .tool_executor import ToolCallExecutor, tool_metrics
from .tools import (
    TOOL_ERRORS,
    TOOL_PARSERS,
    ParsedToolCalls,
    Tool,
    ToolCall,
    ToolCallParser,
    ToolResult,
    call_tool,
    load_tools,
    openai_tool_schemas,
    register_tool_parser,
    tool_from_function,
)
from .verifiers_env import VerifiersReward
from .weights import WeightReceiver

__all__ = [
    "HISTORY_MODES",
    "JUDGE_PARSERS",
    "RECEIVERS",
    "TOOL_ERRORS",
    "TOOL_PARSERS",
    "AgentServer",
    "AgentServerExecutor",
    "BatchedReward",
    "CodeReward",
    "DynamicSampler",
    "Engine",
    "EngineError",
    "EpisodeError",
    "ExactMatchReward",
    "FilterResult",
    "FormatReward",
    "Generation",
    "JudgeReward",
    "MultiTurnExecutor",
    "NumericAnswerReward",
    "ParsedToolCalls",
    "PerSampleReward",
    "ReasoningGymReward",
    "RemoteRewardClient",
    "RemoteRewardError",
    "RewardError",
    "RewardFunction",
    "RewardOutput",
    "RewardTimeout",
    "SamplingParams",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "ServerError",
    "SessionRecord",
    "SingleTurnExecutor",
    "Tool",
    "ToolCall",
    "ToolCallExecutor",
    "ToolCallParser",
    "ToolResult",
    "TransportReceiver",
    "VerifiersReward",
    "WeightReceiver",
    "WeightedSumReward",
    "__version__",
    "call_tool",
    "dynamic_sample",
    "filter_groups",
    "groups_in_order",
    "load_agent",
    "load_agent_class",
    "load_judge_template",
    "load_reward_function",
    "load_run_agent",
    "load_tools",
    "openai_tool_schemas",
    "python_tool",
    "register_tool_parser",
    "render_judge_prompt",
    "run_python",
    "run_tests",
    "shape_rewards",
    "tool_from_function",
    "tool_metrics",
]
