"""Tiny reward servers for the launcher tests: OpenRLHF's HTTP API on 127.0.0.1, in a thread.

    POST /  {"query": [B], "prompts": [B], "labels": [B]}
      ->    {"rewards": [B x `reward`], "extra_logs": {"<name>_response_chars": [B], "<name>_requests": 1}}

Each server records the requests it answered (batch size and the Authorization header), so a test
can see that a run called it, with which header, and how its answers were batched.

`served_reward_model(checkpoint)`: the real `rl-launch serve-rm --port 0` in a subprocess.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def do_POST(self) -> None:
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        queries, prompts = body["query"], body["prompts"]
        with server.lock:
            server.requests.append({"size": len(queries), "authorization": self.headers.get("Authorization")})
        answer = {
            "rewards": [server.reward] * len(queries),
            "extra_logs": {
                f"{server.name}_response_chars": [
                    float(len(query) - len(prompt)) for query, prompt in zip(queries, prompts, strict=True)
                ],
                f"{server.name}_requests": 1,
            },
        }
        payload = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@contextlib.contextmanager
def reward_server(name: str, reward: float) -> Iterator[http.server.ThreadingHTTPServer]:
    """A running server answering `reward` for every sample; `.url`, `.requests` on the yielded object."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    httpd.lock = threading.Lock()
    httpd.requests = []
    httpd.name, httpd.reward = name, float(reward)
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}/reward"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


@contextlib.contextmanager
def served_reward_model(checkpoint: Path, env: dict[str, str]) -> Iterator[str]:
    """`rl-launch serve-rm --port 0` of `checkpoint` (fp32, CPU) in a subprocess: its /get_reward
    URL, once the model is loaded and the port bound. Stopped with SIGTERM at the end, which it
    must exit from with code 0."""
    process = subprocess.Popen(
        [sys.executable, "-m", "rl_launch.cli", "serve-rm", "--reward_pretrain", str(checkpoint),
         "--port", "0", "--dtype", "fp32", "--device", "cpu", "--batch_size", "8"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        line = process.stdout.readline()  # printed once the model is loaded and the port bound
        assert "serving" in line, (line, process.poll(), process.stderr.read() if process.poll() else "")
        url = line.split(" at ")[1].split()[0]
        assert url.startswith("http://127.0.0.1:")
        assert url.endswith("/get_reward")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)
    assert process.returncode == 0, process.stderr.read()[-2000:]


def served_health(url: str) -> tuple[int, dict]:
    """(HTTP status, JSON body) of a served reward model's /health, given its /get_reward URL."""
    with urllib.request.urlopen(url.removesuffix("/get_reward") + "/health", timeout=60) as response:
        return response.status, json.loads(response.read())
