"""The OpenAI-compatible agent server, its executor and OpenRLHF files with their own `execute`.

`ScriptEngine` is a deterministic implementation of OUR `Engine` protocol (not a stand-in for
vLLM): it answers the k-th assistant turn of a ChatML conversation (k = the prompt's
<|im_start|> count / 2 − 1) with `replies[k % len(replies)]` + <|im_end|>, log-prob of token t
−(t+1)/10, and logs every prompt it saw. The exact-capture test runs the real `HFEngine` on the
tiny checkpoint through the real `openai` client.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from rl_data import PromptSample
from rl_rollout import AgentServer, AgentServerExecutor, EpisodeError, MultiTurnExecutor, load_agent
from rl_rollout.agent_execute import _EXECUTE_AGENTS
from rl_rollout.protocol import Engine, EngineError, Generation, SamplingParams

MODEL = "policy"


class ScriptEngine(Engine):
    name = "ScriptEngine"

    def __init__(self, tokenizer, replies=(" hello",), *, max_model_len=512, fail=False, gate=None):
        self.gate = gate  # a threading.Event every generation waits for, when given
        self.tokenizer, self.replies, self._max_model_len, self.fail = (
            tokenizer,
            list(replies),
            max_model_len,
            fail,
        )
        self.calls: list[tuple[list[int], list[int]]] = []
        self.seeds: list[int | None] = []
        self.policy_version = 3

    @property
    def max_model_len(self):
        return self._max_model_len

    def generate(self, prompts, params):
        out = []
        for prompt in prompts:
            if self.gate is not None:
                assert self.gate.wait(30), "the test never opened the gate"
            if self.fail:
                raise EngineError("ScriptEngine: out of memory (scripted)")
            turn = prompt.count(self.tokenizer.convert_tokens_to_ids("<|im_start|>")) // 2 - 1
            text = self.replies[turn % len(self.replies)]
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            ids = [*ids[: params.max_new_tokens - 1], self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
            self.calls.append((list(prompt), ids))
            self.seeds.append(params.seed)
            logprobs = [-(t + 1) / 10 for t in range(len(ids))]
            out.append([Generation(token_ids=ids, logprobs=logprobs, finish_reason="stop", policy_version=3)])
        return out


class RecordingEngine(Engine):
    """Any engine, with every (prompt, generation) it served logged."""

    name = "RecordingEngine"

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    @property
    def max_model_len(self):
        return self.inner.max_model_len

    def generate(self, prompts, params):
        raise NotImplementedError("the server uses agenerate")

    async def agenerate(self, prompt, params):
        generations = await self.inner.agenerate(prompt, params)
        self.calls.append((list(prompt), generations[0]))
        return generations


def post(url, body, headers=None):
    """(status, JSON) of a POST; error statuses are answers, not exceptions."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def chat(server, session, messages, **fields):
    return post(
        server.url + "/v1/chat/completions",
        {"model": MODEL, "messages": messages, **fields},
        {"X-Session-ID": session} if session else None,
    )


@pytest.fixture
def server(tokenizer):
    with AgentServer(ScriptEngine(tokenizer), tokenizer, SamplingParams(max_new_tokens=16)) as running:
        yield running


# ---------------------------------------------------------------------------------------------
# Sessions: exact capture.


