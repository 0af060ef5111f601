"""`rl-launch serve-rm`: a reward model behind the HTTP API that `rl_rollout.RemoteRewardClient` speaks.

    POST /get_reward (or /)  {"query": [B texts], "prompts": [B texts]?, "labels": [B any]?}
         ->  200             {"rewards": [B floats], "scores": [B floats], "extra_logs": {}}
    GET  /health         ->  200 {"status": "ok", "model": ..., counters}

The request is OpenRLHF's (`openrlhf.cli.serve_rm`): the client of this repo sends all three
fields, OpenRLHF's own clients may send only "query", so "prompts" and "labels" are optional; when
present they must have one entry per query (they are checked, not used: the model reads the query,
which is the prompt text followed by the response text). "scores" equals "rewards".

Scoring one query text q (a `ScoreRequest.query` entry):

    ids = tokenizer(q, add_special_tokens=False)      special tokens written in q map to their ids
    append_eos:  drop trailing pad / eos ids, keep max_len − 1, append eos
    else:        keep max_len ids (truncation_side right: the first ones; left: the last ones)
    r = score(h_L)                                    the score head at the last of the L ids
    normalize_reward (model config has mean, std):   r ← (r − mean) / std

Queries are sorted by length and scored in right-padded batches of `batch_size` (attention mask
on the padding, so a score does not depend on its batch-mates beyond float rounding); the score is
read at each row's own last token, never found from the pad id (pad may equal eos).

Concurrency: each connection gets its own thread, at most `num_threads` at once (one more is
answered 503 at once by the accepting thread), and its request (headers and body) must arrive
within `request_timeout_s` from the connection on, a deadline over the whole request, not per read:
slow or stalled clients are dropped then, and while they are connected /health is answered by a
thread of its own without waiting for the model. One lock serializes tokenization and the model
forward; at most `max_queue` scoring requests wait for it or hold it (one more gets 503, which the
client retries) and a request carries at most `max_queries` queries (more: 413), so a request's
wait is bounded. A lock rather than a queue that merges concurrent requests into shared batches:
the model is the bottleneck either way on one device, a request's `batch_size` batches already
keep it busy, and with a lock a request's scores depend only on that request (the RL client sends
large requests in parallel, not many tiny ones, which is where merging would pay). The tokenizer
sits under the same lock because a fast tokenizer's Rust object must not be used from two threads
at once.

Authentication: with `api_key_env NAME` every request (/health included) must carry
`Authorization: Bearer <key>`, the key being the value of the environment variable NAME when the
server starts; others get 401. The comparison is constant-time (`hmac.compare_digest`). The
launcher sends it with `--reward.headers_env.Authorization VAR` where VAR holds "Bearer <key>".

Errors answer JSON {"error": message}: 400 for a body that is not JSON, a wrong type (the message
names the field, e.g. `$.query[2]`), lengths that differ or a query without tokens; 401 without the
key; 404 for another path; 411 without Content-Length; 413 for a body over `max_body_bytes` or more
than `max_queries` queries; 500 if the forward fails (the message carries an id to find the
traceback in the server's log, never the exception's text) or the model scores a query NaN or
±inf (the message names the query's index); 503 when busy. The server keeps serving after any of
them. Bodies are decoded with msgspec into typed structs (no pickle anywhere). It binds to
127.0.0.1 unless `host` says otherwise; bound elsewhere, use `api_key_env` (see SECURITY.md).
"""

from __future__ import annotations

import contextlib
import hmac
import http.server
import io
import logging
import math
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from .config import ConfigError, Positive, PositiveInt, _fail

__all__ = [
    "RewardModelScorer",
    "RewardModelServer",
    "ScoreRequest",
    "ServeRMConfig",
    "run_command",
    "serve",
]

logger = logging.getLogger(__name__)

REWARD_PATHS = ("/get_reward", "/")
HEALTH_PATH = "/health"
# Bytes of an oversized body read and dropped before answering 413, so that the client (which
# sends the whole body before reading) gets the answer instead of a connection reset.
_DRAIN_LIMIT = 1 << 20


class ServeRMConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Serve a reward model over HTTP in OpenRLHF's format (POST /get_reward {query, prompts?,
    labels?} -> {rewards, scores}); GET /health."""

    reward_pretrain: str | None = None
    """Reward model folder: a sequence classifier with one label, or a causal LM (its backbone
    with a new score head seeded by head_seed). Required."""
    tokenizer: str | None = None
    """Tokenizer folder; None: reward_pretrain's."""
    host: str = "127.0.0.1"
    """Address to bind; 127.0.0.1 serves this machine only, 0.0.0.0 every interface (then set api_key_env)."""
    port: Annotated[int, Meta(ge=0, le=65535)] = 5000
    """TCP port; 0 picks a free one (printed at start)."""
    batch_size: PositiveInt = 16
    """Queries per model forward (a request's queries go in batches of this size)."""
    max_len: PositiveInt = 2048
    """Most tokens of a query the model reads; longer queries are truncated (see truncation_side)."""
    truncation_side: Literal["right", "left"] = "right"
    """Which end of a too-long query is cut: right keeps the first max_len tokens (as OpenRLHF),
    left keeps the last ones."""
    append_eos: bool = False
    """Strip trailing pad / eos tokens and end every query with one eos token (OpenRLHF's server
    does this; reward models trained by OpenRLHF score at that eos)."""
    normalize_reward: bool = False
    """Serve (r - mean) / std with the mean and std stored in the model's config.json; off (with
    a warning) when the config has none."""
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Weights' precision; auto = bf16 on a GPU, fp32 on CPU."""
    device: str = "auto"
    """Torch device of the model (cpu, cuda, cuda:1, ...); auto = cuda when available, else cpu."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel."""
    head_seed: int = 0
    """Seed of the new score head when reward_pretrain is a causal LM without one."""
    num_threads: PositiveInt = 64
    """Connections handled at once, each on its own thread (the forward runs one at a time); one
    more is answered HTTP 503 at once."""
    max_body_bytes: PositiveInt = 64 * 2**20
    """Largest request body accepted; a larger one gets HTTP 413."""
    max_queries: PositiveInt = 4096
    """Most queries in one request; more get HTTP 413 (split the request)."""
    max_queue: PositiveInt = 32
    """Scoring requests that may wait for the model or hold it; one more gets HTTP 503 (retried by
    the client)."""
    request_timeout_s: Positive = 60.0
    """Deadline in seconds for a request (headers and body) to arrive, from the connection on; a
    client still sending then is dropped. Scoring time is not counted."""
    api_key_env: str | None = None
    """NAME of an environment variable holding the API key: every request must then send
    `Authorization: Bearer <key>` (else HTTP 401). None: no authentication (keep host 127.0.0.1)."""

    def __post_init__(self) -> None:
        if self.reward_pretrain is None:
            _fail("reward_pretrain", None, "must name the reward model folder (--reward_pretrain PATH)")
        if not self.host:
            _fail("host", self.host, "must be an address to bind (127.0.0.1, 0.0.0.0, ::1, a host name)")
        if self.append_eos and self.max_len < 2:
            _fail("max_len", self.max_len, "must be >= 2 with append_eos (one token and the eos)")
        if self.api_key_env is not None and not _ENV_NAME.fullmatch(self.api_key_env):
            _fail(
                "api_key_env",
                "<hidden>",
                "must be the NAME of an environment variable (letters, digits, _), not the key",
            )

    def api_key(self) -> bytes | None:
        """The key that requests must send (the value of `api_key_env`), None without one.

        Raises:
          ConfigError: the variable is not set or empty.
        """
        if self.api_key_env is None:
            return None
        value = os.environ.get(self.api_key_env, "")
        if not value:
            raise ConfigError(f"api_key_env: the environment variable {self.api_key_env} is not set or empty")
        return value.encode()


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ScoreRequest(msgspec.Struct):
    """The body of POST /get_reward. Unknown fields are ignored (clients may send more)."""

    query: list[str]
    prompts: list[str] | None = None
    labels: list[Any] | None = None


class _ErrorBody(msgspec.Struct):
    error: str


