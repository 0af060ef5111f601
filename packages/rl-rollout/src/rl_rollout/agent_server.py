"""An OpenAI-compatible HTTP server over any `Engine`, with exact token capture per session.

Agent code written against the OpenAI API (the `openai` client, or plain HTTP) drives the policy
through this server; the server keeps, per session, the exact token ids the engine consumed and
produced, so a session is a training trajectory without ever re-tokenising text:

    with AgentServer(engine, tokenizer, SamplingParams(max_new_tokens=64)) as server:
        session = server.open_session()
        ...  POST {server.url}/v1/chat/completions  (header X-Session-ID: session) ...
        record = server.close_session(session)    # SessionRecord: ids, log-probs, action mask

Routes (bound to 127.0.0.1 on a free port; errors are OpenAI-shaped JSON,
`{"error": {"message", "type", "param", "code"}}`, whose message names the field):
- `POST /v1/chat/completions`: model, messages, max_tokens (or max_completion_tokens),
  temperature, top_p, seed, stop, n (1 only), logprobs, top_logprobs (0 only: engines report the
  sampled token's log-prob, no alternatives), tools, tool_choice ("auto" / "none"), and the
  session: `session_id` in the body (the `openai` client's `extra_body`) or the `X-Session-ID`
  header. Fields the server does not honour are refused, not ignored.
- `GET /v1/models`, `POST /tokenize` (`{"messages"}` or `{"prompt"}` -> token ids), `GET /health`.

Authentication and load (checked before any route, in this order):
- `api_key_env` NAME: every request (/health included) must carry `Authorization: Bearer <key>`,
  the key being the value of the environment variable NAME when the server is built (unset or
  empty: refused then, naming NAME); others get 401, code "invalid_api_key", whose message never
  holds a key. The comparison is constant-time (`hmac.compare_digest`). `AgentServerExecutor`
  hands the key to each episode's `openai` client (`api_key`, and the `Authorization` header in
  `client.default_headers`), so agents need no change.
- `max_queue`: chat completions and /tokenize requests in flight or waiting at once; one more is
  answered 503 at once, code "busy", with `Retry-After: 1`. GET routes are never refused for load.
  `refusals` counts both kinds of refusal since the last `start()` (the executor reports them as
  `rollout/server_busy` and `rollout/server_unauthorized`).

Sessions and delta tokenisation. A session's buffer h is the exact ids the engine saw and wrote.
Request k carries the whole conversation so far, messages Mₖ:
- k = 0: h = tokens(template(M₀, tools, generation prompt)); these ids are the trajectory's prompt.
- k > 0: Mₖ must extend the session's history Hₖ = Mₖ₋₁ + [the assistant reply it was sent]
  (compared on role, content, tool calls, tool_call_id, name). Only the new messages Mₖ[|Hₖ|:]
  are rendered: the chat template's text after an assistant turn, for those messages and the
  generation prompt (an end-of-turn token the engine already wrote is not repeated); that text
  is tokenised once and appended with action mask 0. Earlier turns are never re-tokenised, so
  templates that rewrite earlier turns (reasoning dropped from old assistant messages) change
  nothing in the buffer.
- A request whose messages do not extend the history (an edited or shortened conversation, other
  tools) is refused with 400, code "history_mismatch", naming the first message that differs:
  a session is one trajectory. Open a new session for a new conversation.

Rewritten histories (`history="segments"`). Templates of thinking models (Qwen3) drop the
reasoning of assistant turns before the last user message, and agents often send replies back
without it: request k's prompt is then not an extension of the tokens so far. With
`history="segments"` every request is rendered whole, P = template(Mₖ, tools, generation prompt),
as the model would see it at inference, and compared as text with the session's current segment
S (its prompt's rendering, then each reply decoded with special tokens, then each delta):
- P starts with S: the segment goes on; only P[|S|:] is tokenised (mask 0), as above;
- otherwise the segment is closed and P's tokens open a new one (its own prompt).
A session is then a list of segments, each exact token-in/token-out (`SessionRecord.segments`
holds the closed ones, oldest first; the record's own fields are the last). An append-only
template never opens a second segment, unless the client edits what it sends back.
- The engine's reply aₖ is appended with action mask 1 and its log-probs; its finish reason and
  policy versions are kept. A request that would not fit max_length is refused with 400,
  code "context_length_exceeded", and marks the session truncated (finish reason "length").

Tool calls (`tool_parser`, a name in `rl_rollout.tools.TOOL_PARSERS`, default "hermes"): with
`tools` in the request, the reply text is parsed; the calls become `message.tool_calls` (content
without the call markup) and finish_reason "tool_calls". `role: tool` messages are rendered by
the chat template like any other new message.
"""

