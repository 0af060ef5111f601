"""Tool-calling episodes: the model calls tools, reads their results and answers.

`ToolCallExecutor` runs `MultiTurnExecutor`'s episodes (the same loop, token bookkeeping,
concurrency, timeouts and failure policy) with a `ToolEnvironment` as the environment:

    prompt  = the sample's prompt with the tools rendered in by the chat template (`tools=`)
    repeat up to max_turns:  aₖ = the engine's action (exact token ids and log-probs)
                             calls = parser.parse(decode(aₖ))
                             no call attempted  -> the episode ends; aₖ is the final answer
                             else run the calls concurrently (call_tool, per-call timeout);
                                  fₖ = the results as "tool" messages rendered by the chat
                                  template after aₖ (environment tokens: action mask 0, log-prob 0)
    reward  = the run's reward function on (prompt text + the final answer's text)

A malformed call (bad JSON, no name, arguments that are not an object) is answered with a tool
message that says what is wrong, like a failed call, so the model can try again. A turn whose
calls would take the episode past `max_tool_calls` ends the episode without running them.
Earlier turns are never re-tokenised: only the prompt (with its tools) and each step's tool
messages are tokenised, once.

Each record's `extra["tools"]` counts its episode's calls ("calls"), its failed calls by kind
(`TOOL_ERRORS` and "malformed") and "limit_reached" (0 or 1); `rl_launch` logs them as
`rollout/tools/...` and `last_metrics` holds the same for a direct caller.

Prompt rendering. Datasets arrive rendered without tools. With `tools_in_prompt="template"` the
executor renders a lone user message with and without `tools=` and swaps the part of the
template before the user's text (and after it, if that differs), so the prompt reads exactly as
`apply_chat_template(messages, tools=...)` would write it. A prompt that does not begin with
what the template writes before a lone user message (it has its own system turn, say) is
refused with that reason. `tools_in_prompt="none"` leaves prompts as they are (the dataset
describes the tools itself).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from rl_data import PromptSample, Trajectory
from rl_data.errors import check_integer

from .bounded import UserThreads
from .executors import MultiTurnExecutor, _prompt_text, _run_sync
from .protocol import Engine, SamplingParams
from .rewards import RewardFunction
from .tools import (
    TOOL_ERRORS,
    TOOL_PARSERS,
    Tool,
    ToolCallParser,
    call_tool,
    load_tools,
    openai_tool_schemas,
    parse_safely,
)

__all__ = [
    "TOOLS_IN_PROMPT",
    "TOOL_COUNTS",
    "ToolCallExecutor",
    "ToolEnvironment",
    "ToolPrompt",
    "tool_metrics",
]

TOOLS_IN_PROMPT: tuple[str, ...] = ("template", "none")
TOOL_COUNTS: tuple[str, ...] = ("calls", *TOOL_ERRORS, "malformed", "limit_reached")
"""The keys of a record's `extra["tools"]`."""


class ToolPrompt:
    """Puts the tools into prompts rendered without them, through the chat template's `tools=`.

    With the lone-user-message renderings plain = head + M + tail and with tools = head' + M + tail'
    (M a placeholder), a prompt head + X + tail becomes head' + X + tail'.
    """

    def __init__(self, tokenizer: Any, schemas: list[dict[str, Any]]) -> None:
        marker = "\ue002"
        message = [{"role": "user", "content": marker}]
        plain = tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
        tooled = tokenizer.apply_chat_template(
            message, tools=schemas, tokenize=False, add_generation_prompt=True
        )
        if plain.count(marker) != 1 or tooled.count(marker) != 1:
            raise ValueError(
                "tools_in_prompt='template': the chat template does not render a user message in place"
            )
        if plain == tooled:
            raise ValueError(
                "tools_in_prompt='template': the tokenizer's chat template ignores tools= (it renders the "
                "same text with and without them); use a template that renders tools, or "
                "tools_in_prompt='none' when the prompts describe the tools themselves"
            )
        self.head, self.tail = plain.split(marker)
        self.tool_head, self.tool_tail = tooled.split(marker)

    def __call__(self, prompt: str) -> str:
        if not (prompt.startswith(self.head) and prompt.endswith(self.tail)):
            raise ValueError(
                "tools_in_prompt='template': the prompt does not read as the chat template's rendering of "
                f"one user message (it should start with {self.head!r} and end with {self.tail!r}); "
                "render the dataset with the chat template and no system prompt, or render the tools "
                "into the prompts yourself and pass tools_in_prompt='none'"
            )
        body = prompt[len(self.head) : len(prompt) - len(self.tail)]
        return self.tool_head + body + self.tool_tail


