"""`rl-launch serve-rm`: a reward model behind OpenRLHF's HTTP API, driven by our real client.

- `rl_rollout.RemoteRewardClient` gets one score per query, equal to a plain transformers forward
  of the same model on the query's tokens (1e-5), over several batches of different lengths;
  OpenRLHF's query-only body gets the same scores, on /get_reward and on /.
- Requests from several threads at once each get their own answers.
- Bad bodies get HTTP 400 with a JSON message naming what is wrong, an oversized one 413, another
  path 404, and the server keeps serving; it binds to 127.0.0.1 by default.
- Truncation (right / left), append_eos and normalize_reward (mean / std from config.json) score
  exactly the tokens they say; normalize_reward without mean / std serves raw scores.
- The command line: options, --print-config, errors with exit code 2.
- End to end: tests/launch/test_rewards_e2e.py starts `rl-launch serve-rm --port 0` in a
  subprocess and `rl-launch ppo` trains 2 steps against it, one of the run's weighted reward
  sources (tests/launch/reward_servers.py: `served_reward_model`).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rl_launch.cli import main
from rl_launch.config import ConfigError
from rl_launch.options import load_config
from rl_launch.serve_rm import RewardModelScorer, RewardModelServer, ServeRMConfig
from rl_rollout import RemoteRewardClient, RemoteRewardError

ATOL = 1e-5


def _chat(question: str, answer: str) -> tuple[str, str]:
    prompt = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return prompt, prompt + answer


def _samples(count: int, seed: int = 0) -> tuple[list[str], list[str], list[str]]:
    """(queries, prompts, labels) of arithmetic chats whose answers have very different lengths."""
    rng = random.Random(seed)
    queries, prompts, labels = [], [], []
    for index in range(count):
        a, b = rng.randrange(100), rng.randrange(100)
        answer = " ".join(["so"] * rng.randrange(0, 12)) + f" the sum is {a + b}<|im_end|>"
        prompt, query = _chat(f"What is {a} + {b}?" + " Think." * (index % 3), answer)
        queries.append(query)
        prompts.append(prompt)
        labels.append(str(a + b))
    return queries, prompts, labels


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """`score(ids)`: a plain transformers forward of the reward model on one unpadded sequence."""
    from transformers import AutoTokenizer

    from rl_learner.models import load_value_model

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    model = load_value_model(tiny_checkpoint, dtype=torch.float32).eval()

    def score(ids: list[int]) -> float:
        with torch.inference_mode():
            return float(model(input_ids=torch.tensor([ids])).logits[0, 0])

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    score.ids = ids
    score.tokenizer = tokenizer
    return score


def _config(checkpoint, **options) -> ServeRMConfig:
    return ServeRMConfig(
        reward_pretrain=str(checkpoint), port=0, dtype="fp32", device="cpu", batch_size=3, **options
    )


@pytest.fixture(scope="module")
def scorer(tiny_checkpoint):
    # normalize_reward on a model whose config has no mean / std: raw scores are served.
    return RewardModelScorer(_config(tiny_checkpoint, normalize_reward=True))


@pytest.fixture(scope="module")
def server(tiny_checkpoint, scorer):
    with RewardModelServer(_config(tiny_checkpoint), scorer=scorer) as running:
        yield running


def _post(url: str, body: bytes, **headers: str) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json", **headers}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _get(url: str, timeout: float = 60) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _root(server: RewardModelServer) -> str:
    return server.url.removesuffix("/get_reward")


# ----------------------------------------------------------------------------- scores


def test_remote_reward_client_gets_one_score_per_query_equal_to_a_direct_forward(server, reference):
    queries, prompts, labels = _samples(11)
    client = RemoteRewardClient(server.url, batch_size=4, max_retries=0)  # 3 requests, 2 forwards each
    output = client(queries, prompts, labels)
    assert len(output.rewards) == len(queries)
    assert len(output.scores) == len(queries)
    expected = [reference(reference.ids(query)) for query in queries]
    assert output.rewards == pytest.approx(expected, abs=ATOL, rel=0)
    assert output.scores == output.rewards
    assert len(set(output.rewards)) > 1  # the queries really are scored apart
    assert not output.fallback_indices


def test_openrlhf_query_only_bodies_are_scored_on_get_reward_and_on_root(server, reference):
    queries, _, _ = _samples(5, seed=1)
    expected = [reference(reference.ids(query)) for query in queries]
    for url in (server.url, _root(server) + "/"):
        status, answer = _post(url, json.dumps({"query": queries}).encode())
        assert status == 200
        assert answer["rewards"] == pytest.approx(expected, abs=ATOL, rel=0)
        assert answer["scores"] == answer["rewards"]
    status, answer = _post(server.url, b'{"query": []}')
    assert (status, answer["rewards"]) == (200, [])


def test_concurrent_requests_from_several_threads_each_get_their_own_scores(server, reference):
    queries, prompts, labels = _samples(24, seed=2)
    expected = {query: reference(reference.ids(query)) for query in queries}
    start = threading.Barrier(6)

    def worker(seed: int) -> list[tuple[list[str], list[float]]]:
        rng = random.Random(seed)
        client = RemoteRewardClient(server.url, batch_size=5, max_retries=0)
        start.wait()
        answers = []
        for _ in range(3):
            picked = rng.sample(range(len(queries)), rng.randrange(1, 12))
            batch = [queries[i] for i in picked]
            output = client(batch, [prompts[i] for i in picked], [labels[i] for i in picked])
            answers.append((batch, output.rewards))
        return answers

    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(worker, range(6)))
    assert sum(len(answers) for answers in results) == 18
    for answers in results:
        for batch, rewards in answers:
            assert rewards == pytest.approx([expected[query] for query in batch], abs=ATOL, rel=0)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"not json", r"request body is not valid JSON"),
        (b'["a", "b"]', r"Expected `object`, got `array`"),
        (b'{"prompts": ["a"]}', r"missing required field `query`"),
        (b'{"query": "one text"}', r"Expected `array`, got `str` - at `\$.query`"),
        (b'{"query": ["a", 3]}', r"Expected `str`, got `int` - at `\$.query\[1\]`"),
        (b'{"query": ["a", "b"], "prompts": ["a"]}', r"prompts has 1 entries but query has 2"),
        (b'{"query": ["a"], "prompts": ["a"], "labels": [1, 2]}', r"labels has 2 entries but query has 1"),
        (b'{"query": [""]}', r"query\[0\]: the text '' has no tokens"),
    ],
)
def test_a_bad_body_gets_400_with_a_message_and_the_server_keeps_serving(server, body, message):
    status, answer = _post(server.url, body)
    assert status == 400
    assert set(answer) == {"error"}
    assert re.search(message, answer["error"]), answer["error"]
    status, answer = _post(server.url, b'{"query": ["fine"]}')
    assert status == 200
    assert len(answer["rewards"]) == 1


def test_the_client_reports_a_400_without_retrying(server):
    client = RemoteRewardClient(server.url, max_retries=3)
    with pytest.raises(RemoteRewardError, match=r"HTTP 400 .*has no tokens"):
        client([""], [""], [None])
    assert client.num_retries == 0


def test_an_oversized_body_gets_413_and_another_path_404(tiny_checkpoint, scorer):
    with RewardModelServer(_config(tiny_checkpoint, max_body_bytes=1000), scorer=scorer) as small:
        status, answer = _post(small.url, json.dumps({"query": ["x" * 5000]}).encode())
        assert status == 413
        assert "over the limit of 1000" in answer["error"]
        status, answer = _post(small.url, json.dumps({"query": ["x" * 100]}).encode())
        assert status == 200
        status, answer = _post(_root(small) + "/score", b'{"query": ["a"]}')
        assert status == 404
        assert "/get_reward" in answer["error"]
        assert _get(_root(small) + "/nothing")[0] == 404


def test_the_server_binds_to_loopback_by_default_and_reports_health(tiny_checkpoint, scorer, server):
    assert ServeRMConfig(reward_pretrain="m").host == "127.0.0.1"
    with RewardModelServer(
        ServeRMConfig(reward_pretrain=str(tiny_checkpoint), port=0), scorer=scorer
    ) as default:
        assert default.address[0] == "127.0.0.1"
        assert default.url.startswith("http://127.0.0.1:")
    assert _post(server.url, b'{"query": ["counted"]}')[0] == 200  # whatever ran before this test
    status, health = _get(_root(server) + "/health")
    assert status == 200
    assert health["status"] == "ok"
    assert health["model"] == str(tiny_checkpoint)
    assert health["normalize_reward"] is False  # asked for, but the config holds no mean / std
    assert health["requests"] >= 1
    assert health["samples"] >= 1


# ----------------------------------------------------------------------------- what is scored


def test_truncation_keeps_the_first_or_last_max_len_tokens(tiny_checkpoint, reference):
    queries, _, _ = _samples(4, seed=3)
    for side in ("right", "left"):
        scorer = RewardModelScorer(_config(tiny_checkpoint, max_len=7, truncation_side=side))
        ids = [reference.ids(query) for query in queries]
        kept = [row[:7] if side == "right" else row[-7:] for row in ids]
        assert all(len(row) > 7 for row in ids)
        assert scorer.score(queries) == pytest.approx([reference(row) for row in kept], abs=ATOL, rel=0)
        assert scorer.health()["truncated"] == len(queries)


def test_append_eos_and_normalize_reward_use_the_eos_token_and_the_config_mean_and_std(
    tiny_checkpoint, reference, tmp_path
):
    folder = tmp_path / "rm"
    shutil.copytree(tiny_checkpoint, folder)
    config_file = folder / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "mean": 0.25, "std": 0.5}))
    scorer = RewardModelScorer(_config(folder, append_eos=True, normalize_reward=True, max_len=6))
    eos, pad = reference.tokenizer.eos_token_id, reference.tokenizer.pad_token_id
    texts = ["<|im_start|>user\nhi", "a b<|im_end|><|endoftext|>", "one two three four five six seven"]
    expected = []
    for text in texts:
        ids = reference.ids(text)
        while ids and ids[-1] in (eos, pad):
            ids.pop()
        expected.append((reference([*ids[:5], eos]) - 0.25) / 0.5)
    assert scorer.health()["normalize_reward"] is True
    assert scorer.score(texts) == pytest.approx(expected, abs=ATOL, rel=0)
    # an empty text still has its eos to score
    assert scorer.score([""]) == pytest.approx([(reference([eos]) - 0.25) / 0.5], abs=ATOL, rel=0)


# ----------------------------------------------------------------------------- command line


def test_the_command_line_takes_options_a_config_file_and_prints_the_config(tmp_path, capsys):
    settings = tmp_path / "serve.yaml"
    settings.write_text("reward_pretrain: /models/rm\nbatch_size: 8\n")
    code = main(
        ["serve-rm", "--config", str(settings), "--port", "0", "--normalize_reward", "--print-config"]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "reward_pretrain: /models/rm\n" in printed
    assert "batch_size: 8\n" in printed
    assert "port: 0\n" in printed
    assert "host: 127.0.0.1\n" in printed
    assert "normalize_reward: true\n" in printed
    config = load_config(ServeRMConfig, None, {"reward_pretrain": "m", "append_eos": "true"})
    assert config.append_eos is True
    assert config.max_len == 2048


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], r"reward_pretrain: None must name the reward model folder"),
        (["--reward_pretrain", "m", "--port", "70000"], r"port: 70000 must be <= 65535"),
        (["--reward_pretrain", "m", "--batch_size", "0"], r"batch_size: 0 must be >= 1"),
        (["--reward_pretrain", "m", "--prt", "1"], r"prt: unknown option.*did you mean port"),
        (
            ["--reward_pretrain", "m", "--truncation_side", "middle"],
            r"truncation_side: 'middle' is not one of",
        ),
    ],
)
def test_bad_options_exit_2_before_loading_anything(argv, message, capsys):
    assert main(["serve-rm", *argv]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_missing_model_folder_exits_1_with_the_path(tmp_path, capsys):
    assert main(["serve-rm", "--reward_pretrain", str(tmp_path / "absent"), "--port", "0"]) == 1
    assert str(tmp_path / "absent") in capsys.readouterr().err


def test_append_eos_needs_room_for_a_token():
    with pytest.raises(ConfigError, match=r"max_len: 1 must be >= 2 with append_eos"):
        ServeRMConfig(reward_pretrain="m", append_eos=True, max_len=1)


# ----------------------------------------------------------------------------- unattended use


def _slow_client(address: tuple[str, int], head: bytes) -> socket.socket:
    """A connection that sent `head` and then nothing: it would hold a thread for ever."""
    sock = socket.create_connection(address, timeout=30)
    sock.sendall(head)
    return sock


def test_health_answers_while_slow_and_huge_clients_hold_connections(tiny_checkpoint, scorer):
    # More stalled clients than the 8 threads of the old server, each silent for far longer than
    # the bound asserted; a huge body is refused without being read.
    config = _config(tiny_checkpoint, request_timeout_s=600.0, max_body_bytes=1000)
    with RewardModelServer(config, scorer=scorer) as running:
        stalled = [
            _slow_client(running.address, b"POST /get_reward HTTP/1.1\r\nContent-Len") for _ in range(6)
        ]
        stalled += [
            _slow_client(running.address, b"POST /get_reward HTTP/1.1\r\nContent-Length: 5000\r\n\r\n{")
            for _ in range(6)
        ]
        try:
            status, _ = _post(running.url, b'{"query": ["' + b"x" * 20000 + b'"]}')
            assert status == 413
            started = time.monotonic()
            status, health = _get(_root(running) + "/health", timeout=10)
            took = time.monotonic() - started
            assert (status, health["status"]) == (200, "ok")
            assert took < 5.0
            assert _post(running.url, b'{"query": ["still scoring"]}')[0] == 200
        finally:
            for sock in stalled:
                sock.close()


def test_a_request_that_trickles_in_is_dropped_at_its_deadline(tiny_checkpoint, scorer):
    # Old behaviour: request_timeout_s bounded each read, so a byte every 0.1 s kept it forever.
    with RewardModelServer(_config(tiny_checkpoint, request_timeout_s=1.0), scorer=scorer) as running:
        sock = _slow_client(running.address, b"POST /get_reward HTTP/1.1\r\nContent-Length: 100000\r\n\r\n")
        sock.settimeout(0.1)
        started = time.monotonic()
        try:
            while time.monotonic() - started < 600:  # far longer than the bound asserted below
                try:
                    sock.sendall(b"x")
                    if sock.recv(1) == b"":  # the server closed the connection
                        break
                except TimeoutError:
                    continue
                except OSError:  # reset by the server
                    break
        finally:
            sock.close()
        assert time.monotonic() - started < 30


def test_too_many_queries_get_413_and_a_full_queue_503(tiny_checkpoint, scorer):
    config = _config(tiny_checkpoint, max_queries=3, max_queue=1)
    with RewardModelServer(config, scorer=scorer) as running:
        status, answer = _post(running.url, json.dumps({"query": ["a"] * 4}).encode())
        assert status == 413
        assert "4 queries in one request, more than 3 (max_queries)" in answer["error"]
        with ThreadPoolExecutor(max_workers=1) as pool:
            with scorer.lock:  # the model is busy
                waiting = pool.submit(_post, running.url, b'{"query": ["first"]}')
                deadline = time.monotonic() + 30
                while running.httpd.queue._value and time.monotonic() < deadline:
                    time.sleep(0.01)
                status, answer = _post(running.url, b'{"query": ["second"]}')
                assert status == 503
                assert "max_queue" in answer["error"]
            assert waiting.result(timeout=60)[0] == 200


def test_a_nan_score_gets_500_naming_the_query_not_200_with_null(server, scorer, monkeypatch):
    monkeypatch.setattr(scorer, "forward", lambda rows: [0.5, float("nan"), float("inf")][: len(rows)])
    status, answer = _post(server.url, json.dumps({"query": ["a", "b", "c"]}).encode())
    assert status == 500
    assert re.search(r"query\[1\] nan \(not a finite number\); 2 of 3 scores", answer["error"]), answer
    client = RemoteRewardClient(server.url, max_retries=0)
    with pytest.raises(RemoteRewardError, match=r"query\[1\] nan"):
        client(["a", "b"], ["", ""], [None, None])


def test_a_failing_forward_answers_500_without_the_exception_text(server, scorer, monkeypatch):
    def broken(rows):
        raise RuntimeError("secret path /home/someone/model.bin")

    monkeypatch.setattr(scorer, "forward", broken)
    status, answer = _post(server.url, b'{"query": ["a"]}')
    assert status == 500
    assert "secret" not in answer["error"]
    assert re.fullmatch(
        r"scoring failed: internal error [0-9a-f]{12} \(details in the server's log\)", answer["error"]
    )


def test_with_api_key_env_a_request_without_the_key_gets_401(tiny_checkpoint, scorer, monkeypatch):
    monkeypatch.setenv("RM_TEST_KEY", "s3cret-key")
    with RewardModelServer(_config(tiny_checkpoint, api_key_env="RM_TEST_KEY"), scorer=scorer) as guarded:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-key"}):
            status, answer = _post(guarded.url, b'{"query": ["a"]}', **headers)
            assert status == 401, headers
            assert "Authorization: Bearer <key>" in answer["error"]
            assert "s3cret" not in answer["error"]
        assert _get(_root(guarded) + "/health")[0] == 401
        status, answer = _post(guarded.url, b'{"query": ["a"]}', Authorization="Bearer s3cret-key")
        assert (status, len(answer["rewards"])) == (200, 1)
        # the header the launcher's --reward.headers_env.Authorization VAR sends
        client = RemoteRewardClient(
            guarded.url, max_retries=0, headers={"Authorization": "Bearer s3cret-key"}
        )
        assert len(client(["a", "b"], ["", ""], [None, None]).rewards) == 2
        with pytest.raises(RemoteRewardError, match="HTTP 401"):
            RemoteRewardClient(guarded.url, max_retries=0)(["a"], [""], [None])


def test_api_key_env_must_be_set_and_be_a_variable_name(tiny_checkpoint, monkeypatch, capsys):
    monkeypatch.delenv("RM_ABSENT_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"api_key_env: the environment variable RM_ABSENT_KEY is not set"):
        ServeRMConfig(reward_pretrain="m", api_key_env="RM_ABSENT_KEY").api_key()
    with pytest.raises(ConfigError, match=r"api_key_env: '<hidden>' must be the NAME"):
        ServeRMConfig(reward_pretrain="m", api_key_env="Bearer abc")
    argv = ["serve-rm", "--reward_pretrain", str(tiny_checkpoint), "--api_key_env", "RM_ABSENT_KEY"]
    assert main(argv) == 2
    assert "RM_ABSENT_KEY is not set" in capsys.readouterr().err