# No `from __future__ import annotations`: FastAPI reads the route functions' annotations
# (`request: Request`, imported inside `_app`) at run time.

import asyncio
import hmac
import json
import logging
import math
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

import msgspec

from .protocol import Engine, EngineError, Generation, SamplingParams

__all__ = ["HISTORY_MODES", "AgentServer", "ServerError", "SessionRecord", "require_agent_extra"]

logger = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"
HISTORY_MODES = ("append", "segments")
"""How a session takes request k > 0: "append" (its messages extend the history, else refused with
history_mismatch) or "segments" (rendered whole; a rendering that does not extend the current
segment opens a new one). See the module docstring."""
ROLES = ("system", "user", "assistant", "tool")
# Chat-completion fields the server honours, and those it accepts because they change nothing here.
CHAT_FIELDS = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "n",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "stream",
        "session_id",
        "user",
        "parallel_tool_calls",
    }
)
_MARKER = "\ue000"  # a private-use character: where an assistant turn's content goes in a rendering


def require_agent_extra() -> None:
    """Fail with what to install when the `agents` extra (fastapi, uvicorn, openai) is missing."""
    missing = []
    for module in ("fastapi", "uvicorn", "openai"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise ImportError(
            f"the agent server needs {', '.join(missing)}: install rl-rollout[agents] "
            "(pip install 'rl-rollout[agents]')"
        )


class ServerError(Exception):
    """A request the server refuses: HTTP status, OpenAI error type and code, the field at fault."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = {
            400: "invalid_request_error",
            401: "invalid_request_error",
            404: "not_found_error",
            409: "conflict_error",
            413: "invalid_request_error",
        }.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class SessionRecord(msgspec.Struct, kw_only=True):
    """What one session captured: its first prompt's ids, then everything after them.

    response_ids: `[R]` the engine's replies and the environment's deltas (new messages rendered
    by the chat template), in order. action_mask: `[R]` 1 on tokens the engine generated, 0 on
    deltas. logprobs: `[R]` the engine's log-probs on generated tokens, 0.0 on deltas (None when
    the engine returned none). versions: `[R]` the policy version of each token (a delta takes
    the version of the reply before it). finish_reasons: one per reply. action_ranges:
    (start, end) of each reply in response_ids. truncated: a request was refused for max_length.
    used_tools: a request offered tools. tool_calls / tool_call_errors: well-formed and malformed
    calls the parser read in the replies (a reply with only malformed calls goes back as plain
    content). segments: under history="segments", the segments closed before this one (each a
    `SessionRecord` of its own prompt and replies, no segments of its own), oldest first; the
    record's own ids, masks and replies are the last segment's.
    """

    session_id: str
    prompt_ids: list[int] = msgspec.field(default_factory=list)
    response_ids: list[int] = msgspec.field(default_factory=list)
    action_mask: list[bool] = msgspec.field(default_factory=list)
    logprobs: list[float] | None = msgspec.field(default_factory=list)
    versions: list[int] = msgspec.field(default_factory=list)
    finish_reasons: list[str] = msgspec.field(default_factory=list)
    action_ranges: list[tuple[int, int]] = msgspec.field(default_factory=list)
    policy_version: int = 0
    truncated: bool = False
    used_tools: bool = False
    tool_calls: int = 0
    tool_call_errors: int = 0
    segments: list[Any] = msgspec.field(default_factory=list)

    @property
    def requests(self) -> int:
        """Replies the engine wrote in this session (every segment's)."""
        return len(self.finish_reasons) + sum(len(s.finish_reasons) for s in self.segments)

    def all_segments(self) -> list["SessionRecord"]:
        """The session's segments in order: the closed ones, then this record (the last)."""
        return [*self.segments, self]

    def close_segment(self) -> None:
        """Move this record's ids, masks and replies into a closed segment; start an empty one."""
        self.segments.append(
            SessionRecord(
                session_id=self.session_id,
                prompt_ids=self.prompt_ids,
                response_ids=self.response_ids,
                action_mask=self.action_mask,
                logprobs=self.logprobs,
                versions=self.versions,
                finish_reasons=self.finish_reasons,
                action_ranges=self.action_ranges,
                policy_version=self.policy_version,
            )
        )
        self.prompt_ids, self.response_ids, self.action_mask, self.logprobs = [], [], [], []
        self.versions, self.finish_reasons, self.action_ranges = [], [], []

    @property
    def finish_reason(self) -> str:
        """ "length" when truncated, else the last reply's reason ("abort" when there was none)."""
        if self.truncated:
            return "length"
        return self.finish_reasons[-1] if self.finish_reasons else "abort"


class _Session:
    def __init__(self, session_id: str) -> None:
        self.record = SessionRecord(session_id=session_id)
        self.history: list[dict[str, Any]] | None = None  # normalised messages, last reply included
        self.tools: Any = None
        self.ended_with_special = False  # the last reply ended with an end-of-turn token it wrote
        self.busy = False
        self.seed: int | None = None  # request k of the session samples with seed + k
        self.text = ""  # history="segments": the current segment as text (prompt, replies, deltas)

    @property
    def length(self) -> int:
        return len(self.record.prompt_ids) + len(self.record.response_ids)


# ----------------------------------------------------------------------------------------------
# Request checking: each function names the field it refuses.


def _bad(message: str, param: str | None, code: str = "invalid_value") -> ServerError:
    return ServerError(400, message, param=param, code=code)


MAX_BODY_BYTES = 8 << 20
"""`AgentServer`'s default cap on a request body (8 MiB)."""
MAX_QUEUE = 256
"""`AgentServer`'s default bound on chat / tokenize requests in flight or waiting at once."""
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LIMITED_PATHS = frozenset({"/v1/chat/completions", "/tokenize"})  # the routes that do work


def read_api_key(api_key_env: str | None) -> str | None:
    """The value of the environment variable named `api_key_env` (None: no key).

    Raises:
      ValueError: `api_key_env` is not a variable name (the message does not repeat it, in case it
        is the key itself), or the variable is unset or empty (the message names it).
    """
    if api_key_env is None:
        return None
    if not isinstance(api_key_env, str) or not _ENV_NAME.fullmatch(api_key_env):
        raise ValueError(
            "api_key_env: must be the NAME of an environment variable (letters, digits, _), not the key"
        )
    value = os.environ.get(api_key_env, "")
    if not value:
        raise ValueError(f"api_key_env: the environment variable {api_key_env} is not set or empty")
    return value


def _too_large(size: int, limit: int) -> ServerError:
    return ServerError(
        413,
        f"the request body has more than {limit} bytes ({size} so far); max_body_bytes is {limit}",
        code="too_large",
    )


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for position, part in enumerate(content):
            if not (
                isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise _bad(
                    f"{where}.content[{position}]: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                    f"{where}.content",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"{where}.content: expected a string or a list of text parts", f"{where}.content")


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """Tool calls as `{"id", "type": "function", "function": {"name", "arguments": dict}}`."""
    from .tools import decode_call_json

    if calls is None:
        return []
    if not isinstance(calls, list):
        raise _bad(f"{where}.tool_calls: expected a list", f"{where}.tool_calls")
    normalised = []
    for position, call in enumerate(calls):
        field = f"{where}.tool_calls[{position}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise _bad(f"{field}: expected {{'function': {{'name': str, 'arguments': ...}}}}", field)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            arguments, problem = decode_call_json(arguments) if arguments.strip() else ({}, None)
            if problem is not None:
                raise _bad(f"{field}.function.arguments: {problem}", field)
        if not isinstance(arguments, Mapping):
            raise _bad(f"{field}.function.arguments: expected a JSON object", field)
        normalised.append(
            {
                "id": str(call.get("id") or ""),
                "type": "function",
                "function": {"name": function["name"], "arguments": dict(arguments)},
            }
        )
    return normalised


def normalise_messages(messages: Any) -> list[dict[str, Any]]:
    """`messages` as the chat template gets them: role, content text, and for assistant turns the
    tool calls (arguments parsed), for tool turns tool_call_id and name. Raises `ServerError`."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages: expected a non-empty list of messages", "messages")
    normalised = []
    for position, message in enumerate(messages):
        where = f"messages[{position}]"
        if not isinstance(message, Mapping):
            raise _bad(f"{where}: expected an object with 'role' and 'content'", where)
        role = message.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role: {role!r} is not allowed; expected one of {ROLES}", f"{where}.role")
        entry: dict[str, Any] = {"role": role, "content": _content_text(message.get("content"), where)}
        if role == "assistant":
            calls = _tool_calls(message.get("tool_calls"), where)
            if calls:
                entry["tool_calls"] = calls
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if message.get(key) is not None:
                    entry[key] = str(message[key])
        normalised.append(entry)
    return normalised


def _same_message(sent: dict[str, Any], held: dict[str, Any]) -> bool:
    """Whether a re-sent message is the one the session holds. Tool call ids and an assistant
    message sent back without its tool calls are tolerated (clients differ there)."""
    if sent["role"] != held["role"] or sent["content"] != held["content"]:
        return False
    if sent["role"] == "assistant" and sent.get("tool_calls"):
        strip = [(c["function"]["name"], c["function"]["arguments"]) for c in sent["tool_calls"]]
        return strip == [
            (c["function"]["name"], c["function"]["arguments"]) for c in held.get("tool_calls", [])
        ]
    if sent["role"] == "tool":
        return all(sent.get(key) == held.get(key) for key in ("tool_call_id", "name") if key in held)
    return True


def _number(body: Mapping, field: str, low: float, high: float = math.inf) -> float | None:
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise _bad(f"{field}: {value!r} is not allowed; expected a number in [{low}, {high}]", field)
    return float(value)


def _integer(body: Mapping, field: str, low: int) -> int | None:
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _bad(f"{field}: {value!r} is not allowed; expected an integer >= {low}", field)
    return value


class AgentServer:
    """An OpenAI-compatible server over `engine` on 127.0.0.1 (see the module docstring).

    Args:
      engine: any `Engine` (its `agenerate` is called from the server's own thread and loop).
      tokenizer: a `transformers` tokenizer with a chat template; renders and tokenises messages.
      sampling: defaults of a request (temperature, top_p, max_new_tokens, stop, seed); a request's
        own fields override them. `n` must be 1 here.
      max_length: prompt + response tokens of a session; default `engine.max_model_len`.
      model_name: the one model served; a request naming another is refused.
      tool_parser: name in `rl_rollout.tools.TOOL_PARSERS` used on replies to requests with tools.
      skip_special_tokens: how a reply's text is decoded (vLLM's default: True).
      max_body_bytes: the largest request body; a larger one is refused with 413 before it is
        read in full (its Content-Length, or the bytes as they arrive).
      request_timeout_s: a deadline per request (its generation included): past it the request
        is answered 504, code "timeout", and the session is left as before the request; None: none.
      history: "append" or "segments" (`HISTORY_MODES`): what a request whose messages do not
        extend the session's history does (refused, or a new segment; see the module docstring).
      api_key_env: NAME of an environment variable holding the key every request must send as
        `Authorization: Bearer <key>` (else 401); read here, an unset or empty one is refused
        naming it. None: no authentication (the server binds 127.0.0.1 only).
      max_queue: chat completions and /tokenize requests in flight or waiting at once; one more
        gets 503 at once with `Retry-After` (counted in `refusals["busy"]`).
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        sampling: SamplingParams | None = None,
        *,
        max_length: int | None = None,
        model_name: str = "policy",
        tool_parser: str = "hermes",
        skip_special_tokens: bool = True,
        max_body_bytes: int = MAX_BODY_BYTES,
        request_timeout_s: float | None = 600.0,
        history: str = "append",
        api_key_env: str | None = None,
        max_queue: int = MAX_QUEUE,
    ) -> None:
        self._api_key = read_api_key(api_key_env)
        if not isinstance(max_queue, int) or isinstance(max_queue, bool) or max_queue < 1:
            raise ValueError(f"max_queue: {max_queue!r} is not allowed; expected an integer >= 1")
        self.max_queue, self.pending = max_queue, 0
        self.refusals = {"busy": 0, "unauthorized": 0}
        if history not in HISTORY_MODES:
            raise ValueError(f"history: {history!r} is not allowed; expected one of {HISTORY_MODES}")
        self.history = history
        if not isinstance(max_body_bytes, int) or isinstance(max_body_bytes, bool) or max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: {max_body_bytes!r} is not allowed; expected an integer >= 1")
        if request_timeout_s is not None and not (
            isinstance(request_timeout_s, (int, float)) and 0 < request_timeout_s < math.inf
        ):
            raise ValueError(
                f"request_timeout_s: {request_timeout_s!r} is not allowed; expected a number > 0 or None"
            )
        self.max_body_bytes, self.request_timeout_s = max_body_bytes, request_timeout_s
        if not isinstance(engine, Engine):
            raise TypeError(f"engine: expected an rl_rollout Engine, got {type(engine).__name__}")
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling: expected SamplingParams, got {type(sampling).__name__}")
        if not isinstance(model_name, str) or not model_name:
            raise ValueError(f"model_name: expected a non-empty string, got {model_name!r}")
        self.engine, self.tokenizer, self.sampling = engine, tokenizer, msgspec.structs.replace(sampling, n=1)
        self.max_length = engine.max_model_len if max_length is None else int(max_length)
        if self.max_length < 2:
            raise ValueError(f"max_length: {max_length!r} is not allowed; expected an integer >= 2")
        from .tools import TOOL_PARSERS

        if tool_parser not in TOOL_PARSERS:
            raise ValueError(
                f"tool_parser: {tool_parser!r} is not a registered parser; expected one of {sorted(TOOL_PARSERS)}"
            )
        self.model_name, self.tool_parser_name = model_name, tool_parser
        self.skip_special_tokens = skip_special_tokens
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None
        self.port: int | None = None
        self._special_ids = set(getattr(tokenizer, "all_special_ids", None) or [])

    # -- life cycle ----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """`http://127.0.0.1:PORT` (the OpenAI base URL is this + "/v1")."""
        if self.port is None:
            raise RuntimeError("AgentServer.url: the server is not started; call start() first")
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_key(self) -> str | None:
        """The key requests must send (the value of `api_key_env`), None without one: hand it to
        clients as the OpenAI `api_key`."""
        return self._api_key

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout_s: float = 30.0) -> str:
        """Serve on a free port of 127.0.0.1 from a thread of its own; the base URL."""
        if self.running:
            return self.url
        require_agent_extra()
        import uvicorn

        self.refusals = {"busy": 0, "unauthorized": 0}
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self._socket, self.port = sock, sock.getsockname()[1]
        config = uvicorn.Config(
            self._app(),
            log_level="warning",
            access_log=False,
            lifespan="off",
            loop="asyncio",
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [sock]},
            name=f"rl-agent-server-{self.port}",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"AgentServer: the server on 127.0.0.1 did not start within {timeout_s} s")
            time.sleep(0.01)
        return self.url

    def stop(self) -> None:
        """Stop serving (requests in flight get up to 2 s) and free the port; idempotent."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
            if self._thread.is_alive():
                logger.warning(
                    "AgentServer: the server thread on port %s did not stop within 30 s", self.port
                )
        if self._socket is not None:
            self._socket.close()
        self._server = self._thread = self._socket = None

    def __enter__(self) -> "AgentServer":
        self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    # -- sessions ------------------------------------------------------------------------------

    def open_session(self, session_id: str | None = None, *, seed: int | None = None) -> str:
        """Register a session (a fresh id when None); requests must name a registered session.

        `seed`: request k of the session (k = 0, 1, ...) samples with seed + k unless the request
        gives its own; None: the `sampling` default's seed. Episodes of one prompt need different
        seeds, or, sharing the prompt, they would draw the same tokens (`prompt_seed`)."""
        session_id = uuid.uuid4().hex if session_id is None else str(session_id)
        with self._lock:
            if session_id in self._sessions:
                raise ValueError(f"open_session: session {session_id!r} is already open")
            session = self._sessions[session_id] = _Session(session_id)
            session.record.policy_version = self.engine.policy_version
            session.seed = seed
        return session_id

    def peek(self, session_id: str) -> SessionRecord:
        """What an open session captured so far (the live record: do not change it)."""
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise KeyError(f"peek: no open session {session_id!r}")
        return session.record

    def close_session(self, session_id: str) -> SessionRecord:
        """Forget the session and return what it captured; later requests naming it get 404."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            raise KeyError(f"close_session: no open session {session_id!r}")
        return session.record

    # -- rendering -----------------------------------------------------------------------------

    def _render(self, messages: list[dict[str, Any]], tools: Any) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False, add_generation_prompt=True
            )
        except Exception as error:
            raise _bad(f"messages: the chat template failed on them: {error}", "messages") from error

    def _tokens(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _delta_text(self, new_messages: list[dict[str, Any]], tools: Any, ended_with_special: bool) -> str:
        """The template's text after an assistant turn: for `new_messages` and the generation
        prompt. When the reply ended with the end-of-turn token it wrote, that token is not repeated."""
        # a placeholder user turn first: some templates refuse a conversation that starts otherwise
        placeholder = [{"role": "user", "content": "\ue001"}, {"role": "assistant", "content": _MARKER}]
        rendered = self._render([*placeholder, *new_messages], tools)
        if rendered.count(_MARKER) != 1:
            raise ServerError(
                500,
                "the chat template does not render an assistant message's content in place",
                code="template",
            )
        delta = rendered.split(_MARKER, 1)[1]
        eos = self.tokenizer.eos_token
        if ended_with_special and eos and delta.startswith(eos):
            delta = delta[len(eos) :]
        return delta

    # -- the chat completion -------------------------------------------------------------------

    def _params(self, body: Mapping, room: int, session_seed: int | None = None) -> SamplingParams:
        unknown = sorted(set(body) - CHAT_FIELDS)
        if unknown:
            raise _bad(
                f"{unknown[0]}: this server does not honour it (fields it takes: {sorted(CHAT_FIELDS)})",
                unknown[0],
                "unsupported_field",
            )
        if body.get("stream"):
            raise _bad("stream: streaming is not supported; leave stream unset or false", "stream")
        if body.get("n", 1) != 1:
            raise _bad(
                f"n: {body.get('n')!r} is not allowed; one choice per request (run requests in parallel)", "n"
            )
        if body.get("top_logprobs"):
            raise _bad(
                "top_logprobs: engines report the sampled token's log-prob only, no alternatives; "
                "omit top_logprobs or set it to 0",
                "top_logprobs",
            )
        if body.get("logprobs") not in (None, True, False):
            raise _bad(
                f"logprobs: {body.get('logprobs')!r} is not allowed; expected true or false", "logprobs"
            )
        if body.get("tool_choice") not in (None, "auto", "none"):
            raise _bad("tool_choice: only 'auto' and 'none' are supported", "tool_choice")
        changes: dict[str, Any] = {}
        for field in ("max_tokens", "max_completion_tokens"):
            value = _integer(body, field, 1)
            if value is not None:
                changes["max_new_tokens"] = value
        for field, high in (("temperature", 2.0), ("top_p", 1.0)):
            value = _number(body, field, 0.0, high)
            if value is not None:
                changes[field] = value
        if "top_p" in changes and changes["top_p"] == 0:
            raise _bad("top_p: 0 is not allowed; expected a number in (0, 1]", "top_p")
        seed = body.get("seed")
        if seed is not None:
            changes["seed"] = _integer(body, "seed", 0)
        elif session_seed is not None:
            changes["seed"] = session_seed
        stop = body.get("stop")
        if stop is not None:
            stops = [stop] if isinstance(stop, str) else stop
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                raise _bad("stop: expected a non-empty string or a list of them", "stop")
            changes["stop"] = tuple(stops)
        wanted = changes.get("max_new_tokens", self.sampling.max_new_tokens)
        changes["max_new_tokens"] = min(wanted, room)
        changes["min_new_tokens"] = min(self.sampling.min_new_tokens, changes["max_new_tokens"])
        changes["logprobs"] = True  # always captured for training, returned only when asked
        return msgspec.structs.replace(self.sampling, **changes)

    def _session_for(self, body: Mapping, header: str | None) -> _Session:
        session_id = body.get("session_id", header)
        if session_id is None:
            raise _bad(
                "session_id: missing; name the session in the body (extra_body={'session_id': ...}) "
                "or in the X-Session-ID header",
                "session_id",
                "missing_session",
            )
        with self._lock:
            session = self._sessions.get(str(session_id))
            if session is None:
                raise ServerError(
                    404,
                    f"session_id: {session_id!r} is not an open session (never opened, or closed when its "
                    "episode ended)",
                    param="session_id",
                    code="unknown_session",
                )
            if session.busy:
                raise ServerError(
                    409,
                    f"session_id: {session_id!r} has a request in flight; a session is one conversation, "
                    "its requests go one after the other",
                    param="session_id",
                    code="session_busy",
                )
            session.busy = True
        return session

    async def chat(self, body: Any, session_header: str | None = None) -> dict[str, Any]:
        """One chat completion (the route's work); raises `ServerError` for a refused request."""
        if not isinstance(body, Mapping):
            raise _bad("the request body must be a JSON object", None)
        if body.get("model") != self.model_name:
            raise ServerError(
                404,
                f"model: {body.get('model')!r} is not served here; the model is {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        messages = normalise_messages(body.get("messages"))
        tools = body.get("tools")
        if tools is not None and (
            not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools)
        ):
            raise _bad("tools: expected a list of tool objects", "tools")
        session = self._session_for(body, session_header)
        try:
            return await self._chat_in_session(session, body, messages, tools)
        finally:
            session.busy = False

    async def _chat_in_session(
        self, session: _Session, body: Mapping, messages: list[dict[str, Any]], tools: Any
    ) -> dict[str, Any]:
        record = session.record
        delta_ids, kind, text = self._next_prompt(session, messages, tools)
        held = session.length if kind == "delta" else 0  # a new segment starts from its prompt
        if held + len(delta_ids) >= self.max_length:
            record.truncated = True
            raise _bad(
                f"messages: the session would hold {held + len(delta_ids)} tokens, which leaves "
                f"no room for a reply within max_length {self.max_length}; the session is truncated",
                "messages",
                "context_length_exceeded",
            )
        turn_seed = None if session.seed is None else session.seed + record.requests
        params = self._params(body, self.max_length - held - len(delta_ids), turn_seed)
        prompt = record.prompt_ids + record.response_ids + delta_ids if kind == "delta" else delta_ids
        try:
            [generation] = (await self.engine.agenerate(prompt, params))[:1]
        except EngineError as error:
            raise ServerError(500, f"engine: {error}", code="engine_error") from error
        except Exception as error:  # the details go to the server's log, not to the client
            logger.exception("AgentServer: the engine failed on a request")
            raise ServerError(
                500,
                f"engine: the generation failed ({type(error).__name__}; see the server's log)",
                code="engine_error",
            ) from error
        self._append(session, delta_ids, kind, generation, text)
        text = self.tokenizer.decode(generation.token_ids, skip_special_tokens=self.skip_special_tokens)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = generation.finish_reason
        record.used_tools = record.used_tools or bool(tools)
        if tools and body.get("tool_choice") != "none":
            content, calls, malformed = self._parse_tool_calls(text)
            record.tool_call_errors += malformed
            if calls:
                message = {"role": "assistant", "content": content or None, "tool_calls": calls}
                finish = "tool_calls"
                record.tool_calls += len(calls)
        session.history = [*messages, normalise_messages([message])[0]]
        session.tools = tools
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if body.get("logprobs"):
            choice["logprobs"] = {
                "content": [
                    {
                        "token": self.tokenizer.decode([token]),
                        "logprob": logprob,
                        "bytes": list(self.tokenizer.decode([token]).encode()),
                        "top_logprobs": [],
                    }
                    for token, logprob in zip(generation.token_ids, generation.logprobs or [], strict=False)
                ]
            }
        prompt_tokens = len(prompt)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(generation.token_ids),
                "total_tokens": prompt_tokens + len(generation.token_ids),
            },
            "session_id": record.session_id,
        }

    def _next_prompt(
        self, session: _Session, messages: list[dict[str, Any]], tools: Any
    ) -> tuple[list[int], str, str]:
        """(ids, kind, text) of a request: kind "prompt" (the session's first request: ids are its
        prompt), "delta" (ids go after the session's tokens) or "segment" (ids are a new segment's
        prompt); text: the rendering those ids came from (history="segments" keeps it)."""
        if session.history is None:
            text = self._render(messages, tools)
            return self._tokens(text), "prompt", text
        if self.history == "segments":
            text = self._render(messages, tools)
            if text.startswith(session.text):
                delta = text[len(session.text) :]
                return self._tokens(delta), "delta", delta
            return self._tokens(text), "segment", text
        held = session.history
        if len(messages) <= len(held):
            raise _bad(
                f"messages: {len(messages)} messages do not extend this session's {len(held)} "
                "(its history with the last reply); a session's conversation only grows: open a new "
                "session for another conversation (or serve with history='segments')",
                "messages",
                "history_mismatch",
            )
        for position, (sent, kept) in enumerate(zip(messages, held, strict=False)):
            if not _same_message(sent, kept):
                raise _bad(
                    f"messages[{position}] ({sent['role']}) differs from the message this session holds "
                    "there; a session's history cannot be edited: open a new session for another "
                    "conversation (or serve with history='segments')",
                    f"messages[{position}]",
                    "history_mismatch",
                )
        if (tools or None) != (session.tools or None):
            raise _bad(
                "tools: differ from the tools of this session's first request; they are rendered "
                "once, into its prompt",
                "tools",
                "history_mismatch",
            )
        delta = self._delta_text(messages[len(held) :], tools, session.ended_with_special)
        return self._tokens(delta), "delta", delta

    def _append(
        self, session: _Session, delta_ids: list[int], kind: str, generation: Generation, text: str
    ) -> None:
        record = session.record
        if session.record.session_id not in self._sessions:
            return  # closed while the engine worked (its episode timed out): nothing to keep
        if kind == "segment":
            record.close_segment()
        if kind != "delta":
            record.prompt_ids = list(delta_ids)
            session.text = text
            record.policy_version = generation.policy_version
        else:
            record.response_ids.extend(delta_ids)
            record.action_mask.extend([False] * len(delta_ids))
            record.versions.extend(record.versions[-1:] * len(delta_ids))
            if record.logprobs is not None:
                record.logprobs.extend([0.0] * len(delta_ids))
            session.text += text
        if self.history == "segments":
            session.text += self.tokenizer.decode(generation.token_ids, skip_special_tokens=False)
        start = len(record.response_ids)
        record.response_ids.extend(generation.token_ids)
        record.action_mask.extend([True] * len(generation.token_ids))
        record.versions.extend(generation.versions())
        if record.logprobs is not None and generation.logprobs is not None:
            record.logprobs.extend(generation.logprobs)
        else:
            record.logprobs = None
        record.action_ranges.append((start, len(record.response_ids)))
        record.finish_reasons.append(generation.finish_reason)
        session.ended_with_special = (
            bool(generation.token_ids) and generation.token_ids[-1] in self._special_ids
        )

    def _parse_tool_calls(self, text: str) -> tuple[str, list[dict[str, Any]], int]:
        """(content without the call markup, OpenAI tool_calls, malformed calls) by the server's
        tool parser. Call ids are unique within the server (the parser numbers calls per turn)."""
        from .tools import TOOL_PARSERS, parse_safely

        parsed = parse_safely(TOOL_PARSERS[self.tool_parser_name], text)
        calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:12]}_{call.id}",
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
            }
            for call in parsed.calls
        ]
        return parsed.content, calls, len(parsed.errors)

    # -- the other routes ----------------------------------------------------------------------

    def tokenize(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, Mapping):
            raise _bad("the request body must be a JSON object", None)
        if "messages" in body:
            messages = normalise_messages(body["messages"])
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=body.get("tools") or None,
                tokenize=False,
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            )
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise _bad("tokenize: expected 'messages' (a list) or 'prompt' (a string)", "messages")
        tokens = self._tokens(text)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.max_length}

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "rl-rollout"}],
        }

    def _app(self) -> Any:
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse
        from starlette.exceptions import HTTPException

        app = FastAPI(title="rl-rollout agent server", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_middleware(_Gate, server=self)
        server = self

        def error_response(error: ServerError) -> JSONResponse:
            return JSONResponse(error.body(), status_code=error.status)

        @app.exception_handler(HTTPException)
        async def http_error(request: Request, error: HTTPException) -> JSONResponse:
            return error_response(ServerError(error.status_code, f"{request.url.path}: {error.detail}"))

        async def json_body(request: Request) -> Any:
            limit = server.max_body_bytes
            declared = request.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:
                raise _too_large(int(declared), limit)
            body = bytearray()
            async for chunk in request.stream():  # counted as it arrives: no unbounded read
                body += chunk
                if len(body) > limit:
                    raise _too_large(len(body), limit)
            try:
                return json.loads(body)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise _bad(f"the request body is not valid JSON: {error}", None) from None
            except (ValueError, RecursionError) as error:  # a huge integer, a deep nesting
                raise _bad(f"the request body is not usable JSON ({type(error).__name__})", None) from None

        async def within_deadline(coroutine: Any) -> Any:
            if server.request_timeout_s is None:
                return await coroutine
            try:
                return await asyncio.wait_for(coroutine, server.request_timeout_s)
            except (asyncio.TimeoutError, TimeoutError):
                raise ServerError(
                    504, f"the request took longer than {server.request_timeout_s:g} s", code="timeout"
                ) from None

        @app.get("/health")
        async def health() -> dict[str, Any]:
            return {"status": "ok", "model": server.model_name}

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return server.models()

        @app.post("/tokenize")
        async def tokenize(request: Request) -> JSONResponse:
            try:
                return JSONResponse(server.tokenize(await within_deadline(json_body(request))))
            except ServerError as error:
                return error_response(error)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> JSONResponse:
            try:
                session = request.headers.get(SESSION_HEADER)

                async def answer() -> dict[str, Any]:
                    return await server.chat(await json_body(request), session)

                return JSONResponse(await within_deadline(answer()))
            except ServerError as error:
                return error_response(error)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # a bug here: an OpenAI-shaped answer, the details in the log
                logger.exception("AgentServer: chat completion failed")
                message = f"internal error ({type(error).__name__}; see the server's log)"
                return error_response(ServerError(500, message, code="internal"))

        return app


class _Gate:
    """ASGI middleware in front of every route: the key (401), then the bound on pending work
    (503 with Retry-After). It runs on the server's one event loop, so its counters need no lock."""

    def __init__(self, app: Any, server: AgentServer) -> None:
        self.app, self.server = app, server

    def _authorized(self, scope: Mapping[str, Any]) -> bool:
        key = self.server.api_key
        if key is None:
            return True
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        from fastapi.responses import JSONResponse

        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        server = self.server
        if not self._authorized(scope):
            server.refusals["unauthorized"] += 1
            error = ServerError(
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                "(the key in the server's api_key_env)",
                code="invalid_api_key",
            )
            headers = {"WWW-Authenticate": "Bearer"}
            return await JSONResponse(error.body(), 401, headers)(scope, receive, send)
        if scope.get("path") not in _LIMITED_PATHS:
            return await self.app(scope, receive, send)
        if server.pending >= server.max_queue:
            server.refusals["busy"] += 1
            error = ServerError(
                503,
                f"busy: {server.max_queue} requests are already in flight or waiting (max_queue); "
                "retry later",
                code="busy",
            )
            return await JSONResponse(error.body(), 503, {"Retry-After": "1"})(scope, receive, send)
        server.pending += 1
        try:
            await self.app(scope, receive, send)
        finally:
            server.pending -= 1