def test_a_multi_turn_session_holds_exactly_the_tokens_the_engine_saw_and_wrote(tiny_checkpoint, tokenizer):
    from rl_rollout.engines.hf import HFEngine

    engine = RecordingEngine(HFEngine(str(tiny_checkpoint), dtype="float32", device="cpu", max_model_len=256))
    with AgentServer(engine, tokenizer, SamplingParams(max_new_tokens=10, seed=0)) as server:
        session = server.open_session()
        client = openai.OpenAI(
            base_url=server.url + "/v1", api_key="x", max_retries=0, default_headers={"X-Session-ID": session}
        )
        messages = [{"role": "user", "content": "What is 2 + 2?"}]
        for turn in range(3):
            reply = client.chat.completions.create(model=MODEL, messages=messages, logprobs=True)
            choice = reply.choices[0]
            # the reply's log-probs are the engine's, token by token
            assert [c.logprob for c in choice.logprobs.content] == engine.calls[-1][1].logprobs
            messages += [
                {"role": "assistant", "content": choice.message.content},
                {"role": "user", "content": f"Tool says: turn {turn} done"},
            ]
        record = server.close_session(session)
        client.close()
    engine.inner.close()
    assert len(engine.calls) == 3
    assert record.requests == 3
    sequence = record.prompt_ids + record.response_ids
    mask = [False] * len(record.prompt_ids) + record.action_mask
    logprobs = [0.0] * len(record.prompt_ids) + record.logprobs
    for (prompt, generation), (start, end) in zip(engine.calls, record.action_ranges, strict=True):
        offset = len(record.prompt_ids)
        # the engine saw exactly the buffer so far, and wrote exactly the next span
        assert prompt == sequence[: offset + start]
        assert sequence[offset + start : offset + end] == generation.token_ids
        assert logprobs[offset + start : offset + end] == generation.logprobs
        assert all(mask[offset + start : offset + end])
    assert sum(record.action_mask) == sum(len(g.token_ids) for _, g in engine.calls)  # deltas: mask 0
    assert record.logprobs == [
        lp if m else 0.0 for lp, m in zip(record.logprobs, record.action_mask, strict=True)
    ]
    # the first prompt is the template's rendering; the deltas are the template's text, once
    assert tokenizer.decode(record.prompt_ids) == tokenizer.apply_chat_template(
        messages[:1], tokenize=False, add_generation_prompt=True
    )
    first_delta = record.response_ids[record.action_ranges[0][1] : record.action_ranges[1][0]]
    # it closes the assistant turn unless the engine wrote <|im_end|> itself (the tiny model may not)
    closed = engine.calls[0][1].token_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    expected = "\n<|im_start|>user\nTool says: turn 0 done<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(first_delta) == ("" if closed else "<|im_end|>") + expected


def test_a_reply_cut_by_max_tokens_gets_the_turn_closed_by_the_delta(tokenizer):
    engine = ScriptEngine(tokenizer, [" one two three four five six"])
    with AgentServer(engine, tokenizer, SamplingParams(max_new_tokens=3)) as server:
        session = server.open_session()
        status, first = chat(server, session, [{"role": "user", "content": "hi"}])
        assert status == 200
        messages = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "go on"},
        ]
        assert chat(server, session, messages)[0] == 200
        record = server.close_session(session)
    _, end = record.action_ranges[0]
    delta = tokenizer.decode(record.response_ids[end : record.action_ranges[1][0]])
    # the scripted reply ends with <|im_end|> (special): it is not repeated by the delta
    assert delta == "\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
    assert engine.calls[1][0] == record.prompt_ids + record.response_ids[: record.action_ranges[1][0]]


# ---------------------------------------------------------------------------------------------
# Routes and refused requests.


