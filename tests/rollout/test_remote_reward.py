"""RemoteRewardClient against real HTTP servers on 127.0.0.1 (http.server in threads).

Each server's behaviour is chosen by its path: /ok answers OpenRLHF's API correctly
(reward = length of the response, score = 1 when the label is in the query), /slow sleeps
before answering, /error500 always fails, /flaky fails the first request of each batch,
/badjson, /short (one value too few), /nokey (no "rewards") and /notfound (404).
"""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from rl_data.sync.broadcast import free_port
from rl_rollout.remote import RemoteRewardClient, RemoteRewardError
from rl_rollout.rewards import RewardFunction

QUERIES = [f"prompt {i}: answer {'x' * i}" for i in range(10)]
PROMPTS = [f"prompt {i}:" for i in range(10)]
LABELS = [str(i % 3) for i in range(10)]


def expected_rewards():
    return [float(len(q) - len(p)) for q, p in zip(QUERIES, PROMPTS, strict=True)]


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep test output quiet
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        with server.lock:
            server.requests.append((self.path, len(body["query"])))
            key = (self.path, body["query"][0])
            attempt = server.attempts.get(key, 0)
            server.attempts[key] = attempt + 1
        rewards = [float(len(q) - len(p)) for q, p in zip(body["query"], body["prompts"], strict=True)]
        scores = [float(label in q) for q, label in zip(body["query"], body["labels"], strict=True)]
        answer = {"rewards": rewards, "scores": scores, "extra_logs": {"batch": len(rewards)}}
        if self.path == "/slow":
            time.sleep(3.0)
        if self.path == "/error500" or (self.path == "/flaky" and attempt == 0):
            return self._send(500, b"internal error")
        if self.path == "/notfound":
            return self._send(404, b"no such route")
        if self.path == "/badjson":
            return self._send(200, b'{"rewards": [1.0, ')
        if self.path == "/short":
            answer["rewards"] = rewards[:-1]
        if self.path == "/nokey":
            answer = {"scores": scores}
        if self.path == "/nan":
            return self._send(200, b'{"rewards": [1e999' + b", 1.0" * (len(rewards) - 1) + b"]}")
        self._send(200, json.dumps(answer).encode())

    def _send(self, code, payload):
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout tests)
            pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    httpd.lock = threading.Lock()
    httpd.requests = []
    httpd.attempts = {}
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def url(server, path):
    return f"http://127.0.0.1:{server.server_address[1]}{path}"


@pytest.fixture
def dead_url():
    """A URL on a port nothing listens on (bound, then closed)."""
    return f"http://127.0.0.1:{free_port()}/reward"


def test_correct_server_answers_in_sample_order_across_batches(server):
    client = RemoteRewardClient(url(server, "/ok"), batch_size=3, timeout_s=10)
    assert isinstance(client, RewardFunction)
    output = client(QUERIES, PROMPTS, LABELS)
    assert output.rewards == expected_rewards()
    assert output.scores == [float(label in q) for q, label in zip(QUERIES, LABELS, strict=True)]
    assert output.extra_logs == {"batch": [3, 3, 3, 1]}
    assert output.num_fallbacks == 0
    assert client.metrics()[f"reward/requests/{url(server, '/ok')}"] == 4.0


def test_slow_server_times_out_within_the_deadline(server):
    client = RemoteRewardClient(
        url(server, "/slow"), batch_size=10, timeout_s=0.3, max_retries=1, backoff_s=0.0
    )
    with pytest.raises(
        RemoteRewardError, match=r"samples \[0, 10\): gave up after 2 attempts.*no answer from .*/slow"
    ):
        client(QUERIES, PROMPTS, LABELS)


def test_overall_deadline_bounds_retries(server):
    client = RemoteRewardClient(
        url(server, "/slow"), batch_size=10, timeout_s=0.4, max_retries=50, backoff_s=0.0, deadline_s=1.0
    )
    with pytest.raises(RemoteRewardError, match=r"deadline of 1.0 s passed; last error: .*no answer"):
        client(QUERIES, PROMPTS, LABELS)