class BadRequest(ValueError):
    """A request the server cannot score; answered with HTTP 400 and this message."""


class NonFiniteScore(ValueError):
    """The model scored a query NaN or ±inf; answered with HTTP 500 and this message."""


_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class RewardModelScorer:
    """The reward model and its tokenizer; `score(texts)` is safe to call from several threads.

    Args:
      config: the server's configuration (model, tokenizer, batch_size, max_len, truncation,
        append_eos, normalize_reward, dtype, device, attn_implementation, head_seed).

    Raises (while loading): FileNotFoundError / ValueError from `rl_learner.load_value_model`,
    ConfigError for append_eos with a tokenizer without an eos token.
    """

    def __init__(self, config: ServeRMConfig) -> None:
        import torch
        from transformers import AutoTokenizer

        from rl_learner.models import load_value_model

        self.config = config
        device = config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype_name = config.dtype
        if dtype_name == "auto":
            dtype_name = "bf16" if device.startswith("cuda") else "fp32"
        self.device = torch.device(device)
        self.dtype = getattr(torch, _DTYPES[dtype_name])
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.reward_pretrain)
        self.model = load_value_model(
            config.reward_pretrain,
            dtype=self.dtype,
            attn_implementation=config.attn_implementation,
            pad_token_id=self.tokenizer.pad_token_id,
            head_seed=config.head_seed,
        )
        self.model.to(self.device).eval()
        pad = self.model.config.pad_token_id
        self.pad_token_id = int(pad if pad is not None else 0)
        self.eos_token_id = self.tokenizer.eos_token_id
        if config.append_eos and self.eos_token_id is None:
            raise ConfigError(
                f"append_eos: the tokenizer of {config.tokenizer or config.reward_pretrain!r} has no eos token"
            )
        self.mean, self.std = self._normalization(self.model.config)
        self.lock = threading.Lock()
        self.num_requests = self.num_samples = self.num_truncated = 0

    def _normalization(self, model_config: Any) -> tuple[float, float]:
        """(mean, std) applied to raw scores: the config's with normalize_reward, else (0, 1)."""
        if not self.config.normalize_reward:
            return 0.0, 1.0
        mean, std = getattr(model_config, "mean", None), getattr(model_config, "std", None)
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (mean, std))
        if not numbers or not (math.isfinite(mean) and math.isfinite(std) and std > 0):
            logger.warning(
                "normalize_reward: the config of %s has no usable mean and std (mean=%r, std=%r); "
                "serving raw scores",
                self.config.reward_pretrain,
                mean,
                std,
            )
            return 0.0, 1.0
        return float(mean), float(std)

    @property
    def normalizing(self) -> bool:
        return (self.mean, self.std) != (0.0, 1.0)

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids the model reads for each text (module docstring); call under `self.lock`.

        Raises:
          BadRequest: a text without tokens (names its index).
        """
        max_len, eos = self.config.max_len, self.eos_token_id
        encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        rows = []
        for index, ids in enumerate(encoded):
            ids = list(ids)
            if self.config.append_eos:
                while ids and ids[-1] in (eos, self.tokenizer.pad_token_id):
                    ids.pop()
                keep = max_len - 1
            else:
                keep = max_len
            if not ids and not self.config.append_eos:
                raise BadRequest(f"query[{index}]: the text {texts[index][:80]!r} has no tokens to score")
            if len(ids) > keep:
                self.num_truncated += 1
                ids = ids[:keep] if self.config.truncation_side == "right" else ids[-keep:]
            rows.append([*ids, eos] if self.config.append_eos else ids)
        return rows

    def forward(self, rows: list[list[int]]) -> list[float]:
        """Raw score of each row of ids: the score head at its last token; call under `self.lock`."""
        import torch

        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        scores = [0.0] * len(rows)
        backbone = self.model.base_model
        with torch.inference_mode():
            for start in range(0, len(order), self.config.batch_size):
                chunk = order[start : start + self.config.batch_size]
                lengths = torch.tensor([len(rows[i]) for i in chunk])
                input_ids = torch.full((len(chunk), int(lengths.max())), self.pad_token_id, dtype=torch.long)
                attention_mask = torch.zeros_like(input_ids)
                for row, i in enumerate(chunk):
                    input_ids[row, : len(rows[i])] = torch.tensor(rows[i])
                    attention_mask[row, : len(rows[i])] = 1
                hidden = backbone(
                    input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device)
                ).last_hidden_state
                last = hidden[torch.arange(len(chunk), device=self.device), lengths.to(self.device) - 1]
                values = self.model.score(last)[:, 0].float().cpu().tolist()
                for i, value in zip(chunk, values, strict=True):
                    scores[i] = value
        return scores

    def score(self, texts: list[str]) -> list[float]:
        """Rewards of `texts` (normalised when normalize_reward applies), in order.

        Raises:
          BadRequest: a text without tokens.
        """
        with self.lock:
            raw = self.forward(self.encode(texts))
            self.num_requests += 1
            self.num_samples += len(texts)
        return check_finite([(value - self.mean) / self.std for value in raw])

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "model": self.config.reward_pretrain,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "batch_size": self.config.batch_size,
            "max_len": self.config.max_len,
            "normalize_reward": self.normalizing,
            "mean": self.mean,
            "std": self.std,
            "requests": self.num_requests,
            "samples": self.num_samples,
            "truncated": self.num_truncated,
        }


def check_finite(scores: list[float]) -> list[float]:
    """`scores` unchanged when every one is finite; NonFiniteScore naming the first that is not."""
    for index, value in enumerate(scores):
        if not math.isfinite(value):
            raise NonFiniteScore(
                f"the reward model scored query[{index}] {value} (not a finite number); "
                f"{sum(not math.isfinite(v) for v in scores)} of {len(scores)} scores are not finite"
            )
    return scores


def check_request(request: ScoreRequest) -> None:
    """Raise BadRequest when "prompts" or "labels" has a different length than "query"."""
    for name in ("prompts", "labels"):
        values = getattr(request, name)
        if values is not None and len(values) != len(request.query):
            raise BadRequest(
                f"{name} has {len(values)} entries but query has {len(request.query)}; expected one per query"
            )


class _DeadlineReader(io.RawIOBase):
    """A socket's bytes, each read bounded by what is left until `deadline` (time.monotonic)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the request did not arrive within request_timeout_s")
        self.sock.settimeout(remaining)
        return self.sock.recv_into(buffer)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _PooledHTTPServer
    server_version = "rl-launch-serve-rm"
    _encoder = msgspec.json.Encoder()
    _decoder = msgspec.json.Decoder(ScoreRequest)

    def setup(self) -> None:
        # The request (line, headers, body) must arrive before one deadline: a per-read timeout
        # lets a client that sends a byte now and then hold the thread for ever.
        self.connection = self.request
        self.rfile = io.BufferedReader(
            _DeadlineReader(self.connection, time.monotonic() + self.server.request_timeout_s)
        )
        self.wfile = self.connection.makefile("wb")  # flushed by finish()

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    def _answer(self, code: int, body: Any, headers: tuple[tuple[str, str], ...] = ()) -> None:
        payload = self._encoder.encode(body)
        self.connection.settimeout(self.server.request_timeout_s)  # a client that never reads
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)

    def _error(self, code: int, message: str, headers: tuple[tuple[str, str], ...] = ()) -> None:
        logger.info("HTTP %d to %s: %s", code, self.address_string(), message)
        self._answer(code, _ErrorBody(error=message), headers)

    def _authorized(self) -> bool:
        """Whether the request carries the key (always, without api_key_env); answers 401 if not."""
        key = self.server.api_key
        if key is None:
            return True
        scheme, _, given = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key):
            return True
        self._drain()
        self._error(
            401,
            "missing or wrong API key: send the header 'Authorization: Bearer <key>' (the server's api_key_env)",
            (("WWW-Authenticate", "Bearer"),),
        )
        self.close_connection = True
        return False

    def _drain(self) -> None:
        """Read and drop a small body, so that a client that sends it before reading gets the answer."""
        with contextlib.suppress(ValueError, OSError):
            length = int(self.headers.get("Content-Length", "0"))
            if 0 < length <= _DRAIN_LIMIT:
                self.rfile.read(length)

    def do_GET(self) -> None:
        if not self._authorized():
            return
        path = self.path.partition("?")[0]
        if path == HEALTH_PATH:
            self._answer(200, self.server.scorer.health())
        else:
            self._error(404, f"no such path {path!r}; GET {HEALTH_PATH}, POST {' or '.join(REWARD_PATHS)}")

    def _read_body(self) -> bytes | None:
        """The request's body, or None after answering why it is refused (411, 400, 413)."""
        length_text = self.headers.get("Content-Length")
        if length_text is None:
            self._error(411, "a Content-Length header is required (chunked bodies are not accepted)")
            return None
        try:
            length = int(length_text)
            if length < 0:
                raise ValueError
        except ValueError:
            self._error(400, f"Content-Length {length_text!r} is not a byte count")
            return None
        limit = self.server.max_body_bytes
        if length > limit:
            if length <= limit + _DRAIN_LIMIT:
                self.rfile.read(length)
            self._error(413, f"request body of {length} bytes is over the limit of {limit} (max_body_bytes)")
            self.close_connection = True
            return None
        return self.rfile.read(length)

    def do_POST(self) -> None:
        if not self._authorized():
            return
        path = self.path.partition("?")[0]
        try:
            body = self._read_body()
        except TimeoutError:
            logger.info(
                "dropped %s: its request did not arrive within request_timeout_s", self.address_string()
            )
            self.close_connection = True
            return
        if body is None:
            return
        if path not in REWARD_PATHS:
            self._error(404, f"no such path {path!r}; POST {' or '.join(REWARD_PATHS)}, GET {HEALTH_PATH}")
            return
        try:
            request = self._decoder.decode(body)
        except msgspec.ValidationError as error:
            self._error(400, f"bad request body: {error}")
            return
        except msgspec.DecodeError as error:
            self._error(400, f"request body is not valid JSON: {error} (starts {body[:60]!r})")
            return
        if len(request.query) > self.server.max_queries:
            self._error(
                413,
                f"{len(request.query)} queries in one request, more than {self.server.max_queries} "
                "(max_queries); split it",
            )
            return
        self._score(request)

    def _score(self, request: ScoreRequest) -> None:
        from rl_rollout.remote import RewardResponse

        if not self.server.queue.acquire(blocking=False):
            self._error(
                503,
                f"busy: {self.server.max_queue} requests already wait for the model (max_queue); retry later",
            )
            return
        try:
            check_request(request)
            rewards = self.server.scorer.score(request.query)
        except BadRequest as error:
            self._error(400, str(error))
            return
        except NonFiniteScore as error:
            logger.error("%s", error)
            self._error(500, str(error))
            return
        except Exception:  # any failure: answer 500 and keep serving; the details stay in the log
            incident = uuid.uuid4().hex[:12]
            logger.exception(
                "scoring a batch of %d queries failed (incident %s)", len(request.query), incident
            )
            self._error(500, f"scoring failed: internal error {incident} (details in the server's log)")
            return
        finally:
            self.server.queue.release()
        self._answer(200, RewardResponse(rewards=rewards, scores=list(rewards), extra_logs={}))


_BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Content-Length: 72\r\n\r\n"
    b'{"error":"busy: every connection thread is taken (num_threads); retry"}\n'
)


class _PooledHTTPServer(http.server.HTTPServer):
    """An HTTPServer whose connections run on a bounded pool of threads (not one new thread each,
    without bound); a connection beyond `num_threads` is answered 503 by the accepting thread."""

    def __init__(self, address: tuple[str, int], scorer: RewardModelScorer, config: ServeRMConfig) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.scorer = scorer
        self.max_body_bytes = config.max_body_bytes
        self.max_queries = config.max_queries
        self.max_queue = config.max_queue
        self.request_timeout_s = config.request_timeout_s
        self.api_key = config.api_key()
        self.queue = threading.BoundedSemaphore(config.max_queue)
        self.connections = threading.BoundedSemaphore(config.num_threads)
        self.pool = ThreadPoolExecutor(max_workers=config.num_threads, thread_name_prefix="serve-rm")
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.connections.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.settimeout(0.5)
                request.sendall(_BUSY)
            self.shutdown_request(request)
            return
        self.pool.submit(self._process, request, client_address)

    def _process(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # a broken connection must not end the worker
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self.connections.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.warning("connection from %s failed", client_address, exc_info=True)

    def server_close(self) -> None:
        super().server_close()
        self.pool.shutdown(wait=False, cancel_futures=True)


class RewardModelServer:
    """A bound reward-model server: `serve_forever()` in this thread, or `start()` in a daemon one.

        with RewardModelServer(config) as server:   # loads the model, binds, serves in a thread
            client = RemoteRewardClient(server.url)

    `scorer`: an already loaded `RewardModelScorer` (several servers may share one); default: load
    the model of `config`.
    """

    def __init__(self, config: ServeRMConfig, scorer: RewardModelScorer | None = None) -> None:
        self.config = config
        self.scorer = scorer if scorer is not None else RewardModelScorer(config)
        self.httpd = _PooledHTTPServer((config.host, config.port), self.scorer, config)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        """(bound address, bound port): the port the system picked when `port` was 0."""
        host, port = self.httpd.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        """http://host:port/get_reward, the URL to give `reward.remote_url`."""
        host, port = self.address
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}{REWARD_PATHS[0]}"

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def start(self) -> RewardModelServer:
        self._thread = threading.Thread(target=self.serve_forever, name="serve-rm", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
            self._thread = None
        self.httpd.server_close()

    def __enter__(self) -> RewardModelServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(config: ServeRMConfig, *, prog: str = "rl-launch serve-rm") -> int:
    """Load the model, bind, print the URL and serve until interrupted; the exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    server = RewardModelServer(config)
    host, _ = server.address
    if host not in ("127.0.0.1", "::1", "localhost") and config.api_key_env is None:
        print(
            f"{prog}: warning: bound to {host} without api_key_env; anyone who reaches it can query the model",
            file=sys.stderr,
        )
    print(
        f"{prog}: serving {config.reward_pretrain} at {server.url} (health: GET {HEALTH_PATH}; "
        f"loaded in {time.monotonic() - started:.1f} s)",
        flush=True,
    )
    if threading.current_thread() is threading.main_thread():
        # SIGTERM (kill, a process manager) ends the server as cleanly as Ctrl-C, with exit code 0.
        signal.signal(signal.SIGTERM, _raise_stop)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except _Stop:
        print(f"{prog}: stopped (SIGTERM)", file=sys.stderr)
    finally:
        server.close()
    return 0


class _Stop(Exception):
    """Raised in the main thread by the SIGTERM handler of `serve`."""


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop


def run_command(parser: Any, args: Any, extras: list[str]) -> int:
    """`rl-launch serve-rm`: the config from --config and the options, then `serve` (or print it).

    A bad option or value prints `rl-launch serve-rm: error: <message>` and returns 2 before the
    model loads; a model that cannot be loaded returns 1 with the loader's message.
    """
    from .command import run_command
    from .options import check_unknown_args, load_config, overrides_from_namespace

    def resolve() -> ServeRMConfig:
        check_unknown_args(ServeRMConfig, extras)
        config = load_config(ServeRMConfig, args.config, overrides_from_namespace(ServeRMConfig, args))
        if not args.print_config:
            config.api_key()  # a missing key variable fails before the model loads
        return config

    def run(config: ServeRMConfig) -> int:
        from .preflight import settle_attention

        config, attention_note = settle_attention(config, section=None)
        if attention_note is not None:
            print(f"{parser.prog}: {attention_note}", file=sys.stderr)
        try:
            return serve(config, prog=parser.prog)
        except (OSError, ValueError) as error:  # a missing / wrong model folder, a port in use
            print(f"{parser.prog}: error: {error}", file=sys.stderr)
            return 1

    return run_command(parser.prog, resolve, args.print_config, run)