def test_health_models_and_tokenize(server, tokenizer):
    with urllib.request.urlopen(server.url + "/health", timeout=10) as response:
        assert json.loads(response.read())["status"] == "ok"
    with urllib.request.urlopen(server.url + "/v1/models", timeout=10) as response:
        assert [m["id"] for m in json.loads(response.read())["data"]] == [MODEL]
    messages = [{"role": "user", "content": "hi"}]
    status, body = post(server.url + "/tokenize", {"messages": messages})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert status == 200
    assert body["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    status, body = post(server.url + "/tokenize", {"text": "hi"})
    assert status == 400
    assert body["error"]["param"] == "messages"
    status, body = post(server.url + "/v1/nothing", {})
    assert status == 404
    assert "/v1/nothing" in body["error"]["message"]


BAD_REQUESTS = [
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content"),
    ({"n": 2}, 400, "n"),
    ({"stream": True}, 400, "stream"),
    ({"top_logprobs": 3, "logprobs": True}, 400, "top_logprobs"),
    ({"frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({"temperature": -1}, 400, "temperature"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"stop": [""]}, 400, "stop"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize(("change", "status", "param"), BAD_REQUESTS, ids=[p for _, _, p in BAD_REQUESTS])
def test_a_bad_request_body_gets_an_openai_error_naming_the_field(server, change, status, param):
    session = server.open_session()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **change}
    got, answer = post(server.url + "/v1/chat/completions", body, {"X-Session-ID": session})
    assert got == status
    assert answer["error"]["param"] == param
    assert param.split("[")[0] in answer["error"]["message"]
    assert server.peek(session).requests == 0  # nothing captured


def test_a_body_that_is_not_json_or_names_no_session_is_refused(server):
    status, answer = post(server.url + "/v1/chat/completions", b"{not json")
    assert status == 400
    assert "not valid JSON" in answer["error"]["message"]
    status, answer = chat(server, None, [{"role": "user", "content": "hi"}])
    assert status == 400
    assert answer["error"]["param"] == "session_id"


def test_a_closed_or_never_opened_session_is_refused(server):
    status, answer = chat(server, "nobody", [{"role": "user", "content": "hi"}])
    assert status == 404
    assert answer["error"]["code"] == "unknown_session"
    session = server.open_session()
    assert chat(server, session, [{"role": "user", "content": "hi"}])[0] == 200
    server.close_session(session)
    status, answer = chat(server, session, [{"role": "user", "content": "hi"}])
    assert status == 404
    assert session in answer["error"]["message"]
    # the session id in the body works as the header does
    other = server.open_session()
    status, _ = post(
        server.url + "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "session_id": other},
    )
    assert status == 200
    assert server.peek(other).requests == 1


def test_a_second_request_while_the_first_is_in_flight_is_refused(tokenizer):
    gate = threading.Event()
    with AgentServer(ScriptEngine(tokenizer, gate=gate), tokenizer) as server:
        session = server.open_session()
        first: list = []
        worker = threading.Thread(
            target=lambda: first.append(chat(server, session, [{"role": "user", "content": "hi"}]))
        )
        worker.start()
        while not server._sessions[session].busy:  # the first request reached the engine
            time.sleep(0.01)
        status, answer = chat(server, session, [{"role": "user", "content": "hi"}])
        gate.set()
        worker.join(30)
    assert status == 409
    assert answer["error"]["code"] == "session_busy"
    assert first[0][0] == 200


def get(url, headers=None):
    """(status, headers, JSON) of a GET; error statuses are answers, not exceptions."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, error.headers, json.loads(error.read())


def test_with_api_key_env_every_request_needs_the_key_and_the_refusal_does_not_echo_it(
    tokenizer, monkeypatch
):
    monkeypatch.setenv("AGENT_SERVER_TEST_KEY", "s3cret-key")
    with AgentServer(ScriptEngine(tokenizer), tokenizer, api_key_env="AGENT_SERVER_TEST_KEY") as server:
        session = server.open_session()
        hi = [{"role": "user", "content": "hi"}]
        for headers in ({}, {"Authorization": "Bearer s3cret-kez"}, {"Authorization": "Basic s3cret-key"}):
            status, answer_headers, answer = get(server.url + "/health", headers)
            assert status == 401
            assert answer_headers["WWW-Authenticate"] == "Bearer"
            assert answer["error"]["code"] == "invalid_api_key"
            assert "s3cret" not in json.dumps(answer)
            status, answer = chat(server, session, hi)  # no key: refused before the route
            assert (status, answer["error"]["code"]) == (401, "invalid_api_key")
        assert server.peek(session).requests == 0
        assert server.refusals == {"busy": 0, "unauthorized": 6}
        assert get(server.url + "/health", {"Authorization": "Bearer s3cret-key"})[0] == 200
        # the openai client sends its api_key as the bearer token
        client = openai.OpenAI(
            base_url=server.url + "/v1", api_key=server.api_key, max_retries=0,
            default_headers={"X-Session-ID": session},
        )  # fmt: skip
        assert client.chat.completions.create(model=MODEL, messages=hi).choices[0].message.content
        client.close()
    monkeypatch.delenv("AGENT_SERVER_TEST_KEY")
    with pytest.raises(
        ValueError, match="the environment variable AGENT_SERVER_TEST_KEY is not set or empty"
    ):
        AgentServer(ScriptEngine(tokenizer), tokenizer, api_key_env="AGENT_SERVER_TEST_KEY")
    with pytest.raises(ValueError, match="must be the NAME of an environment variable") as refused:
        AgentServer(ScriptEngine(tokenizer), tokenizer, api_key_env="s3cret key")
    assert "s3cret" not in str(refused.value)


def test_past_max_queue_a_request_gets_503_at_once_with_retry_after(tokenizer):
    gate = threading.Event()
    with AgentServer(ScriptEngine(tokenizer, gate=gate), tokenizer, max_queue=1) as server:
        first: list = []
        held = server.open_session()
        worker = threading.Thread(
            target=lambda: first.append(chat(server, held, [{"role": "user", "content": "hi"}]))
        )
        worker.start()
        while not server._sessions[held].busy:  # the first request holds the engine
            time.sleep(0.01)
        request = urllib.request.Request(
            server.url + "/v1/chat/completions",
            data=json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode(),
            headers={"Content-Type": "application/json", "X-Session-ID": server.open_session()},
        )
        with pytest.raises(urllib.error.HTTPError) as busy:
            urllib.request.urlopen(request, timeout=30)
        answer = json.loads(busy.value.read())
        health = get(server.url + "/health")[0]  # GET routes are not bounded
        gate.set()
        worker.join(30)
        assert server.refusals == {"busy": 1, "unauthorized": 0}
        assert chat(server, server.open_session(), [{"role": "user", "content": "hi"}])[0] == 200
    assert (busy.value.code, busy.value.headers["Retry-After"]) == (503, "1")
    assert answer["error"]["code"] == "busy"
    assert "max_queue" in answer["error"]["message"]
    assert health == 200
    assert first[0][0] == 200
    with pytest.raises(ValueError, match="max_queue: 0 is not allowed"):
        AgentServer(ScriptEngine(tokenizer), tokenizer, max_queue=0)


def test_an_edited_history_is_refused_and_the_session_is_unchanged(server):
    session = server.open_session()
    first = [{"role": "user", "content": "hi"}]
    _, reply = chat(server, session, first)
    said = reply["choices"][0]["message"]["content"]
    captured = list(server.peek(session).response_ids)
    edited = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": said},
        {"role": "user", "content": "x"},
    ]
    status, answer = chat(server, session, edited)
    assert status == 400
    assert answer["error"]["code"] == "history_mismatch"
    assert answer["error"]["param"] == "messages[0]"
    rewritten = [*first, {"role": "assistant", "content": said + "!"}, {"role": "user", "content": "x"}]
    status, answer = chat(server, session, rewritten)
    assert answer["error"]["param"] == "messages[1]"
    status, answer = chat(server, session, first)  # no new message: does not extend the history
    assert status == 400
    assert answer["error"]["code"] == "history_mismatch"
    assert server.peek(session).response_ids == captured
    status, _ = chat(
        server, session, [*first, {"role": "assistant", "content": said}, {"role": "user", "content": "x"}]
    )
    assert status == 200
    assert server.peek(session).requests == 2


def test_an_engine_error_is_a_500_and_leaves_the_session_as_it_was(tokenizer):
    engine = ScriptEngine(tokenizer, fail=True)
    with AgentServer(engine, tokenizer) as server:
        session = server.open_session()
        status, answer = chat(server, session, [{"role": "user", "content": "hi"}])
        assert status == 500
        assert answer["error"]["code"] == "engine_error"
        assert "out of memory (scripted)" in answer["error"]["message"]
        assert server.peek(session).requests == 0
        assert server.peek(session).prompt_ids == []


def test_a_session_past_max_length_is_refused_and_marked_truncated(tokenizer):
    with AgentServer(ScriptEngine(tokenizer), tokenizer, max_length=24) as server:
        session = server.open_session()
        status, reply = chat(server, session, [{"role": "user", "content": "hi"}])
        assert status == 200
        more = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
            {"role": "user", "content": "a much longer message that will not fit in the context"},
        ]
        status, answer = chat(server, session, more)
        assert status == 400
        assert answer["error"]["code"] == "context_length_exceeded"
        record = server.close_session(session)
    assert record.truncated
    assert record.finish_reason == "length"
    assert record.requests == 1


def test_tool_calls_come_back_as_tool_calls_and_tool_results_are_environment_tokens(tokenizer):
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    engine = ScriptEngine(tokenizer, [f"Let me add.{call}", " It is 5."])
    tools = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {}}}]
    with AgentServer(engine, tokenizer) as server:
        session = server.open_session()
        messages = [{"role": "user", "content": "2 + 3?"}]
        status, reply = chat(server, session, messages, tools=tools)
        assert status == 200
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == "Let me add."
        [tool_call] = choice["message"]["tool_calls"]
        assert tool_call["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
        messages += [
            choice["message"],
            {"role": "tool", "tool_call_id": tool_call["id"], "name": "add", "content": "5"},
        ]
        status, reply = chat(server, session, messages, tools=tools)
        assert status == 200
        assert reply["choices"][0]["message"]["content"] == " It is 5."
        more = [*messages, reply["choices"][0]["message"], {"role": "user", "content": "thanks"}]
        status, answer = chat(server, session, more, tools=None)
        assert answer["error"]["param"] == "tools"  # tools are rendered once, into the prompt
        record = server.close_session(session)
    assert record.used_tools
    assert (record.tool_calls, record.tool_call_errors) == (1, 0)
    first_end, second_start = record.action_ranges[0][1], record.action_ranges[1][0]
    # the model's own call text stays as it wrote it; the tool result is a delta with mask 0
    assert call in tokenizer.decode(record.response_ids[:first_end])
    assert "<|im_start|>tool\n5<|im_end|>" in tokenizer.decode(record.response_ids[first_end:second_start])
    assert not any(record.action_mask[first_end:second_start])


def test_a_malformed_tool_call_comes_back_as_plain_content_and_is_counted(tokenizer):
    malformed = '<tool_call>{"name": "add", "arguments": {"a": 2,</tool_call>'
    engine = ScriptEngine(tokenizer, [malformed])
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    with AgentServer(engine, tokenizer) as server:
        session = server.open_session()
        status, reply = chat(server, session, [{"role": "user", "content": "2 + 3?"}], tools=tools)
        record = server.close_session(session)
    assert status == 200
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == malformed  # the model sees what it wrote
    assert (record.tool_calls, record.tool_call_errors) == (0, 1)


# ---------------------------------------------------------------------------------------------
# The executor.


def samples_for(tokenizer, texts):
    return [
        PromptSample(
            prompt_ids=tokenizer(t, add_special_tokens=False)["input_ids"], prompt=t, label=str(i), index=i
        )
        for i, t in enumerate(texts)
    ]


async def two_turn_agent(client, prompt, label):
    messages = [{"role": "user", "content": prompt}]
    reply = await client.chat.completions.create(model=MODEL, messages=messages)
    messages += [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "sure?"},
    ]
    await client.chat.completions.create(model=MODEL, messages=messages)
    return {"reward": float(label), "extra_logs": {"label": float(label)}}


def test_executor_runs_episodes_in_sessions_and_stops_its_server(tokenizer):
    engine = ScriptEngine(tokenizer, [" yes", " no"])
    executor = AgentServerExecutor(
        engine, tokenizer, SamplingParams(n=2, max_new_tokens=8), agent=two_turn_agent, first_group_id=5
    )
    records = executor.run(samples_for(tokenizer, ["a?", "b?"]))
    assert [r.group_id for r in records] == [5, 5, 6, 6]
    assert [r.reward for r in records] == [0.0, 0.0, 1.0, 1.0]
    assert len(engine.calls) == 8
    for record in records:
        assert record.extra["turns"] == 2
        assert record.extra["extra_logs"] == {"label": record.reward}
        assert record.policy_version == 3
        assert record.finish_reason == "stop"
        starts = [s for s, _ in record.extra["action_ranges"]]
        assert record.action_mask[starts[0]]
        assert not record.action_mask[starts[1] - 1]
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": ["a?", "b?"][int(record.label)]}],
            tokenize=False,
            add_generation_prompt=True,
        )
        assert tokenizer.decode(record.prompt_ids.tolist()) == prompt
    assert executor.last_metrics["rollout/turns_mean"] == 2.0
    # the server lived for the run only: its port refuses connections, its thread is gone
    port = executor.server.port
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    assert not any(t.name.startswith("rl-agent-server") for t in threading.enumerate())


async def keyed_agent(client, prompt, label):
    """The openai client as the executor gives it, and plain HTTP with its default_headers."""
    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}])
    url = str(client.base_url).rstrip("/").removesuffix("/v1") + "/health"
    headers = {k: v for k, v in client.default_headers.items() if isinstance(v, str)}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as response:
        return float(response.status == 200)


def test_the_executor_hands_the_server_key_to_the_agents_client(tokenizer, monkeypatch):
    monkeypatch.setenv("AGENT_SERVER_TEST_KEY", "k-123")
    executor = AgentServerExecutor(
        ScriptEngine(tokenizer), tokenizer, SamplingParams(n=2, max_new_tokens=4), agent=keyed_agent,
        api_key_env="AGENT_SERVER_TEST_KEY", max_concurrency=3,
    )  # fmt: skip
    records = executor.run(samples_for(tokenizer, ["a?"]))
    assert [r.reward for r in records] == [1.0, 1.0]
    assert (executor.server.api_key, executor.server.max_queue) == ("k-123", 12)  # 4 · max_concurrency
    assert executor.last_metrics["rollout/server_unauthorized"] == 0.0
    assert executor.last_metrics["rollout/server_busy"] == 0.0
    monkeypatch.delenv("AGENT_SERVER_TEST_KEY")
    with pytest.raises(ValueError, match="AGENT_SERVER_TEST_KEY is not set"):
        AgentServerExecutor(
            ScriptEngine(tokenizer), tokenizer, SamplingParams(), agent=keyed_agent,
            api_key_env="AGENT_SERVER_TEST_KEY",
        )  # fmt: skip


def test_the_episodes_of_a_prompt_sample_with_seeds_of_their_own(tokenizer):
    """Episodes of one prompt share it; with one seed they would draw the same tokens. Request k of
    episode j samples with seed + j·2¹⁶ + k; a request's own seed wins."""
    engine = ScriptEngine(tokenizer, [" yes", " no"])
    executor = AgentServerExecutor(
        engine, tokenizer, SamplingParams(n=3, max_new_tokens=8, seed=11), agent=two_turn_agent
    )
    executor.run(samples_for(tokenizer, ["a?"]))
    assert sorted(engine.seeds) == sorted(11 + j * 2**16 + k for j in range(3) for k in range(2))
    with AgentServer(engine, tokenizer, SamplingParams(seed=5)) as server:
        unseeded, seeded = server.open_session(), server.open_session(seed=100)
        chat(server, unseeded, [{"role": "user", "content": "hi"}])
        chat(server, seeded, [{"role": "user", "content": "hi"}])
        chat(server, seeded, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " yes"},
                              {"role": "user", "content": "x"}], seed=7)  # fmt: skip
    assert engine.seeds[-3:] == [5, 100, 7]


async def failing_agent(client, prompt, label):
    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}])
    if label == "1":
        raise RuntimeError("the agent broke")
    if label == "2":
        await asyncio.sleep(30)
    return 1.0


