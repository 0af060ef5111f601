"""`HTTPEngine`: a client of an OpenAI-compatible completions server (`vllm serve`), token ids in and out.

Each prompt becomes one POST to `/v1/completions` with the prompt as a list of token ids and
vLLM's extensions that keep text out of the loop: `return_token_ids` (the response's token
ids), `logprobs=0` with `return_tokens_as_token_ids` (the sampled token's log-prob, its token
named "token_id:<id>", checked against `token_ids`), `skip_special_tokens=false`, `min_tokens`,
`stop_token_ids`, `ignore_eos`, `top_k`, `seed`. The server batches concurrent requests, so
`generate` sends one request per prompt from a thread pool and `agenerate` shares that pool:
up to `max_concurrency` requests are in flight.

    engine = HTTPEngine("http://127.0.0.1:8000")           # model and max_model_len from /v1/models
    engine.generate([[1, 2, 3]], SamplingParams(n=4, temperature=1.0, max_new_tokens=64))

Log-prob convention: vLLM reports what its `--logprobs-mode` says. Start the server with
`--logprobs-mode processed_logprobs` to get log softmax(z / T) of the sampled token (the
protocol's convention; vLLM renormalises after top-k / top-p when those are set); the default
`raw_logprobs` gives log softmax(z), temperature ignored.

Requests are checked before they leave (`check_prompts`) and `max_tokens` is cut so that prompt
+ response fits `max_model_len` (the server would reject the request otherwise). Greedy
requests with n > 1 are sent with n = 1 (vLLM refuses greedy n > 1) and the answer copied.

Failures: the connection is opened within `connect_timeout_s` and every read waits at most
`read_timeout_s`. Connection errors (refused, reset, connect timeout) and 5xx answers are
retried up to `max_retries` times with exponential backoff (`backoff_s` · 2^attempt); a 4xx
answer, a read timeout and a malformed answer (bad JSON, wrong number of choices, lengths that
disagree, a missing field) raise EngineError at once, naming the prompt and what was wrong.
The response JSON is decoded with msgspec into typed structs.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import msgspec

from rl_data.errors import check_integer

from ..protocol import (
    Engine,
    EngineError,
    Generation,
    SamplingParams,
    check_images,
    check_prompts,
    prompt_seed,
)

__all__ = ["HTTPEngine", "wait_for_server"]

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class _LogProbs(msgspec.Struct):
    token_logprobs: list[float | None]
    tokens: list[str]


class _Choice(msgspec.Struct):
    index: int
    finish_reason: str | None
    logprobs: _LogProbs | None = None
    token_ids: list[int] | None = None
    text: str = ""


class _Completion(msgspec.Struct):
    choices: list[_Choice]


class _ModelCard(msgspec.Struct):
    id: str
    max_model_len: int | None = None


class _ModelList(msgspec.Struct):
    data: list[_ModelCard]


class _Retryable(Exception):
    """A failure worth another attempt (connection error, 5xx)."""


def _check_number(where: str, name: str, value, low: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= low:
        raise ValueError(f"{where}: {name} must be a number >= {low}, got {value!r}")


class HTTPEngine(Engine):
    """An OpenAI-compatible completions server (vLLM) behind the engine protocol.

    Args:
        base_url: the server's root, e.g. "http://127.0.0.1:8000" (a trailing "/v1" is accepted).
        model: the model name to request; default the first model of `/v1/models`.
        max_model_len: context length; default the `max_model_len` that vLLM reports in `/v1/models`.
        api_key: sent as "Authorization: Bearer <key>" when given.
        connect_timeout_s: most seconds to open a connection.
        read_timeout_s: most seconds to wait for any byte of an answer (a whole generation may
            take this long before the first byte arrives: keep it generous).
        max_retries: extra attempts after a connection error or a 5xx answer.
        backoff_s: the first wait between attempts; doubles each time.
        max_concurrency: requests in flight at once (threads of the pool).
    """

    name = "HTTPEngine"

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        max_model_len: int | None = None,
        api_key: str | None = None,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_concurrency: int = 64,
    ) -> None:
        where = self.name
        parsed = urllib.parse.urlsplit(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"{where}: base_url must look like http://host:port, got {base_url!r}")
        _check_number(where, "connect_timeout_s", connect_timeout_s, 1e-3)
        _check_number(where, "read_timeout_s", read_timeout_s, 1e-3)
        _check_number(where, "backoff_s", backoff_s, 0)
        check_integer(f"{where}: max_retries", max_retries, 0)
        check_integer(f"{where}: max_concurrency", max_concurrency, 1)
        self.base_url = base_url
        self._scheme, self._host = parsed.scheme, parsed.hostname
        self._port = parsed.port or (443 if parsed.scheme == "https" else 80)
        root = parsed.path.rstrip("/")
        self._prefix = root if root.endswith("/v1") else root + "/v1"
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self.connect_timeout_s, self.read_timeout_s = float(connect_timeout_s), float(read_timeout_s)
        self.max_retries, self.backoff_s = max_retries, float(backoff_s)
        self.policy_version = 0
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="HTTPEngine")
        if model is None or max_model_len is None:
            card = self._model_card(model)
            model = card.id if model is None else model
            if max_model_len is None:
                if card.max_model_len is None:
                    raise EngineError(
                        f"{where}: {self._url('/models')} does not report max_model_len for {card.id!r}; "
                        "pass max_model_len"
                    )
                max_model_len = card.max_model_len
        check_integer(f"{where}: max_model_len", max_model_len, 2)
        self.model = model
        self._max_model_len = max_model_len

    # --- protocol ---------------------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def supports(self, feature: str) -> bool:
        super().supports(feature)  # validates the name
        return feature == "async"

    _NO_IMAGES = (
        "prompts with images are not supported (the completions endpoint takes token ids only); use "
        "VLLMEngine or HFEngine for a vision-language model"
    )

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, images=None
    ) -> list[list[Generation]]:
        check_images(images, prompts, self.name, refusal=self._NO_IMAGES)
        if not isinstance(params, SamplingParams):
            raise EngineError(
                f"{self.name}.generate: params must be a SamplingParams, got {type(params).__name__}"
            )
        checked = check_prompts(prompts, params, self.max_model_len, self.name)
        futures = [
            self._pool.submit(self._complete, index, prompt, params) for index, prompt in enumerate(checked)
        ]
        return [future.result() for future in futures]

    async def agenerate(self, prompt: Sequence[int], params: SamplingParams, images=None) -> list[Generation]:
        """The `params.n` responses to one prompt; many concurrent callers share the request pool."""
        check_images(None if images is None else [images], [prompt], self.name, refusal=self._NO_IMAGES)
        checked = check_prompts([prompt], params, self.max_model_len, self.name)[0]
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._complete, 0, checked, params)

    def close(self) -> None:
        """Stop the request threads (requests in flight finish first)."""
        self._pool.shutdown(wait=True)

    # --- one request ------------------------------------------------------------------------------

    def request_body(self, prompt: list[int], params: SamplingParams) -> dict:
        """The JSON body of the completions request for one (checked) prompt."""
        max_tokens = min(params.max_new_tokens, self.max_model_len - len(prompt))
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "n": 1 if params.greedy else params.n,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "min_tokens": min(params.min_new_tokens, max_tokens),
            "stop": list(params.stop),
            "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": params.ignore_eos,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": False,
        }
        if params.top_k:
            body["top_k"] = params.top_k
        if params.seed is not None:  # the prompt mixed in, as every engine does
            body["seed"] = prompt_seed(params.seed, prompt)
        return body

    def _complete(self, index: int, prompt: list[int], params: SamplingParams) -> list[Generation]:
        where = f"{self.name}: request for prompt {index}"
        body = self.request_body(prompt, params)
        data = self._call("POST", "/completions", json.dumps(body).encode(), where)
        try:
            answer = msgspec.json.decode(data, type=_Completion)
        except msgspec.DecodeError as error:
            raise EngineError(
                f"{where}: malformed answer from {self._url('/completions')}: {error}; "
                f"body starts {data[:200]!r}"
            ) from None
        expected = body["n"]
        if len(answer.choices) != expected:
            raise EngineError(f"{where}: expected {expected} choices, the server sent {len(answer.choices)}")
        by_index = sorted(answer.choices, key=lambda choice: choice.index)
        if [choice.index for choice in by_index] != list(range(expected)):
            raise EngineError(
                f"{where}: choice indices {[c.index for c in answer.choices]} are not 0..{expected - 1}"
            )
        generations = [self._generation(choice, params, where, body["max_tokens"]) for choice in by_index]
        if params.greedy and params.n > 1:
            generations += [msgspec.structs.replace(generations[0], token_ids=list(generations[0].token_ids),
                            logprobs=None if generations[0].logprobs is None else list(generations[0].logprobs))
                            for _ in range(params.n - 1)]  # fmt: skip
        return generations

    def _generation(self, choice: _Choice, params: SamplingParams, where: str, max_tokens: int) -> Generation:
        where = f"{where}, choice {choice.index}"
        if choice.logprobs is None:
            raise EngineError(f"{where}: field `logprobs` is missing (the request asked for logprobs=0)")
        tokens, values = choice.logprobs.tokens, choice.logprobs.token_logprobs
        named = []
        for position, token in enumerate(tokens):
            prefix, _, number = token.partition(":")
            if prefix != "token_id" or not number.lstrip("-").isdigit():
                raise EngineError(
                    f"{where}: logprobs.tokens[{position}] is {token!r}, not 'token_id:<id>' "
                    "(the server must support return_tokens_as_token_ids)"
                )
            named.append(int(number))
        token_ids = choice.token_ids if choice.token_ids is not None else named
        if not (len(token_ids) == len(named) == len(values)):
            raise EngineError(
                f"{where}: lengths disagree: token_ids {len(token_ids)}, logprobs.tokens {len(named)}, "
                f"logprobs.token_logprobs {len(values)}"
            )
        if token_ids != named:
            raise EngineError(
                f"{where}: token_ids {token_ids[:8]}... differ from logprobs.tokens {named[:8]}..."
            )
        if len(token_ids) > max_tokens:
            raise EngineError(f"{where}: {len(token_ids)} tokens, more than max_tokens {max_tokens}")
        if any(value is None for value in values):
            raise EngineError(f"{where}: logprobs.token_logprobs holds null at position {values.index(None)}")
        finish = _FINISH.get(choice.finish_reason or "")
        if finish is None:
            raise EngineError(
                f"{where}: finish_reason {choice.finish_reason!r} is not one of {sorted(_FINISH)}"
            )
        return Generation(
            token_ids=list(token_ids),
            logprobs=[float(value) for value in values] if params.logprobs else None,
            finish_reason=finish,
            policy_version=self.policy_version,
        )

    # --- HTTP -------------------------------------------------------------------------------------

    def _url(self, path: str) -> str:
        return f"{self._scheme}://{self._host}:{self._port}{self._prefix}{path}"

    def _model_card(self, model: str | None) -> _ModelCard:
        where = f"{self.name}: {self._url('/models')}"
        data = self._call("GET", "/models", None, where)
        try:
            cards = msgspec.json.decode(data, type=_ModelList).data
        except msgspec.DecodeError as error:
            raise EngineError(f"{where}: malformed answer: {error}") from None
        if not cards:
            raise EngineError(f"{where}: the server lists no models")
        if model is None:
            return cards[0]
        for card in cards:
            if card.id == model:
                return card
        raise EngineError(f"{where}: model {model!r} is not served; the server has {[c.id for c in cards]}")

    def _once(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        connection_class = (
            http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
        )
        connection = connection_class(self._host, self._port, timeout=self.connect_timeout_s)
        try:
            try:
                connection.connect()
            except OSError as error:  # refused, unreachable, connect timeout
                raise _Retryable(f"cannot connect: {error}") from None
            connection.sock.settimeout(self.read_timeout_s)
            try:
                connection.request(method, self._prefix + path, body=body, headers=self._headers)
                response = connection.getresponse()
                data = response.read()
            except TimeoutError:
                raise EngineError(f"no answer within read_timeout_s={self.read_timeout_s:g} s") from None
            except (ConnectionError, http.client.HTTPException) as error:  # reset, closed mid-answer
                raise _Retryable(f"connection lost: {type(error).__name__}: {error}") from None
            return response.status, data
        finally:
            connection.close()

    def _call(self, method: str, path: str, body: bytes | None, where: str) -> bytes:
        """The answer's body for a 2xx status; retries connection errors and 5xx, raises EngineError otherwise."""
        attempts = self.max_retries + 1
        for attempt in range(attempts):
            try:
                status, data = self._once(method, path, body)
            except _Retryable as error:
                failure = str(error)
            except EngineError as error:
                raise EngineError(f"{where}: {method} {self._url(path)}: {error}") from None
            else:
                if 200 <= status < 300:
                    return data
                message = data[:500].decode(errors="replace")
                if status < 500:
                    raise EngineError(
                        f"{where}: {method} {self._url(path)} answered HTTP {status}: {message}"
                    )
                failure = f"HTTP {status}: {message}"
            if attempt + 1 < attempts:
                time.sleep(self.backoff_s * 2**attempt)
        raise EngineError(
            f"{where}: {method} {self._url(path)} failed after {attempts} attempts; last: {failure}"
        )


def wait_for_server(base_url: str, timeout_s: float = 180.0, *, process=None, poll_s: float = 0.5) -> None:
    """Block until `base_url/health` answers 200, or raise EngineError after `timeout_s`.

    `process` (a `subprocess.Popen`, optional): stop waiting with an error as soon as it exits.
    """
    parsed = urllib.parse.urlsplit(base_url)
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise EngineError(f"wait_for_server: the server process exited with code {process.returncode}")
        connection = http.client.HTTPConnection(parsed.hostname, parsed.port or 80, timeout=5)
        try:
            connection.request("GET", "/health")
            status = connection.getresponse().status
            if status == 200:
                return
            last = f"HTTP {status}"
        except OSError as error:
            last = f"{type(error).__name__}: {error}"
        finally:
            connection.close()
        time.sleep(poll_s)
    raise EngineError(f"wait_for_server: {base_url}/health not ready after {timeout_s:g} s (last: {last})")
