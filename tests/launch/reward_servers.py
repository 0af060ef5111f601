"""Tiny reward servers for the launcher tests: OpenRLHF's HTTP API on 127.0.0.1, in a thread.

    POST /  {"query": [B], "prompts": [B], "labels": [B]}
      ->    {"rewards": [B x `reward`], "extra_logs": {"<name>_response_chars": [B], "<name>_requests": 1}}

Each server records the requests it answered (batch size and the Authorization header), so a test
can see that a run called it, with which header, and how its answers were batched.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from collections.abc import Iterator


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