def test_agent_exceptions_and_timeouts_follow_on_error(tokenizer):
    samples = samples_for(tokenizer, ["ok", "raise", "hang"])
    sampling = SamplingParams(n=1, max_new_tokens=4)
    strict = AgentServerExecutor(ScriptEngine(tokenizer), tokenizer, sampling, agent=failing_agent)
    with pytest.raises(
        EpisodeError, match=r"episode 0 of sample \(index 1\) failed: RuntimeError\('the agent broke'\)"
    ):
        strict.run(samples[:2])
    assert not strict.server.running
    lenient = AgentServerExecutor(
        ScriptEngine(tokenizer), tokenizer, sampling, agent=failing_agent, on_error="fallback", fallback=-1.0,
        episode_timeout_s=1.0,
    )  # fmt: skip
    ok, broke, hung = lenient.run(samples)
    assert (ok.reward, ok.finish_reason) == (1.0, "stop")
    assert (broke.reward, broke.finish_reason) == (-1.0, "abort")
    assert "the agent broke" in broke.extra["episode_error"]
    assert hung.finish_reason == "abort"
    assert "timed out after 1.0 s" in hung.extra["episode_error"]
    assert broke.response_ids.numel() > 0  # what the session captured is kept
    assert lenient.last_metrics["rollout/episode_failures"] == 2.0


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("async def run_agent(client, prompt, label):\n    return 1.0\n", "made no chat completion request"),
        (
            "async def run_agent(client, prompt, label):\n    await client.models.list()\n    return 'high'\n",
            "expected a finite number",
        ),
        (
            "async def run_agent(client, prompt, label):\n    await client.models.list()\n    return {'score': 1}\n",
            "without 'reward'",
        ),
    ],
    ids=["no_request", "not_a_number", "no_reward_key"],
)
def test_unusable_agent_results_fail_the_episode(tokenizer, tmp_path, source, message):
    agent = tmp_path / "my_agent.py"
    agent.write_text(source)
    executor = AgentServerExecutor(ScriptEngine(tokenizer), tokenizer, SamplingParams(), agent=str(agent))
    with pytest.raises(EpisodeError, match=message):
        executor.run(samples_for(tokenizer, ["x"]))


