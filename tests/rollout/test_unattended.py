"""Unattended runs: user code that blocks is abandoned on time, model output never crashes a parser.

Every stuck call here blocks for 600 s (or until the test releases it at the end), far longer
than the bound asserted (30 s): the tests check "abandoned, not joined", not speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import threading
import time
import urllib.request

import pytest

from rl_rollout import (
    AgentServerExecutor,
    BatchedReward,
    ExactMatchReward,
    PerSampleReward,
    RemoteRewardClient,
    RewardTimeout,
)
from rl_rollout.agent_server import AgentServer, ServerError, normalise_messages
from rl_rollout.bounded import CallTimeout, LoopWatchdog, UserThreads
from rl_rollout.executors import MultiTurnExecutor
from rl_rollout.protocol import Engine, SamplingParams
from rl_rollout.tools import (
    MAX_CALL_NESTING,
    TOOL_PARSERS,
    ParsedToolCalls,
    call_tool,
    parse_safely,
    tool_from_function,
)

from .test_executors import ScriptedEngine, make_samples

BOUND_S = 30.0  # what "returned on time" means here; the stuck code blocks 600 s
RELEASE = threading.Event()  # set at the end of the module, so no stuck thread outlives the tests


@pytest.fixture(scope="module", autouse=True)
def _release_stuck_threads():
    yield
    RELEASE.set()


def _block(seconds: float = 600.0) -> None:
    RELEASE.wait(seconds)


@pytest.fixture(scope="module")
def samples(tokenizer):
    return make_samples(tokenizer, ["What is 2 + 2?", "What is 3 * 4?", "What is 1 + 1?"], [4, "stuck", 2])


class SyncStuckOnOneLabel:
    """A sync environment whose step blocks (a `time.sleep`-like call) for the sample labelled "stuck"."""

    def reset(self, states):
        return {"observation": states["observation"]}

    def step(self, states):
        if states["label"] == "stuck":
            _block()
        return {"rewards": 1.0, "environment_feedback": "", "done": True}


class AsyncBlockingOnOneLabel:
    """An async environment that blocks its event loop (no await) for the sample labelled "stuck"."""

    async def reset(self, states):
        return {"observation": states["observation"]}

    async def step(self, states):
        if states["label"] == "stuck":
            _block()  # as requests.post / subprocess.run / time.sleep would
        return {"rewards": 1.0, "environment_feedback": "", "done": True}


@pytest.mark.parametrize("env", [SyncStuckOnOneLabel, AsyncBlockingOnOneLabel], ids=["sync", "async"])
def test_a_blocking_env_step_times_out_on_time_and_the_run_continues(tokenizer, samples, env):
    executor = MultiTurnExecutor(
        ScriptedEngine(tokenizer),
        tokenizer,
        SamplingParams(),
        env=env,
        episode_timeout_s=2.0,
        on_error="fallback",
        fallback=-1.0,
    )
    started = time.monotonic()
    records = executor.run(samples)
    elapsed = time.monotonic() - started
    assert elapsed < BOUND_S
    stuck = records[1]
    assert stuck.finish_reason == "abort"
    assert stuck.reward == -1.0
    error = stuck.extra["episode_error"]
    assert "timed out after 2.0 s; abandoned, the environment was at" in error
    assert "test_unattended.py:" in error
    assert "in _block for" in error
    assert [r.finish_reason for r in (records[0], records[2])] == ["stop", "stop"]
    assert [r.reward for r in (records[0], records[2])] == [1.0, 1.0]
    assert executor.last_metrics["rollout/episode_timeouts"] == 1.0
    assert stuck.extra["episode_timeout"] is True
    assert "episode_timeout" not in records[0].extra
    # the run goes on: the next batch runs although a thread of the last one is still stuck
    again = executor.run([samples[0], samples[2]])
    assert [r.reward for r in again] == [1.0, 1.0]


def test_a_sleeping_tool_returns_on_time_and_is_not_joined():
    def sleeps(x: int) -> int:
        """Blocks."""
        _block()
        return x

    async def blocks_its_loop(x: int) -> int:
        """An async tool that blocks instead of awaiting."""
        _block()
        return x

    for function in (sleeps, blocks_its_loop):
        started = time.monotonic()
        result = asyncio.run(call_tool(tool_from_function(function), {"x": 1}, 0.5))  # includes the shutdown
        assert time.monotonic() - started < BOUND_S
        assert (result.error, result.content) == (
            "timeout",
            f"Error: {function.__name__} timed out after 0.5 s.",
        )


def test_stuck_calls_do_not_starve_the_next_ones():
    threads = UserThreads(2, name="test")

    def quick(x: int) -> int:
        return x + 1

    async def main():
        stuck = []
        for _ in range(3):  # six stuck calls, two at a time: each pair fills both slots
            stuck += await asyncio.gather(
                *[threads.call(_block, timeout_s=0.2) for _ in range(2)], return_exceptions=True
            )
        assert all(isinstance(error, CallTimeout) for error in stuck)
        assert "_block() did not return within 0.2 s; abandoned after" in str(stuck[0])
        assert "test_unattended.py" in str(stuck[0])  # where the thread is stuck
        return await asyncio.wait_for(threads.call(quick, 41, timeout_s=BOUND_S), BOUND_S)

    assert asyncio.run(main()) == 42
    assert threads.abandoned_running == 6
    assert threads.abandoned_total == 6


def test_the_wait_for_a_slot_counts_against_the_deadline():
    threads = UserThreads(1, name="test")

    async def main():
        holder = asyncio.ensure_future(threads.call(_block, timeout_s=BOUND_S))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        with pytest.raises(CallTimeout, match=r"found none of the 1 slots of test free within 0\.2 s"):
            await threads.call(int, "1", timeout_s=0.2)
        assert time.monotonic() - started < BOUND_S
        holder.cancel()  # abandons the stuck call: its slot is free again
        with contextlib.suppress(asyncio.CancelledError):
            await holder
        return await threads.call(int, "7", timeout_s=BOUND_S)

    assert asyncio.run(main()) == 7


def test_too_many_abandoned_calls_refuse_new_ones():
    threads = UserThreads(4, max_abandoned=2, name="test")

    async def main():
        for _ in range(2):
            with pytest.raises(CallTimeout):
                await threads.call(_block, timeout_s=0.05)
        with pytest.raises(CallTimeout, match="2 abandoned calls are still running"):
            await threads.call(int, "1", timeout_s=5.0)

    asyncio.run(main())


def test_a_call_that_raises_hands_its_exception_to_the_caller():
    async def main():
        return await UserThreads(1).call(int, "not a number", timeout_s=5.0)

    with pytest.raises(ValueError, match="invalid literal"):
        asyncio.run(main())


def test_the_watchdog_names_code_that_blocks_the_loop():
    async def blocks_the_loop():
        async with LoopWatchdog(0.3, name="test") as watchdog:
            time.sleep(1.5)  # the code under test: blocks the loop it runs on
            await asyncio.sleep(0)
        return watchdog

    watchdog = asyncio.run(blocks_the_loop())
    assert watchdog.blocked == 1
    assert watchdog.blocked_s >= 0.3
    assert "test_unattended.py" in watchdog.last_block
    assert "in blocks_the_loop" in watchdog.last_block
    assert "blocked the test event loop for" in watchdog.last_block


# ----------------------------------------------------------------------------------------------
# Parsers: any model output is at worst a malformed call.

HUGE_INTEGER = '<tool_call>{"name": "add", "arguments": {"a": ' + "9" * 5000 + "}}</tool_call>"
DEEP_NESTING = '<tool_call>{"name": "add", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}</tool_call>"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (HUGE_INTEGER, "tool call 0: not usable JSON (ValueError"),
        (DEEP_NESTING, f"tool call 0: nested too deep (5002 levels of brackets; at most {MAX_CALL_NESTING})"),
        (
            '<tool_call>{"name": "add", "arguments": "' + "x" * 70_000 + '"}</tool_call>',
            "tool call 0: too long (70032 characters; at most 65536)",
        ),
    ],
    ids=["5000-digit integer", "5000 nested brackets", "too long"],
)
def test_hostile_model_output_is_a_malformed_call(text, error):
    parsed = TOOL_PARSERS["hermes"].parse(text)
    assert parsed.calls == []
    assert len(parsed.errors) == 1
    assert parsed.errors[0].startswith(error)


def test_arguments_given_as_a_hostile_string_are_a_malformed_call():
    arguments = json.dumps({"a": int("9" * 1000)})[:-1] + "9" * 4000 + "}"
    text = '<tool_call>{"name": "add", "arguments": ' + json.dumps(arguments) + "}</tool_call>"
    parsed = TOOL_PARSERS["hermes"].parse(text)
    assert parsed.calls == []
    assert parsed.errors[0].startswith('tool call 0 (add): "arguments" is a string that is not usable JSON')


def test_a_parser_that_raises_gives_a_tool_error():
    class Fragile:
        name = "fragile"

        def parse(self, text):
            raise RecursionError("maximum recursion depth exceeded")

    parsed = parse_safely(Fragile(), "<call>[[[[")
    assert isinstance(parsed, ParsedToolCalls)
    assert parsed.attempted
    assert parsed.errors == [
        "the tool calls could not be read (fragile parser: RecursionError: maximum recursion depth exceeded)"
    ]


def test_agent_server_refuses_hostile_tool_call_arguments_as_a_bad_request():
    arguments = '{"a": ' + "9" * 5000 + "}"
    messages = [
        {"role": "user", "content": "add"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "add", "arguments": arguments}}
            ],
        },
    ]
    with pytest.raises(
        ServerError, match=r"tool_calls\[0\].function.arguments: not usable JSON \(ValueError"
    ):
        normalise_messages(messages)


async def agent_blocking_on_one_label(client, prompt, label):
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": prompt}])
    if label == "1":
        _block()  # requests.post / time.sleep in an async agent: blocks its loop
    return 1.0


def test_an_agent_that_blocks_its_loop_times_out_on_time_and_the_others_finish(tokenizer):
    pytest.importorskip("fastapi")
    from .test_agent_server import ScriptEngine, samples_for

    executor = AgentServerExecutor(
        ScriptEngine(tokenizer),
        tokenizer,
        SamplingParams(n=1, max_new_tokens=4),
        agent=agent_blocking_on_one_label,
        episode_timeout_s=2.0,
        on_error="fallback",
        fallback=-1.0,
    )
    started = time.monotonic()
    ok, stuck, also_ok = executor.run(samples_for(tokenizer, ["a", "b", "c"]))
    assert time.monotonic() - started < BOUND_S
    assert [ok.reward, also_ok.reward] == [1.0, 1.0]
    assert (stuck.reward, stuck.finish_reason) == (-1.0, "abort")
    assert "timed out after 2.0 s; abandoned, run_agent was at" in stuck.extra["episode_error"]
    assert "in _block for" in stuck.extra["episode_error"]


# ----------------------------------------------------------------------------------------------
# Rewards: a deadline per sample (per call for batched functions), the on_error policy, counted.


def test_a_per_sample_reward_past_its_deadline_falls_back_on_that_sample_alone():
    def score(query, prompt, label):
        if label == "stuck":
            _block()
        return 1.0

    lenient = PerSampleReward(score, name="score", on_error="fallback", fallback=-1.0, timeout_s=0.5)
    started = time.monotonic()
    output = lenient(["a", "b", "c"], ["", "", ""], [1, "stuck", 2])
    assert time.monotonic() - started < BOUND_S
    assert output.rewards == [1.0, -1.0, 1.0]
    assert output.fallback_indices == [1]
    assert output.timeout_indices == [1]
    assert lenient.metrics()["reward/timeouts"] == 1.0
    strict = PerSampleReward(score, name="score", timeout_s=0.5)
    with pytest.raises(RewardTimeout, match=r"score: sample 1: score\(\) did not return within 0.5 s"):
        strict(["a", "b"], ["", ""], [1, "stuck"])


def test_a_rule_reward_and_a_batched_reward_take_a_deadline():
    class Stuck(ExactMatchReward):
        def score(self, response, label):
            _block()

    output = Stuck(on_error="fallback", fallback=0.5, timeout_s=0.2)(["x"], [""], ["x"])
    assert (output.rewards, output.timeout_indices) == ([0.5], [0])

    def batch(queries, prompts, labels):
        _block()

    output = BatchedReward(batch, on_error="fallback", timeout_s=0.2)(["x", "y"], ["", ""], [0, 0])
    assert (output.rewards, output.timeout_indices) == ([0.0, 0.0], [0, 1])


class _Silent(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        RELEASE.wait(600)


def test_a_remote_reward_that_never_answers_is_counted_as_a_timeout():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Silent)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/reward"
        client = RemoteRewardClient(url, timeout_s=0.2, max_retries=0, on_error="fallback", fallback=-1.0)
        output = client(["q a", "q b"], ["q", "q"], [None, None])
    finally:
        server.shutdown()
        server.server_close()
    assert output.rewards == [-1.0, -1.0]
    assert output.timeout_indices == [0, 1]
    assert client.metrics()["reward/timeouts"] == 2.0


# ----------------------------------------------------------------------------------------------
# The agent server: a body cap, a deadline per request, errors without internals.


class _StuckEngine(Engine):
    """Never answers (an engine that hangs), except that it can be told to raise."""

    name = "StuckEngine"

    def __init__(self, raises=None):
        self.raises = raises

    @property
    def max_model_len(self):
        return 512

    def generate(self, prompts, params):
        raise NotImplementedError("the server uses agenerate")

    async def agenerate(self, prompt, params):
        if self.raises is not None:
            raise self.raises
        await asyncio.sleep(600)


def test_agent_server_answers_a_stuck_request_504_at_its_deadline_and_stays_healthy(tokenizer):
    pytest.importorskip("fastapi")
    from .test_agent_server import chat

    with AgentServer(_StuckEngine(), tokenizer, request_timeout_s=1.0) as server:
        session = server.open_session()
        started = time.monotonic()
        status, answer = chat(server, session, [{"role": "user", "content": "hi"}])
        assert time.monotonic() - started < BOUND_S
        assert status == 504
        assert answer["error"]["code"] == "timeout"
        assert answer["error"]["message"] == "the request took longer than 1 s"
        assert server.peek(session).requests == 0  # the session is as it was
        with urllib.request.urlopen(server.url + "/health", timeout=10) as response:
            assert json.loads(response.read())["status"] == "ok"


def test_agent_server_refuses_a_huge_or_hostile_body(tokenizer):
    pytest.importorskip("fastapi")
    from .test_agent_server import ScriptEngine, post

    with AgentServer(ScriptEngine(tokenizer), tokenizer, max_body_bytes=16384) as server:
        url = server.url + "/v1/chat/completions"
        session = {"X-Session-ID": server.open_session()}
        status, answer = post(
            url, {"model": "policy", "messages": [{"role": "user", "content": "x" * 20_000}]}, session
        )
        assert status == 413
        assert answer["error"]["code"] == "too_large"
        assert "max_body_bytes is 16384" in answer["error"]["message"]
        for hostile in (b'{"model": ' + b"9" * 5000 + b"}", b"[" * 5000 + b"]" * 5000):
            status, answer = post(url, hostile, session)
            assert status == 400
            assert "not usable JSON" in answer["error"]["message"]


def test_agent_server_errors_do_not_echo_internals(tokenizer):
    pytest.importorskip("fastapi")
    from .test_agent_server import chat

    engine = _StuckEngine(raises=RuntimeError("/home/alice/secret-path/model.bin: token hf_abc"))
    with AgentServer(engine, tokenizer) as server:
        status, answer = chat(server, server.open_session(), [{"role": "user", "content": "hi"}])
    assert status == 500
    assert answer["error"]["message"] == "engine: the generation failed (RuntimeError; see the server's log)"


STUCK_EXECUTE_AGENT = """
from openrlhf.utils.agent import AgentExecutorBase

from tests.rollout.test_unattended import _block


class AgentExecutor(AgentExecutorBase):
    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine):
        _block()  # blocks the file's own event loop (requests.post in an async execute)
"""


def test_an_agent_file_whose_execute_blocks_its_loop_times_out_on_time_naming_it(tokenizer, tmp_path):
    path = tmp_path / "stuck_execute.py"
    path.write_text(STUCK_EXECUTE_AGENT)
    executor = MultiTurnExecutor(
        ScriptedEngine(tokenizer),
        tokenizer,
        SamplingParams(),
        env=path,
        # the deadline covers loading the agent file too: 1 s was once spent there beside the other
        # test worker (the loop was still resolving the file's path), not yet in execute
        episode_timeout_s=3.0,
        on_error="fallback",
    )
    started = time.monotonic()
    records = executor.run(make_samples(tokenizer, ["What is 2 + 2?"], [4]))
    assert time.monotonic() - started < BOUND_S
    assert records[0].finish_reason == "abort"
    assert (
        "timed out after 3.0 s; abandoned, the agent file's event loop was at"
        in records[0].extra["episode_error"]
    )
    assert "test_unattended.py" in records[0].extra["episode_error"]
