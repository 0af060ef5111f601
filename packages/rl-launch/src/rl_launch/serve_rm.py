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

Concurrency: a fixed pool of `num_threads` handler threads reads, parses and answers requests in
parallel, while one lock serializes tokenization and the model forward. A lock rather than a
queue that merges concurrent requests into shared batches: the model is the bottleneck either
way on one device, a request's `batch_size` batches already keep it busy, and with a lock a
request's scores depend only on that request (the RL client sends large requests in parallel,
not many tiny ones, which is where merging would pay). The tokenizer sits under the same lock
because a fast tokenizer's Rust object must not be used from two threads at once.

Errors answer JSON {"error": message}: 400 for a body that is not JSON, a wrong type (the message
names the field, e.g. `$.query[2]`), lengths that differ or a query without tokens; 404 for
another path; 411 without Content-Length; 413 for a body over `max_body_bytes`; 500 if the
forward fails. The server keeps serving after any of them. Bodies are decoded with msgspec into
typed structs (no pickle anywhere). It binds to 127.0.0.1 unless `host` says otherwise: it has
no authentication.
"""

from __future__ import annotations

import http.server
import logging
import math
import signal
import socket
import sys
import threading
import time
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
    """Address to bind; 127.0.0.1 serves this machine only (there is no authentication), 0.0.0.0 every interface."""
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
    num_threads: PositiveInt = 8
    """Request handler threads (requests answered concurrently; the forward runs one at a time)."""
    max_body_bytes: PositiveInt = 64 * 2**20
    """Largest request body accepted; a larger one gets HTTP 413."""
    request_timeout_s: Positive = 60.0
    """Seconds a connection may stay silent while its request is read before it is dropped."""

    def __post_init__(self) -> None:
        if self.reward_pretrain is None:
            _fail("reward_pretrain", None, "must name the reward model folder (--reward_pretrain PATH)")
        if not self.host:
            _fail("host", self.host, "must be an address to bind (127.0.0.1, 0.0.0.0, ::1, a host name)")
        if self.append_eos and self.max_len < 2:
            _fail("max_len", self.max_len, "must be >= 2 with append_eos (one token and the eos)")


class ScoreRequest(msgspec.Struct):
    """The body of POST /get_reward. Unknown fields are ignored (clients may send more)."""

    query: list[str]
    prompts: list[str] | None = None
    labels: list[Any] | None = None


class _ErrorBody(msgspec.Struct):
    error: str


class BadRequest(ValueError):
    """A request the server cannot score; answered with HTTP 400 and this message."""


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
        return [(value - self.mean) / self.std for value in raw]

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


def check_request(request: ScoreRequest) -> None:
    """Raise BadRequest when "prompts" or "labels" has a different length than "query"."""
    for name in ("prompts", "labels"):
        values = getattr(request, name)
        if values is not None and len(values) != len(request.query):
            raise BadRequest(
                f"{name} has {len(values)} entries but query has {len(request.query)}; expected one per query"
            )


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _PooledHTTPServer
    server_version = "rl-launch-serve-rm"
    _encoder = msgspec.json.Encoder()
    _decoder = msgspec.json.Decoder(ScoreRequest)

    def setup(self) -> None:
        self.timeout = self.server.request_timeout_s
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    def _answer(self, code: int, body: Any) -> None:
        payload = self._encoder.encode(body)
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _error(self, code: int, message: str) -> None:
        logger.info("HTTP %d to %s: %s", code, self.address_string(), message)
        self._answer(code, _ErrorBody(error=message))

    def do_GET(self) -> None:
        path = self.path.partition("?")[0]
        if path == HEALTH_PATH:
            self._answer(200, self.server.scorer.health())
        else:
            self._error(404, f"no such path {path!r}; GET {HEALTH_PATH}, POST {' or '.join(REWARD_PATHS)}")

    def do_POST(self) -> None:
        from rl_rollout.remote import RewardResponse

        path = self.path.partition("?")[0]
        length_text = self.headers.get("Content-Length")
        if length_text is None:
            self._error(411, "a Content-Length header is required (chunked bodies are not accepted)")
            return
        try:
            length = int(length_text)
            if length < 0:
                raise ValueError
        except ValueError:
            self._error(400, f"Content-Length {length_text!r} is not a byte count")
            return
        limit = self.server.max_body_bytes
        if length > limit:
            if length <= limit + _DRAIN_LIMIT:
                self.rfile.read(length)
            self._error(413, f"request body of {length} bytes is over the limit of {limit} (max_body_bytes)")
            self.close_connection = True
            return
        body = self.rfile.read(length)
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
        try:
            check_request(request)
            rewards = self.server.scorer.score(request.query)
        except BadRequest as error:
            self._error(400, str(error))
            return
        except Exception as error:  # any failure: answer 500 and keep serving
            logger.exception("scoring a batch of %d queries failed", len(request.query))
            self._error(500, f"scoring failed: {type(error).__name__}: {error}")
            return
        self._answer(200, RewardResponse(rewards=rewards, scores=list(rewards), extra_logs={}))


class _PooledHTTPServer(http.server.HTTPServer):
    """An HTTPServer whose requests run on a fixed pool of threads (not one new thread each)."""

    def __init__(self, address: tuple[str, int], scorer: RewardModelScorer, config: ServeRMConfig) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.scorer = scorer
        self.max_body_bytes = config.max_body_bytes
        self.request_timeout_s = config.request_timeout_s
        self.pool = ThreadPoolExecutor(max_workers=config.num_threads, thread_name_prefix="serve-rm")
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        self.pool.submit(self._process, request, client_address)

    def _process(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # a broken connection must not end the worker
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)

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
    if host not in ("127.0.0.1", "::1", "localhost"):
        print(f"{prog}: warning: bound to {host}; anyone who reaches it can query the model", file=sys.stderr)
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
    from .options import check_unknown_args, dump_config, load_config, overrides_from_namespace

    try:
        check_unknown_args(ServeRMConfig, extras)
        config = load_config(ServeRMConfig, args.config, overrides_from_namespace(ServeRMConfig, args))
    except (ConfigError, FileNotFoundError) as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(dump_config(config))
        return 0
    from .preflight import settle_attention

    config, attention_note = settle_attention(config, section=None)
    if attention_note is not None:
        print(f"{parser.prog}: {attention_note}", file=sys.stderr)
    try:
        return serve(config, prog=parser.prog)
    except (OSError, ValueError) as error:  # a missing / wrong model folder, a port in use
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 1