def test_agent_file_errors_name_the_file_and_the_signature(tokenizer, tmp_path):
    sync = tmp_path / "sync_agent.py"
    sync.write_text("def run_agent(client, prompt, label):\n    return 0.0\n")
    with pytest.raises(TypeError, match=r"sync_agent\.py.*must be `async def run_agent"):
        AgentServerExecutor(ScriptEngine(tokenizer), tokenizer, SamplingParams(), agent=str(sync))
    named = tmp_path / "named.py"
    named.write_text("async def solve(client, prompt):\n    return 0.0\n")
    with pytest.raises(TypeError, match=r"take \(client, prompt, label\)"):
        AgentServerExecutor(ScriptEngine(tokenizer), tokenizer, SamplingParams(), agent=f"{named}:solve")
    with pytest.raises(AttributeError, match="defines no run_agent"):
        AgentServerExecutor(ScriptEngine(tokenizer), tokenizer, SamplingParams(), agent=str(named))
    with pytest.raises(ValueError, match="tool_parser: 'nope'"):
        AgentServerExecutor(
            ScriptEngine(tokenizer), tokenizer, SamplingParams(), agent=two_turn_agent, tool_parser="nope"
        )


# ---------------------------------------------------------------------------------------------
# OpenRLHF files whose AgentExecutor brings its own execute.