class ToolEnvironment:
    """One episode's environment: parses each action's calls, runs them, answers with tool messages.

    `reset` renders the tools into the prompt (when `prompt` is given); `step` returns
    "environment_messages" (role "tool", one per call, in call order), reward 0 (the executor
    scores the final answer) and "extra_logs" with the episode's counts so far (`TOOL_COUNTS`).
    """

    def __init__(
        self,
        tools: dict[str, Tool],
        parser: ToolCallParser,
        *,
        tool_timeout_s: float,
        max_tool_calls: int,
        prompt: Callable[[str], str] | None = None,
        threads: UserThreads | None = None,
    ) -> None:
        self.tools, self.parser, self.prompt, self.threads = tools, parser, prompt, threads
        self.tool_timeout_s, self.max_tool_calls = tool_timeout_s, max_tool_calls
        self.counts = dict.fromkeys(TOOL_COUNTS, 0)

    async def reset(self, states: dict[str, Any]) -> dict[str, Any]:
        observation = states["observation"]
        return {"observation": self.prompt(observation) if self.prompt is not None else observation}

    async def step(self, states: dict[str, Any]) -> dict[str, Any]:
        parsed = parse_safely(self.parser, states["action_text"])
        done = {"rewards": 0.0, "environment_messages": [], "done": True}
        if not parsed.attempted:
            return {**done, "extra_logs": dict(self.counts)}
        if self.counts["calls"] + len(parsed.calls) > self.max_tool_calls:
            self.counts["limit_reached"] = 1
            return {**done, "extra_logs": dict(self.counts)}
        results = await asyncio.gather(
            *[
                call_tool(
                    self.tools.get(call.name),
                    call.arguments,
                    self.tool_timeout_s,
                    name=call.name,
                    call_id=call.id,
                    threads=self.threads,
                )
                for call in parsed.calls
            ]
        )
        self.counts["calls"] += len(parsed.calls)
        self.counts["malformed"] += len(parsed.errors)
        for result in results:
            if result.error is not None:
                self.counts[result.error] += 1
        messages = [{"role": "tool", "content": f"Error: {error}"} for error in parsed.errors]
        messages += [{"role": "tool", "content": result.content, "name": result.name} for result in results]
        return {
            "rewards": 0.0,
            "environment_messages": messages,
            "done": False,
            "extra_logs": dict(self.counts),
        }