def test_server_errors_are_retried_then_reported(server):
    client = RemoteRewardClient(url(server, "/error500"), batch_size=5, max_retries=2, backoff_s=0.01)
    with pytest.raises(
        RemoteRewardError, match=r"gave up after 3 attempts; last error: .*HTTP 500 from .*/error500"
    ):
        client(QUERIES, PROMPTS, LABELS)
    assert client.metrics()["reward/retries"] >= 2.0


def test_transient_server_errors_are_retried_until_success(server):
    client = RemoteRewardClient(url(server, "/flaky"), batch_size=5, max_retries=2, backoff_s=0.01)
    output = client(QUERIES, PROMPTS, LABELS)
    assert output.rewards == expected_rewards()
    assert client.metrics()["reward/retries"] == 2.0  # one per batch


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/badjson", r"samples \[0, 4\), attempt 1: malformed JSON from .*/badjson"),
        ("/short", r"samples \[0, 4\), attempt 1: .*/short returned 3 rewards for 4 samples"),
        (
            "/nokey",
            r"samples \[0, 4\), attempt 1: bad answer from .*/nokey: Object missing required field `rewards`",
        ),
        (
            "/nan",
            r"samples \[0, 4\), attempt 1: bad answer from .*/nan: Number out of range - at `\$.rewards\[0\]`",
        ),
        ("/notfound", r"samples \[0, 4\), attempt 1: HTTP 404 from .*/notfound"),
    ],
)
def test_bad_answers_fail_at_once_naming_endpoint_batch_and_field(server, path, message):
    client = RemoteRewardClient(url(server, path), batch_size=4, max_retries=3, backoff_s=0.01)
    with pytest.raises(RemoteRewardError, match=message):
        client(QUERIES[:4], PROMPTS[:4], LABELS[:4])
    assert client.metrics()["reward/retries"] == 0.0


def test_a_dead_endpoint_is_avoided_and_the_healthy_one_serves_everything(server, dead_url):
    healthy = url(server, "/ok")
    client = RemoteRewardClient(
        [dead_url, healthy], batch_size=2, max_retries=2, backoff_s=0.01, max_workers=1
    )
    output = client(QUERIES, PROMPTS, LABELS)
    assert output.rewards == expected_rewards()
    metrics = client.metrics()
    assert metrics[f"reward/failures/{dead_url}"] == 1.0  # marked down after its first refusal
    assert metrics[f"reward/requests/{healthy}"] == 5.0
    assert metrics[f"reward/failures/{healthy}"] == 0.0


def test_round_robin_spreads_batches_over_endpoints(server):
    first, second = url(server, "/ok"), url(server, "/ok?b")
    client = RemoteRewardClient([first, second], batch_size=1, balancing="round_robin", max_workers=1)
    client(QUERIES[:4], PROMPTS[:4], LABELS[:4])
    metrics = client.metrics()
    assert metrics[f"reward/requests/{first}"] == metrics[f"reward/requests/{second}"] == 2.0


def test_fallback_gives_failed_batches_the_fallback_and_counts_them(server, dead_url):
    client = RemoteRewardClient(
        dead_url, batch_size=4, max_retries=1, backoff_s=0.0, on_error="fallback", fallback=-2.0
    )
    output = client(QUERIES[:6], PROMPTS[:6], LABELS[:6])
    assert output.rewards == [-2.0] * 6
    assert output.fallback_indices == list(range(6))
    assert client.metrics()["reward/fallbacks"] == 6.0


def test_arguments_are_checked():
    with pytest.raises(
        ValueError, match=r"urls: 'ftp://x' is not allowed; expected an http:// or https:// URL"
    ):
        RemoteRewardClient("ftp://x")
    with pytest.raises(ValueError, match=r"batch_size: 0 is not allowed; expected an integer >= 1"):
        RemoteRewardClient("http://127.0.0.1:1/", batch_size=0)
    with pytest.raises(ValueError, match=r"balancing: 'random' is not allowed"):
        RemoteRewardClient("http://127.0.0.1:1/", balancing="random")