EXECUTE_AGENT = '''
from openrlhf.utils.agent import AgentExecutorBase


class AgentExecutor(AgentExecutorBase):
    """Two generations with a fixed feedback between them, as OpenRLHF's executors return them."""

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine):
        tokens = hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        log_probs = [0.0] * len(tokens)
        ranges = []
        for turn in range(2):
            sampling_params.max_tokens = 4
            output = await llm_engine.generate(tokens, sampling_params)
            generated = output.outputs[0]
            ranges.append((len(tokens), len(tokens) + len(generated.token_ids)))
            tokens = tokens + list(generated.token_ids)
            log_probs += [entry[t].logprob for t, entry in zip(generated.token_ids, generated.logprobs)]
            if turn == 0:
                feedback = hf_tokenizer(" Again:", add_special_tokens=False)["input_ids"]
                tokens, log_probs = tokens + feedback, log_probs + [0.0] * len(feedback)
        return {"prompt": prompt, "label": label, "observation_tokens": tokens, "action_ranges": ranges,
                "rollout_log_probs": log_probs, "reward": float(label), "scores": None,
                "extra_logs": {"text": generated.text}, "truncated": generated.finish_reason == "length"}
'''


def test_an_agent_file_with_its_own_execute_is_honoured(tokenizer, tmp_path):
    path = tmp_path / "agent_execute.py"
    path.write_text(EXECUTE_AGENT)
    agent = load_agent(path)
    assert agent.instance_cls is None
    assert agent.execute_cls.__name__ == "AgentExecutor"
    engine = ScriptEngine(tokenizer, [" a b c d e"])
    executor = MultiTurnExecutor(engine, tokenizer, SamplingParams(n=2, max_new_tokens=16), env=path)
    assert agent.path not in _EXECUTE_AGENTS  # built on first use: checking options runs nothing
    samples = samples_for(tokenizer, ["zero", "one"])
    records = executor.run(samples)
    assert [r.reward for r in records] == [0.0, 0.0, 1.0, 1.0]
    feedback = tokenizer(" Again:", add_special_tokens=False)["input_ids"]
    for record, sample in zip(records, [s for s in samples for _ in range(2)], strict=True):
        assert record.prompt_ids.tolist() == sample.prompt_ids.tolist()
        [(_, first), (_, second)] = [engine.calls[i] for i in range(2)]
        assert record.response_ids.tolist() == first + feedback + second
        assert record.action_mask.tolist() == [True] * len(first) + [False] * len(feedback) + [True] * len(
            second
        )
        expected = [-(t + 1) / 10 for t in range(len(first))] + [0.0] * len(feedback)
        assert record.rollout_logprobs.tolist() == pytest.approx(
            expected + [-(t + 1) / 10 for t in range(len(second))]
        )
        assert record.extra["turns"] == 2
        assert record.finish_reason == "stop"
    # a second run reuses the file's one AgentExecutor (and its event loop)
    again = MultiTurnExecutor(engine, tokenizer, SamplingParams(n=1, max_new_tokens=16), env=path)
    assert again.execute_agent is executor.execute_agent
    assert again.run(samples[:1])[0].reward == 0.0


