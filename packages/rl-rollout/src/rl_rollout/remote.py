"""A client for remote reward servers that speak OpenRLHF's HTTP API.

    POST <url>  {"query": [B strings], "prompts": [B strings], "labels": [B labels]}
         ->     {"rewards": [B numbers], "scores": [B numbers] (optional), "extra_logs": {...} (optional)}

`RemoteRewardClient(urls)` is a `RewardFunction`: a call splits the samples into batches of
`batch_size`, sends them concurrently (one thread per in-flight request, `max_workers` at most)
to several endpoints, and puts the answers back in sample order.

Load balancing: "least_loaded" (default) sends each request to the endpoint with the fewest
requests in flight, "round_robin" cycles through them; either way an endpoint that just failed
with a connection error is skipped for `down_s` seconds while another one is up, so one dead
server costs one failed attempt, not a share of every batch.

Failures: connection errors, timeouts and HTTP 5xx are retried up to `max_retries` times with
exponential backoff (`backoff_s`·2^k, capped at `max_backoff_s`), each retry on the next
endpoint. HTTP 4xx, malformed JSON and answers that do not fit (missing "rewards", a wrong
number of values, non-numbers, NaN or ±inf) are not retried: the server is wrong, not busy. The
error (`RemoteRewardError`) names the endpoint, the batch (its sample range) and the field.
An overall `deadline_s` bounds every call, retries included, so nothing hangs. With
`on_error="fallback"` a failed batch gets the fallback reward instead, counted and logged.

Only the standard library does HTTP (urllib + threads); answers are decoded and typed with msgspec.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ALL_COMPLETED, FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

import msgspec

from .rewards import (
    RewardError,
    RewardOutput,
    RewardTimeout,
    _check_on_error,
    _loggable,
    check_reward_inputs,
)

__all__ = [
    "BALANCING",
    "RemoteRewardClient",
    "RemoteRewardError",
    "RemoteRewardTimeout",
    "RewardRequest",
    "RewardResponse",
]

logger = logging.getLogger(__name__)

BALANCING = ("least_loaded", "round_robin")


class RemoteRewardError(RewardError):
    """A remote reward request failed for good; the message names the endpoint, batch and field."""


class RemoteRewardTimeout(RemoteRewardError, RewardTimeout):
    """A remote reward request failed for good by time: the deadline, or a last attempt unanswered."""


class RewardRequest(msgspec.Struct):
    """The request body (OpenRLHF's field names)."""

    query: list[str]
    prompts: list[str]
    labels: list[Any]


class RewardResponse(msgspec.Struct):
    """The answer body; "scores" defaults to "rewards", "extra_logs" to {}."""

    rewards: list[float]
    scores: list[float] | None = None
    extra_logs: dict[str, Any] = msgspec.field(default_factory=dict)


class _Retryable(Exception):
    """An attempt failed in a way worth retrying (connection, timeout, 5xx); `down`: unreachable."""

    def __init__(self, message: str, *, down: bool = False, timed_out: bool = False) -> None:
        super().__init__(message)
        self.down, self.timed_out = down, timed_out


class _Endpoint:
    def __init__(self, url: str) -> None:
        self.url = url
        self.in_flight = 0
        self.down_until = 0.0
        self.requests = 0
        self.failures = 0


class RemoteRewardClient:
    """`RewardFunction` backed by one or more OpenRLHF-compatible reward servers.

    Args:
      urls: one URL or a list (http://host:port/path).
      batch_size: samples per request.
      timeout_s: socket timeout of one attempt (connect and read).
      max_retries: extra attempts after the first, for retryable failures.
      backoff_s, max_backoff_s: sleep before retry k is min(backoff_s·2^k, max_backoff_s).
      deadline_s: bound on a whole call; default timeout_s·(max_retries + 1) + 5 s.
      balancing: "least_loaded" or "round_robin".
      max_workers: concurrent requests (default: 4 per endpoint).
      down_s: how long an endpoint that refused a connection is avoided.
      on_error: "raise" or "fallback" (a failed batch gets `fallback`).
      headers: extra HTTP headers (e.g. authorization).
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        batch_size: int = 64,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        deadline_s: float | None = None,
        balancing: str = "least_loaded",
        max_workers: int | None = None,
        down_s: float = 5.0,
        on_error: str = "raise",
        fallback: float = 0.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        url_list = [urls] if isinstance(urls, str) else list(urls)
        if not url_list:
            raise ValueError("urls: expected at least one URL")
        for url in url_list:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(f"urls: {url!r} is not allowed; expected an http:// or https:// URL")
        for argument, value in (("batch_size", batch_size), ("max_retries", max_retries)):
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < (1 if argument == "batch_size" else 0)
            ):
                raise ValueError(
                    f"{argument}: {value!r} is not allowed; expected an integer >= "
                    f"{1 if argument == 'batch_size' else 0}"
                )
        for argument, value, low in (
            ("timeout_s", timeout_s, 1e-9),
            ("backoff_s", backoff_s, 0.0),
            ("max_backoff_s", max_backoff_s, 0.0),
            ("down_s", down_s, 0.0),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value < math.inf:
                bound = "> 0" if low else ">= 0"
                raise ValueError(f"{argument}: {value!r} is not allowed; expected a finite number {bound}")
        if balancing not in BALANCING:
            raise ValueError(f"balancing: {balancing!r} is not allowed; expected one of {BALANCING}")
        self.endpoints = [_Endpoint(url) for url in url_list]
        self.batch_size = batch_size
        self.timeout_s = float(timeout_s)
        self.max_retries = max_retries
        self.backoff_s, self.max_backoff_s, self.down_s = (
            float(backoff_s),
            float(max_backoff_s),
            float(down_s),
        )
        self.deadline_s = (
            float(deadline_s) if deadline_s is not None else self.timeout_s * (max_retries + 1) + 5.0
        )
        if not (math.isfinite(self.deadline_s) and self.deadline_s > 0):
            raise ValueError(f"deadline_s: {deadline_s!r} is not allowed; expected a finite number > 0")
        self.balancing = balancing
        self.max_workers = max_workers or 4 * len(url_list)
        self.on_error = on_error
        self.fallback = _check_on_error(on_error, fallback)
        self.headers = {"Content-Type": "application/json", **dict(headers or {})}
        self.name = f"RemoteRewardClient({', '.join(url_list)})"
        self._lock = threading.Lock()
        self._next = 0
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder(RewardResponse)
        self.num_calls = self.num_samples = self.num_fallbacks = self.num_retries = self.num_timeouts = 0

    # -- endpoint choice ---------------------------------------------------------------------

    def _acquire(self, avoid: _Endpoint | None) -> _Endpoint:
        with self._lock:
            now = time.monotonic()
            count = len(self.endpoints)
            order = [self.endpoints[(self._next + k) % count] for k in range(count)]
            self._next = (self._next + 1) % count
            up = [e for e in order if e.down_until <= now and e is not avoid]
            candidates = up or [e for e in order if e is not avoid] or order
            chosen = (
                min(candidates, key=lambda e: e.in_flight)
                if self.balancing == "least_loaded"
                else candidates[0]
            )
            chosen.in_flight += 1
            chosen.requests += 1
            return chosen

    def _release(self, endpoint: _Endpoint, *, failed: bool, down: bool) -> None:
        with self._lock:
            endpoint.in_flight -= 1
            if failed:
                endpoint.failures += 1
            if down:
                endpoint.down_until = time.monotonic() + self.down_s

    # -- one request -------------------------------------------------------------------------

    def _post(self, endpoint: _Endpoint, body: bytes, timeout: float, where: str) -> RewardResponse:
        request = urllib.request.Request(endpoint.url, data=body, headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                payload = response.read()
        except urllib.error.HTTPError as error:
            detail = error.read()[:200].decode("utf-8", "replace")
            message = f"{where}: HTTP {error.code} from {endpoint.url}: {detail!r}"
            if error.code >= 500:
                raise _Retryable(message) from None
            raise RemoteRewardError(message) from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            if isinstance(reason, TimeoutError) or isinstance(error, TimeoutError):
                raise _Retryable(
                    f"{where}: no answer from {endpoint.url} within {timeout:.3g} s", timed_out=True
                ) from None
            raise _Retryable(f"{where}: cannot reach {endpoint.url}: {reason!r}", down=True) from None
        try:
            return self._decoder.decode(payload)
        except msgspec.ValidationError as error:
            raise RemoteRewardError(f"{where}: bad answer from {endpoint.url}: {error}") from None
        except msgspec.DecodeError as error:
            raise RemoteRewardError(
                f"{where}: malformed JSON from {endpoint.url}: {error} (body starts {payload[:80]!r})"
            ) from None

    def _check(self, answer: RewardResponse, size: int, endpoint: _Endpoint, where: str) -> RewardOutput:
        fields = {
            "rewards": answer.rewards,
            "scores": answer.scores if answer.scores is not None else answer.rewards,
        }
        for field, values in fields.items():
            if len(values) != size:
                raise RemoteRewardError(
                    f"{where}: {endpoint.url} returned {len(values)} {field} for {size} samples"
                )
            for index, value in enumerate(values):
                if not math.isfinite(value):
                    raise RemoteRewardError(f"{where}: {endpoint.url} returned {field}[{index}] = {value}")
        return RewardOutput(
            rewards=list(fields["rewards"]),
            scores=list(fields["scores"]),
            extra_logs=_loggable(answer.extra_logs),
        )

    def _run_batch(self, start: int, request: RewardRequest, deadline: float) -> RewardOutput:
        size = len(request.query)
        where_batch = f"{self.name}, batch of samples [{start}, {start + size})"
        try:
            body = self._encoder.encode(request)
        except (TypeError, msgspec.EncodeError) as error:
            raise RemoteRewardError(
                f"{where_batch}: labels or texts cannot be sent as JSON: {error}"
            ) from None
        last_error = "no attempt was made"
        last_timed_out = False
        avoid = None
        for attempt in range(self.max_retries + 1):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            endpoint = self._acquire(avoid)
            where = f"{where_batch}, attempt {attempt + 1}"
            failed = down = False
            try:
                answer = self._post(endpoint, body, min(self.timeout_s, remaining), where)
                return self._check(answer, size, endpoint, where)
            except _Retryable as error:
                failed, down = True, error.down
                last_error, last_timed_out = str(error), error.timed_out
                avoid = endpoint
            except RemoteRewardError:
                failed = True
                raise
            finally:
                self._release(endpoint, failed=failed, down=down)
            if attempt < self.max_retries:
                with self._lock:
                    self.num_retries += 1
                pause = min(
                    self.backoff_s * 2**attempt, self.max_backoff_s, max(0.0, deadline - time.monotonic())
                )
                # one line per event, with the URL and the attempt (the engine's log in rl-launch)
                logger.warning(
                    "%s; retry %d of %d in %.2f s", last_error, attempt + 1, self.max_retries, pause
                )
                time.sleep(pause)
        if time.monotonic() >= deadline:
            raise RemoteRewardTimeout(
                f"{where_batch}: deadline of {self.deadline_s} s passed; last error: {last_error}"
            )
        raise (RemoteRewardTimeout if last_timed_out else RemoteRewardError)(
            f"{where_batch}: gave up after {self.max_retries + 1} attempts; last error: {last_error}"
        )

    # -- the RewardFunction interface ---------------------------------------------------------

    def __call__(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any]) -> RewardOutput:
        batch_size = check_reward_inputs(queries, prompts, labels, self.name)
        self.num_calls += 1
        self.num_samples += batch_size
        deadline = time.monotonic() + self.deadline_s
        starts = list(range(0, batch_size, self.batch_size))
        rewards = [self.fallback] * batch_size
        scores = [self.fallback] * batch_size
        extra_logs: dict[str, Any] = {}
        fallbacks: list[int] = []
        timeouts: list[int] = []
        if not starts:
            return RewardOutput(rewards=[], scores=[])
        pool = ThreadPoolExecutor(
            max_workers=min(self.max_workers, len(starts)), thread_name_prefix="remote-reward"
        )
        try:
            futures = {}
            for start in starts:
                end = min(start + self.batch_size, batch_size)
                request = RewardRequest(
                    query=list(queries[start:end]),
                    prompts=list(prompts[start:end]),
                    labels=list(labels[start:end]),
                )
                futures[pool.submit(self._run_batch, start, request, deadline)] = (start, end)
            # The batches check the deadline themselves; the margin covers one socket timeout.
            mode = FIRST_EXCEPTION if self.on_error == "raise" else ALL_COMPLETED
            done, pending = wait(futures, timeout=self.deadline_s + 1.0, return_when=mode)
            for future in pending:
                future.cancel()
            if self.on_error == "raise":
                for future in futures:
                    if future in done and future.exception() is not None:
                        raise future.exception()
            for future, (start, end) in futures.items():
                if future in done and future.exception() is None:
                    output = future.result()
                    rewards[start:end], scores[start:end] = output.rewards, output.scores
                    for key, value in output.extra_logs.items():
                        extra_logs.setdefault(key, []).extend(value if isinstance(value, list) else [value])
                    continue
                error = (
                    future.exception()
                    if future in done
                    else RemoteRewardTimeout(
                        f"{self.name}, batch of samples [{start}, {end}): no answer within {self.deadline_s} s"
                    )
                )
                if self.on_error == "raise" or not isinstance(error, RewardError):
                    raise error
                logger.warning("%s; %d samples get reward %s", error, end - start, self.fallback)
                fallbacks.extend(range(start, end))
                if isinstance(error, RewardTimeout):
                    timeouts.extend(range(start, end))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        self.num_fallbacks += len(fallbacks)
        self.num_timeouts += len(timeouts)
        return RewardOutput(
            rewards=rewards,
            scores=scores,
            extra_logs=extra_logs,
            fallback_indices=fallbacks,
            timeout_indices=timeouts,
        )

    def metrics(self) -> dict[str, float]:
        """Running counts: calls, samples, fallbacks, retries, and requests / failures per endpoint."""
        out = {
            "reward/calls": float(self.num_calls),
            "reward/samples": float(self.num_samples),
            "reward/fallbacks": float(self.num_fallbacks),
            "reward/timeouts": float(self.num_timeouts),
            "reward/retries": float(self.num_retries),
        }
        for endpoint in self.endpoints:
            out[f"reward/requests/{endpoint.url}"] = float(endpoint.requests)
            out[f"reward/failures/{endpoint.url}"] = float(endpoint.failures)
        return out