class ToolCallExecutor:
    """Tool-calling episodes through any `Engine`, scored on the final answer by `reward_fn`.

    Args:
      engine: any `Engine`.
      reward_fn: a `RewardFunction` (single-turn functions work): queries = prompt text + the
        final answer's text (special tokens kept), prompts = prompt text, labels, in one call per `run`.
      tokenizer: renders the tools and the tool messages (its chat template), decodes actions.
      sampling: `SamplingParams` of every turn; `sampling.n` episodes per prompt; max_new_tokens caps a turn.
      tools: what `load_tools` accepts: a "file.py" (its TOOLS) or "file.py:NAME", or a list of
        functions, `Tool`s, MCP-style or OpenAI-style dicts.
      parser: a name in `TOOL_PARSERS` ("hermes": `<tool_call>{...}</tool_call>`), or a parser.
      tools_in_prompt: "template" (render the tools into each prompt through the chat template's
        `tools=`) or "none" (the prompts already describe them).
      tool_timeout_s: per-call limit; a call past it is answered "timed out" and the episode goes on.
      max_tool_calls: calls per episode; a turn that would go past it ends the episode.
      max_turns, max_length, episode_timeout_s, max_concurrency, on_error, fallback,
        action_skip_special_tokens, first_group_id: as for `MultiTurnExecutor` (an episode that
        fails keeps the fallback reward; tool failures never fail an episode).
    """

    def __init__(
        self,
        engine: Engine,
        reward_fn: RewardFunction,
        tokenizer: Any,
        sampling: SamplingParams,
        *,
        tools: str | Path | Sequence[Any] | None = None,
        parser: str | ToolCallParser = "hermes",
        tools_in_prompt: str = "template",
        tool_timeout_s: float = 30.0,
        max_tool_calls: int = 8,
        max_turns: int = 4,
        max_length: int | None = None,
        episode_timeout_s: float = 600.0,
        max_concurrency: int = 64,
        on_error: str = "raise",
        fallback: float = 0.0,
        action_skip_special_tokens: bool = False,
        first_group_id: int = 0,
    ) -> None:
        if not callable(reward_fn):
            raise TypeError(f"reward_fn: expected a RewardFunction, got {type(reward_fn).__name__}")
        if tools is None:
            raise ValueError(
                "tools: none given; pass a 'tools.py' file (its TOOLS list), 'file.py:NAME' or a list"
            )
        try:
            self.tools = load_tools(tools)
        except (FileNotFoundError, ImportError, AttributeError) as error:
            raise ValueError(f"tools: {error}") from None
        if not self.tools:
            raise ValueError(f"tools: {tools!r} holds no tool")
        if isinstance(parser, str):
            if parser not in TOOL_PARSERS:
                raise ValueError(
                    f"parser: {parser!r} is not a registered tool parser; expected one of {sorted(TOOL_PARSERS)}"
                )
            parser = TOOL_PARSERS[parser]
        elif not isinstance(parser, ToolCallParser):
            raise TypeError(
                f"parser: expected a name in TOOL_PARSERS or a ToolCallParser, got {type(parser).__name__}"
            )
        if tools_in_prompt not in TOOLS_IN_PROMPT:
            raise ValueError(
                f"tools_in_prompt: {tools_in_prompt!r} is not allowed; expected one of {TOOLS_IN_PROMPT}"
            )
        if not (
            isinstance(tool_timeout_s, (int, float))
            and not isinstance(tool_timeout_s, bool)
            and tool_timeout_s > 0
        ):
            raise ValueError(f"tool_timeout_s: {tool_timeout_s!r} is not allowed; expected a number > 0")
        check_integer("max_tool_calls", max_tool_calls, 1)
        self.parser, self.tools_in_prompt = parser, tools_in_prompt
        self.tool_timeout_s, self.max_tool_calls = float(tool_timeout_s), max_tool_calls
        self.reward_fn, self.tokenizer = reward_fn, tokenizer
        self._by_name = {tool.name: tool for tool in self.tools}
        self._prompt: ToolPrompt | None = None
        # the run's tool calls, at most max_concurrency at a time; a timed-out one frees its slot
        self.tool_threads = UserThreads(max_concurrency, name="rl-tool")
        self.episodes = MultiTurnExecutor(
            engine,
            tokenizer,
            sampling,
            env=self._environment,
            max_turns=max_turns,
            max_length=max_length,
            feedback="chat",
            action_skip_special_tokens=action_skip_special_tokens,
            episode_timeout_s=episode_timeout_s,
            max_concurrency=max_concurrency,
            on_error=on_error,
            fallback=fallback,
            first_group_id=first_group_id,
        )
        self.last_metrics: dict[str, float] = {}

    def schemas(self) -> list[dict[str, Any]]:
        """The tools as OpenAI-style declarations (what the chat template is given)."""
        return openai_tool_schemas(self.tools)

    def _environment(self) -> ToolEnvironment:
        if self.tools_in_prompt == "template" and self._prompt is None:
            self._prompt = ToolPrompt(self.tokenizer, self.schemas())
        return ToolEnvironment(
            self._by_name,
            self.parser,
            tool_timeout_s=self.tool_timeout_s,
            max_tool_calls=self.max_tool_calls,
            prompt=self._prompt,
            threads=self.tool_threads,
        )

    async def arun(
        self, samples: Sequence[PromptSample], *, group_ids: Sequence[int] | None = None
    ) -> list[Trajectory]:
        """`len(samples) · sampling.n` records, prompt-major, from concurrent episodes."""
        if self.tools_in_prompt == "template" and self._prompt is None:
            self._prompt = ToolPrompt(self.tokenizer, self.schemas())  # fails before any episode starts
        records = await self.episodes.arun(samples, group_ids=group_ids)
        if not records:
            return records
        n = len(records) // len(samples)
        scored = [i for i, r in enumerate(records) if "episode_error" not in r.extra]
        prompts = [_prompt_text(samples[i // n], self.tokenizer) for i in scored]
        answers = [self._final_answer(records[i]) for i in scored]
        output = self.reward_fn(
            [p + a for p, a in zip(prompts, answers, strict=True)],
            prompts,
            [records[i].label for i in scored],
        )
        if len(output.rewards) != len(scored):
            raise RuntimeError(
                f"reward function returned {len(output.rewards)} rewards for {len(scored)} answers"
            )
        fallbacks = set(output.fallback_indices)
        for position, index in enumerate(scored):
            records[index] = msgspec.structs.replace(
                records[index], reward=output.rewards[position], score=output.scores[position]
            )
            records[index].extra["reward_fallback"] = position in fallbacks
        for record in records:
            logs = record.extra.get("extra_logs") or {}
            record.extra["tools"] = {key: int(logs.get(key, 0)) for key in TOOL_COUNTS}
            record.extra["extra_logs"] = {k: v for k, v in logs.items() if k not in TOOL_COUNTS}
        self.last_metrics = {**self.episodes.last_metrics, **tool_metrics(records)}
        self.last_metrics["rollout/reward_mean"] = sum(r.reward for r in records) / len(records)
        return records

    def _final_answer(self, record: Trajectory) -> str:
        ranges = record.extra.get("action_ranges") or []
        if not ranges:
            return ""
        start, end = ranges[-1]
        return self.tokenizer.decode(record.response_ids[start:end].tolist(), skip_special_tokens=False)

    def run(
        self, samples: Sequence[PromptSample], *, group_ids: Sequence[int] | None = None
    ) -> list[Trajectory]:
        """`arun` from synchronous code (no event loop may be running in this thread)."""
        return _run_sync(self.arun(samples, group_ids=group_ids), "ToolCallExecutor")


def tool_metrics(records: Sequence[Trajectory]) -> dict[str, float]:
    """`rollout/tools/...` metrics of records that carry `extra["tools"]` ({} when none does).

    calls_mean: tool calls per episode; call_rate: the fraction of episodes with at least one
    call; errors/<kind>: failed calls of each kind (`TOOL_ERRORS`, "malformed") in all;
    limit_reached: episodes ended by max_tool_calls.
    """
    counts = [record.extra["tools"] for record in records if isinstance(record.extra.get("tools"), dict)]
    if not counts:
        return {}
    metrics = {
        "rollout/tools/calls_mean": sum(c.get("calls", 0) for c in counts) / len(counts),
        "rollout/tools/call_rate": sum(c.get("calls", 0) > 0 for c in counts) / len(counts),
        "rollout/tools/limit_reached": float(sum(c.get("limit_reached", 0) for c in counts)),
    }
    for kind in (*TOOL_ERRORS, "malformed"):
        metrics[f"rollout/tools/errors/{kind}"] = float(sum(c.get(kind, 0) for c in counts))
    return metrics