def test_execute_results_that_cannot_be_records_fail_the_episode(tokenizer, tmp_path):
    path = tmp_path / "agent_bad_execute.py"
    path.write_text(
        "from openrlhf.utils.agent import AgentExecutorBase\n"
        "class AgentExecutor(AgentExecutorBase):\n"
        "    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine):\n"
        "        return {'observation_tokens': [1, 2, 3], 'action_ranges': [(1, 5)], 'reward': 1.0}\n"
    )
    executor = MultiTurnExecutor(
        ScriptEngine(tokenizer), tokenizer, SamplingParams(), env=path, on_error="fallback"
    )
    [record] = executor.run(samples_for(tokenizer, ["x"]))
    assert record.finish_reason == "abort"
    assert "not increasing spans within the 3" in record.extra["episode_error"]


# ---------------------------------------------------------------------------------------------
# Rewritten histories: a thinking template drops earlier reasoning (history="segments").

THOUGHTS = ["<think>plan a</think>one", "<think>plan b</think>two", "<think>plan c</think>three"]


def thinking_agent(keep_reasoning):
    """Three turns; the replies go back without their reasoning (as a reasoning parser hands them
    over), or whole (then the Qwen3-style template drops it from earlier turns itself)."""

    async def run_agent(client, prompt, label):
        messages = [{"role": "user", "content": prompt}]
        for turn in range(3):
            reply = await client.chat.completions.create(model=MODEL, messages=messages)
            content = reply.choices[0].message.content
            sent = content if keep_reasoning else content.split("</think>")[-1]
            messages += [{"role": "assistant", "content": sent}, {"role": "user", "content": f"next {turn}"}]
        return {"reward": 1.0 + float(label)}

    return run_agent


def test_a_thinking_template_episode_is_refused_by_append_and_split_into_exact_segments(make_tokenizer):
    think = make_tokenizer("chatml-think")
    refusing = AgentServerExecutor(
        ScriptEngine(think, THOUGHTS), think, SamplingParams(max_new_tokens=16), agent=thinking_agent(False)
    )
    with pytest.raises(EpisodeError, match=re.escape("messages[1] (assistant) differs")):
        refusing.run(samples_for(think, ["a?"]))
    engine = ScriptEngine(think, THOUGHTS)
    executor = AgentServerExecutor(
        engine,
        think,
        SamplingParams(max_new_tokens=16),
        agent=thinking_agent(False),
        history="segments",
        first_group_id=4,
    )
    records = executor.run(samples_for(think, ["a?"]))
    assert len(records) == len(engine.calls) == 3
    for index, (record, (prompt, reply)) in enumerate(zip(records, engine.calls, strict=True)):
        # each segment is exact token-in/token-out: its prompt what the engine saw, its response
        # what the engine wrote, with the engine's log-probs; reward and group are the episode's
        assert record.prompt_ids.tolist() == prompt
        assert record.response_ids.tolist() == reply
        assert record.action_mask.all()
        assert record.rollout_logprobs.tolist() == pytest.approx([-(t + 1) / 10 for t in range(len(reply))])
        assert (record.reward, record.group_id, record.finish_reason) == (1.0, 4, "stop")
        assert record.extra["segment"] == {"episode": 0, "index": index, "count": 3}
        assert record.extra["turns"] == 1
    # a segment's prompt is the template's rendering of the conversation: earlier reasoning gone
    text = think.decode(records[2].prompt_ids.tolist())
    assert text == think.apply_chat_template(
        [
            {"role": "user", "content": "a?"},
            {"role": "assistant", "content": "one"},
            {"role": "user", "content": "next 0"},
            {"role": "assistant", "content": "two"},
            {"role": "user", "content": "next 1"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert executor.last_metrics["rollout/episodes"] == 1.0
    assert executor.last_metrics["rollout/segments_per_episode"] == 3.0


@pytest.mark.parametrize(("template", "segments"), [("chatml-think", 3), ("chatml", 1)])
def test_segments_open_only_where_the_template_rewrites_the_history(make_tokenizer, template, segments):
    tokenizer = make_tokenizer(template)

    def run(history):
        engine = ScriptEngine(tokenizer, THOUGHTS)
        executor = AgentServerExecutor(
            engine, tokenizer, SamplingParams(max_new_tokens=16), agent=thinking_agent(True), history=history
        )
        return executor.run(samples_for(tokenizer, ["a?"])), engine

    records, engine = run("segments")
    assert len(records) == segments
    # the tokens the engine wrote, each once, in order, across the segments
    written = [t for r in records for t, m in zip(r.response_ids.tolist(), r.action_mask.tolist()) if m]
    assert written == [t for _, reply in engine.calls for t in reply]
    if segments == 1:  # an append-only template: the same tokens as the append mode captures
        [appended], _ = run("append")
        assert records[0].prompt_ids.tolist() == appended.prompt_ids.tolist()
        assert records[0].response_ids.tolist() == appended.response_ids.tolist()
        assert records[0].action_mask.tolist() == appended.action_mask.tolist()
        assert "segment" not in records[0].extra
